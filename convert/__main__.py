"""python -m convert HF_DIR OUT_DIR: a Hugging Face DeepSeek-V4 checkpoint -> a saved model.

Reads the official release layout (flat names, FP8 weights with ue8m0 block scales, packed FP4
experts) or the layout transformers' `save_pretrained` writes, checks everything against the
config before reading any data, and writes an orbax checkpoint that `equinox_dsv4.load(OUT_DIR)`
restores (sharded when given a mesh). On any problem: one message listing all of them, exit
status 1, and nothing left at OUT_DIR.

With --mesh (and always with several processes) the model is loaded onto a mesh of all devices,
each reading only what it holds, and saved from there. On several hosts, run the same command on
each with its --process-id (paths on a shared file system): each process reads and writes its
part.
"""

import argparse
import sys
import warnings

import jax.numpy as jnp

import equinox_dsv4 as ed
from equinox_dsv4.ckpt import CheckpointError

from .load import convert


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m convert",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "hf_dir", help="directory with config.json and model.safetensors[.index.json]"
    )
    parser.add_argument("out_dir", help="where to write the converted model (must not exist)")
    parser.add_argument(
        "--dtype", choices=("bfloat16", "float32"), default="bfloat16", help="parameter dtype"
    )
    parser.add_argument(
        "--no-mtp",
        action="store_true",
        help="skip the MTP block or DSpark drafter (mtp.*); without it they are converted when "
        "present (a transformers-saved checkpoint has none, whatever its config says)",
    )
    parser.add_argument(
        "--layers", type=int, metavar="N", help="keep only the first N layers (for smoke runs)"
    )
    parser.add_argument(
        "--quantized",
        action="store_true",
        help="keep the release's FP8/FP4 weights as stored (values and ue8m0 scales; each "
        "matmul dequantises its own weight): V4-Flash 145 GiB instead of 530 GiB in bfloat16",
    )
    parser.add_argument(
        "--numerics",
        choices=("exact", "release"),
        help="'release': the FP8/FP4 round trips of the official inference code; 'exact': none "
        "(as transformers). Default: 'release' for a release checkpoint (its config.json has a "
        "quantization_config), else 'exact'. The saved model keeps the choice",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.add_argument(
        "--mesh",
        metavar="AXIS=N,...",
        help="load onto this mesh of all devices and save from there, e.g. expert=8 (default "
        "with several processes: expert over all devices where it divides the experts)",
    )
    ed.parallel.add_distributed_arguments(parser)
    args = parser.parse_args(argv)
    with warnings.catch_warnings():  # restores the default display afterwards
        warnings.showwarning = _one_line
        try:
            ed.parallel.initialize_from_args(args)
            mesh = ed.make_mesh(**ed.parallel.parse_mesh(args.mesh)) if args.mesh else None
            summary = convert(
                args.hf_dir,
                args.out_dir,
                dtype=jnp.dtype(args.dtype),
                load_mtp=False if args.no_mtp else None,
                layers=args.layers,
                progress=not args.quiet,
                quantized=args.quantized,
                numerics=args.numerics,
                mesh=mesh,
            )
        except (CheckpointError, ValueError, FileNotFoundError, FileExistsError, OSError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
    if not ed.parallel.is_primary():
        return 0
    mib = summary["bytes"] / 2**20
    shared = (
        f" (this process; all: {summary['bytes_total'] / 2**20:.1f} MiB)"
        if summary["bytes"] != summary["bytes_total"]
        else ""
    )
    print(
        f"converted {summary['tensors']} tensors, {mib:.1f} MiB{shared} in "
        f"{summary['seconds']:.1f} s ({mib / summary['seconds']:.1f} MiB/s); "
        f"peak RSS {summary['peak_rss_bytes'] / 2**20:.0f} MiB -> {args.out_dir}",
        file=sys.stderr,
    )
    return 0


def _one_line(message, category, filename, lineno, file=None, line=None) -> None:
    del category, filename, lineno, file, line
    print(f"warning: {message}", file=sys.stderr)


if __name__ == "__main__":
    raise SystemExit(main())
