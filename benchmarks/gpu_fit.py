"""Which V4 model fits a node of 8 NVIDIA GPUs, and with how much context: compiled by XLA's GPU
compiler for H100 / H200 / B200 nodes on this machine (no GPU: `python -m equinox_dsv4.compile
--topology NAME:8`, the `aot` extra), per GPU.

For each model (V4-Flash, V4-Pro), weight form (the release's FP8/FP4 kept quantised, or
bfloat16) and GPU: a 4096-token prefill at batch 1 and a decode step at batch 8 with 4352-token
caches, on the mesh `expert=8` (each GPU holds a eighth of the routed experts, the dense
weights whole, and every sequence's cache: decode steps move tokens, not weights). Weights
that alone exceed the GPU's memory are refused before compiling. From the decode step's bytes:
what is left beside its weights and temporaries (memory - (decode bytes - its caches)), and
in it the longest context at batch 1 (up to the model's limit, `max_position_embeddings`) and
the largest batch at 4k / 64k / 1M tokens of context (`ed.inference.cache_bytes`, the
compressed cache as `init_cache` allocates it; a larger batch's activations not counted).

    python benchmarks/gpu_fit.py [--gpus h100,h200,b200] [--models v4-flash,v4-pro]

Writes benchmarks/results/gpu_fit.{json,md}. Compile-time figures: exact bytes of the compiled
programs' buffers, no run; XLA's GPU compiler counts no FLOPs, so no time estimate.
"""

import argparse
import sys
import time

from common import write

import equinox_dsv4 as ed
from equinox_dsv4.compile import DoesNotFit, parse_args, run


PHASES = {"prefill": 1, "decode": 8}  # batch of each phase
PREFILL, CACHE = 4096, 4352
CONTEXTS = (4096, 65536, 1 << 20)
CONFIGS = {"v4-flash": ed.Config.v4_flash, "v4-pro": ed.Config.v4_pro}


def compiled(model: str, gpu: str, quantized: bool, phase: str) -> dict:
    """The phase's report row (and the run's memory), or its refusal."""
    t0 = time.perf_counter()
    flags = f"--model {model} --topology {gpu}:8 --mesh expert=8 --phases {phase}"
    flags += f" --prefill {PREFILL} --batch {PHASES[phase]} --max-len {CACHE}"
    flags += " --quantized" * quantized
    try:
        results = run(*parse_args(flags.split()))
        refused = None
    except DoesNotFit as e:
        results, refused = e.results, str(e)
    row = results["phases"].get(phase, {})
    return {
        "memory_bytes": results["device_memory_bytes"],
        "device": results["device"],
        "needed_bytes": row.get("needed_bytes"),
        "argument_bytes": row.get("argument_bytes"),
        "temp_bytes": row.get("temp_bytes"),
        "cache_bytes": results["cache_bytes"],
        "refused": refused,
        "seconds": time.perf_counter() - t0,
    }


def limits(config: ed.Config, free: int) -> dict:
    """The longest context at batch 1 and the largest batch at each of `CONTEXTS` whose
    compressed caches fit `free` bytes (each GPU holds every sequence's cache)."""

    def one(length: int) -> int:
        return ed.inference.cache_bytes(config, length, 1)["compressed"]

    per_token = (one(1 << 20) - one(1 << 19)) / (1 << 19)
    longest = int((free - one(0)) / per_token) if free > one(0) else 0
    while longest > 0 and one(longest) > free:
        longest -= 1 << 10
    return {
        "longest_context_batch_1": max(longest, 0),
        # The model's own limit (max_position_embeddings) caps what a sequence may hold.
        "context_limit": config.max_position_embeddings,
        **{f"batch_at_{n}": max(free // one(n), 0) for n in CONTEXTS},
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--gpus", default="h100,h200,b200")
    parser.add_argument("--models", default="v4-flash,v4-pro")
    parser.add_argument("--forms", default="quantized,bf16")
    args = parser.parse_args()
    rows = []
    for model in args.models.split(","):
        config = CONFIGS[model]().trunk_only()
        for form in args.forms.split(","):
            for gpu in args.gpus.split(","):
                row = {"model": model, "form": form, "gpu": gpu}
                for phase in PHASES:
                    result = compiled(model, gpu, form == "quantized", phase)
                    row[phase] = result
                    row["device"], row["memory_bytes"] = result["device"], result["memory_bytes"]
                    print(f"{model} {form} {gpu} {phase}: {result}", file=sys.stderr, flush=True)
                decode = row["decode"]
                if decode["refused"] is None:
                    # The decode step's caches (every GPU holds all 8 sequences') set aside.
                    base = decode["needed_bytes"] - decode["cache_bytes"]
                    row["free_bytes"] = row["memory_bytes"] - base
                    row.update(limits(config, row["free_bytes"]))
                rows.append(row)
    text = table(rows)
    extra = {"mesh": "expert=8", "prefill": PREFILL, "cache": CACHE, "table": text}
    write("gpu_fit", rows, text, extra)
    return 0


def table(rows: list[dict]) -> str:
    gib = 2**30

    def cell(result: dict) -> str:
        if result["needed_bytes"] is None:  # refused before compiling
            return "no (weights alone)"
        fits = "yes" if result["refused"] is None else "no"
        return f"{result['needed_bytes'] / gib:.1f} GiB ({fits})"

    lines = [
        "| model | weights | GPU (memory) | prefill 4096, batch 1 | decode, batch 8 "
        "| longest context, batch 1 | batch at 4k | at 64k | at 1M |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        memory = f"{r['gpu'].upper()} ({r['memory_bytes'] / gib:.1f} GiB)"
        limits_ = ["-"] * 4
        if "free_bytes" in r:
            longest = r["longest_context_batch_1"]
            if longest >= r["context_limit"]:
                text = f"{r['context_limit'] / 2**20:g}M (the model's limit; room for "
                text += f"{longest / 2**20:.1f}M)"
            else:
                text = f"{longest / 2**10:.0f}k tokens"
            limits_ = [text] + [str(r[f"batch_at_{n}"]) for n in CONTEXTS]
        form = "FP8/FP4" if r["form"] == "quantized" else "bf16"
        lines.append(
            f"| {r['model']} | {form} | {memory} | {cell(r['prefill'])} | {cell(r['decode'])} | "
            + " | ".join(limits_)
            + " |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
