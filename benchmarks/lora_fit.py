"""Where LoRA / QLoRA fine-tuning fits: V4-Flash and V4-Pro train steps with rank-16 adapters
over the release's FP8/FP4 weights (or bf16), compiled here, without the chips, for the
smallest TPU v5p slices (libtpu's compiler) and for 8-GPU nodes (XLA's GPU compiler through the
CUDA plugin): per-chip figures.

Each row is one `make_train_step` step of a model with `ed.lora.add(model, rank=16)` (every
default target: the attention projections, the shared and the routed experts of every layer; the
base frozen, AdamW's moments of the adapters only; forward, backward of the activations and the
adapters, optimizer update) on 4096-token sequences, on the rules that split the dense weights
over `expert` (`tpu_memory.RULES`), compiled with `python -m equinox_dsv4.compile --train --lora
16 [--quantized] --topology ...`: the whole model, layers scanned as the library runs them;
arguments and temporaries per chip, and whether the step fits the chip's memory (arguments +
outputs + temporaries - aliased, against the chip's HBM; the compile tool refuses a GPU step
that does not fit).

The MFU bound needs XLA's cost analysis of unrolled programs (`benchmarks/tpu_train.py`
extrapolates from 5- and 7-layer ones); for rows marked in `RUNS` those are compiled too and
the bound uses the step's useful FLOPs for LoRA, the forward and the activations' backward
(`2 x forward_flops`: the frozen weights get no gradient). Estimates from the compiler on a
CPU host; no TPU ran them.

    python benchmarks/lora_fit.py [--only flash-q-4 ...] [--work /tmp/lora-fit]

Writes benchmarks/results/lora_fit.{json,md}.
"""

import argparse
import math
import pathlib

from common import markdown, write
from tpu_memory import RULES
from tpu_train import compiled_run, out_of_memory, roofline

import equinox_dsv4 as ed
from equinox_dsv4.compile import TPU_PEAKS


SEQ_LEN = 4096
RANK = 16
# A v5p chip's HBM (published; the compile tool reports the GPUs' own).
V5P_HBM = 95 * 2**30
# name -> (model, quantised, topology, mesh, global batch, with the cost compiles)
RUNS = {
    "flash-q-4": ("v4-flash", True, "v5p:2x2x1", "fsdp=1,expert=4", 1, True),
    "flash-q-4-fsdp": ("v4-flash", True, "v5p:2x2x1", "fsdp=4,expert=1", 4, False),
    "pro-q-16": ("v4-pro", True, "v5p:2x2x4", "fsdp=1,expert=16", 1, True),
    "pro-q-16-fsdp": ("v4-pro", True, "v5p:2x2x4", "fsdp=2,expert=8", 2, False),
    "flash-q-h200": ("v4-flash", True, "h200:8", "fsdp=1,expert=8", 1, False),
    "pro-q-b200": ("v4-pro", True, "b200:8", "fsdp=1,expert=8", 1, False),
}


def arguments(name: str, out: pathlib.Path, layers: int | None = None) -> list[str]:
    model, quantized, topology, mesh, batch, _ = RUNS[name]
    args = ["--model", model, "--topology", topology, "--mesh", mesh, "--train"]
    args += ["--lora", str(RANK), "--batch", str(batch), "--seq-len", str(SEQ_LEN)]
    args += ["--json", str(out)] + (["--quantized"] if quantized else [])
    # The dense weights over `expert` too: the default on the TPU meshes; on the GPU ones,
    # without fsdp, the default keeps them whole on every GPU, and a fine-tuning step needs
    # the room.
    args += [a for rule in RULES for a in ("--rule", rule)]
    return args + (["--layers", str(layers), "--unrolled"] if layers else [])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="+", choices=sorted(RUNS), help="these runs only")
    parser.add_argument("--work", default="/tmp/lora-fit", help="per-run JSON files (reused)")
    args = parser.parse_args()
    work = pathlib.Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    peak, hbm = TPU_PEAKS["v5p"]
    gib = 2**30
    rows, table = [], []
    for name in args.only or RUNS:
        model, quantized, topology, mesh, batch, with_cost = RUNS[name]
        memory, costs = compiled_run(arguments, name, work, with_cost)
        config = {"v4-flash": ed.Config.v4_flash, "v4-pro": ed.Config.v4_pro}[model]()
        chips = math.prod(int(part.split("=")[1]) for part in mesh.split(","))
        weights = "FP8/FP4" if quantized else "bf16"
        cells = [model, weights, f"{chips} ({topology})", mesh, batch * SEQ_LEN]
        row = {"name": name, "memory": memory, "costs": costs}
        if "error" in memory:
            cells += ["-", "-", f"no: {out_of_memory(memory['error']) or memory['error']}"]
        else:
            train = memory["phases"]["train"]
            arg, temp = train["argument_bytes"], train["temp_bytes"]
            total = train["needed_bytes"]
            hbm_bytes = memory["device_memory_bytes"] or V5P_HBM
            cells += [f"{arg / gib:.1f} GiB", f"{temp / gib:.1f} GiB"]
            fits = "yes" if total <= hbm_bytes else "no"
            cells.append(f"{fits}: {total / gib:.1f} of {hbm_bytes / gib:.0f} GiB")
        if "error" in memory:
            cells.append("-")
        elif not topology.startswith("v5p"):
            cells.append("n/a (XLA's GPU compiler counts no FLOPs)")
        elif not costs:
            cells.append("not estimated (its cost compiles not run)")
        elif any("error" in c for c in costs):
            cells.append("n/a: " + next(c["error"] for c in costs if "error" in c))
        else:
            useful = 2 * ed.train.forward_flops(config, SEQ_LEN, logits="all") * batch / chips
            bound = roofline(costs, config.num_hidden_layers, useful)
            del bound["bound"]
            row |= bound
            cells.append(f"<= {bound['mfu_estimate']:.0%} ({bound['estimate_seconds']:.2f} s)")
        rows.append(row)
        table.append(cells)
        print(cells, flush=True)
    header = ["model", "base", "chips (topology)", "mesh", "tokens / step"]
    header += ["arguments / chip", "temporaries / chip", "fits the chip"]
    header += ["MFU estimate (step time), v5p peak"]
    rendered = markdown(header, table)
    extra = {"rank": RANK, "seq_len": SEQ_LEN, "peak_flops": peak, "hbm_bytes_per_s": hbm}
    write("lora_fit", rows, rendered, extra | {"table": rendered})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
