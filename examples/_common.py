"""What the example scripts share: where the model comes from, sampling options, streamed text.

With no model argument a script runs the embedded default: a tiny model built from
`equinox_dsv4/config/presets/tiny.json` with RANDOM (seeded) weights, so its text is
meaningless; it shows the whole path working. `--checkpoint DIR` (a model saved by `python -m
convert` or `equinox_dsv4.save`) or `--hf DIR` (a Hugging Face DeepSeek-V4 checkpoint) gives
real weights.
"""

import argparse
import sys
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

import equinox_dsv4 as ed


def new_parser(doc: str | None) -> argparse.ArgumentParser:
    """A parser whose `--help` shows the script's docstring as written."""
    return argparse.ArgumentParser(
        description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )


def run_reporting_errors(run: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    """`run(args)`, after joining the other processes when the arguments ask for several (see
    `add_mesh_arguments`); errors a user can fix (bad input or options, missing or unreadable
    files, a bad checkpoint, an unreachable coordinator) are one line on stderr and exit status
    1, not a traceback."""
    try:
        if hasattr(args, "coordinator"):
            ed.parallel.initialize_from_args(args)
        return run(args)
    except (ValueError, OSError) as e:  # CheckpointError is a ValueError
        print(f"error: {e}", file=sys.stderr)
        return 1


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """`--checkpoint` / `--hf` (else the embedded default), `--dtype`, `--seed`."""
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--checkpoint", metavar="DIR", help="a saved model (orbax)")
    source.add_argument("--hf", metavar="DIR", help="a Hugging Face checkpoint directory")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument(
        "--quantized",
        action="store_true",
        help="keep the release's FP8/FP4 weights quantised (--hf: as stored; the default model: "
        "quantised as the release stores it); with examples/train.py --lora, QLoRA",
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="seed of the default model's weights and of sampling"
    )


def add_adapter_argument(parser: argparse.ArgumentParser) -> None:
    """`--lora DIR`: run with a LoRA adapter (`with_adapter`)."""
    parser.add_argument(
        "--lora",
        metavar="DIR",
        help="a LoRA adapter, from examples/train.py --lora or peft (PEFT layout)",
    )


def with_adapter(model: ed.DeepseekV4, args: argparse.Namespace) -> ed.DeepseekV4:
    """`model` with the adapter `--lora` names (`ed.lora.load`: placed beside its weights)."""
    if args.lora is None:
        return model
    adapted = ed.lora.load(model, args.lora)
    say(f"adapter: {args.lora}")
    return adapted


def add_mesh_arguments(parser: argparse.ArgumentParser) -> None:
    """`--mesh` and the options of several processes (`ed.parallel.add_distributed_arguments`)."""
    parser.add_argument(
        "--mesh",
        metavar="AXIS=N,...",
        help="place the model on a mesh of all devices, e.g. fsdp=2,expert=4 (axes data, fsdp, "
        "tensor, expert); default: one device, or with several processes fsdp over all",
    )
    ed.parallel.add_distributed_arguments(parser)


def mesh_from(args: argparse.Namespace) -> Mesh | None:
    """The mesh `--mesh` asks for (`None`: one device, unless there are several processes)."""
    if args.mesh is None:
        return ed.make_mesh(fsdp=jax.device_count()) if jax.process_count() > 1 else None
    return ed.make_mesh(**ed.parallel.parse_mesh(args.mesh))


def say(*args, **kwargs) -> None:
    """`print` to stderr, in process 0 only (the others run the same program silently)."""
    if ed.parallel.is_primary():
        print(*args, file=sys.stderr, **kwargs)


def add_sampling_arguments(parser: argparse.ArgumentParser, *, max_new_tokens: int) -> None:
    """`--max-new-tokens`, `--temperature`, `--top-k`, `--top-p`."""
    parser.add_argument("--max-new-tokens", type=int, default=max_new_tokens)
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    parser.add_argument("--top-k", type=int, default=0, help="0: no top-k filter")
    parser.add_argument("--top-p", type=float, default=1.0)


def sampling(args: argparse.Namespace) -> ed.Sampling:
    return ed.Sampling(args.temperature, args.top_k, args.top_p)


TINY_DSPARK = dict(
    num_nextn_predict_layers=1,
    dspark_block_size=5,
    dspark_markov_rank=16,
    dspark_target_layer_ids=(6, 7, 8),
    dspark_noise_token_id=128799,
    dspark_stages=3,
)


def load_model(
    args: argparse.Namespace,
    *,
    mtp: bool | str | None = None,
    layers: int | None = None,
    mesh: Mesh | None = None,
) -> tuple[ed.DeepseekV4, str]:
    """The model the arguments name and a description of it.

    `mtp`: with or without the MTP blocks or DSpark drafter (`None`: the default model's MTP
    block, a checkpoint's drafters if it has them; `"mtp"` / `"dspark"`: the default model
    with that drafter, a checkpoint's drafters); `layers`: the default model keeps only its
    first `layers` layers; `mesh`: placed on it (a checkpoint read in parts: each device reads
    only what it holds).
    """
    dtype = jnp.dtype(args.dtype)
    if (args.checkpoint or args.hf) and layers is not None:
        raise ValueError("--layers applies to the default model only")
    if args.checkpoint:
        return ed.load(args.checkpoint, mesh=mesh), args.checkpoint
    if args.hf:
        import convert

        load_mtp = None if mtp is None else bool(mtp)
        model = convert.load_hf(
            args.hf, dtype=dtype, load_mtp=load_mtp, mesh=mesh, quantized=args.quantized
        )
        return model, args.hf
    if mtp == "dspark":  # the embedded default with a drafter shaped as 0731's, on its last layers
        config = ed.Config.tiny(**TINY_DSPARK)
    else:
        config = ed.Config.tiny(
            **({} if mtp is None else {"num_nextn_predict_layers": int(bool(mtp))})
        )
    if layers is not None:
        config = config.first_layers(layers)
    model = ed.DeepseekV4(config, key=jax.random.key(args.seed), dtype=dtype)
    if args.quantized:
        model = ed.quant.quantize_model(model)
    if mesh is not None:  # every process built the same weights from the same seed
        model = ed.shard(model, mesh)
    return model, f"the embedded tiny default with RANDOM weights (seed {args.seed})"


def check_vocabulary(model: ed.DeepseekV4) -> None:
    if model.config.vocab_size < ed.text.load_tokenizer().get_vocab_size():
        raise ValueError(
            f"the model's vocabulary ({model.config.vocab_size}) is smaller than the tokenizer's"
        )


class TextStream:
    """Text of a growing list of token ids, handed out as it becomes printable.

    A character of several bytes can span tokens: its first tokens decode to U+FFFD, so the
    text waits for the rest.
    """

    def __init__(self, *, skip_special_tokens: bool = True):
        self.ids: list[int] = []
        self.shown = ""
        self.skip = skip_special_tokens

    def push(self, token: int) -> str:
        """Add a token; return the new printable text (maybe empty)."""
        self.ids.append(int(token))
        text = ed.decode_text(self.ids, skip_special_tokens=self.skip)
        if text.endswith("\ufffd"):
            return ""
        new, self.shown = text[len(self.shown) :], text
        return new
