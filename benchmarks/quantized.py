"""Decode latency with the release's quantised weights (FP8 projections, FP4 routed experts,
dequantised by each matmul) against the same model's bfloat16 weights.

Both: the jitted decode step of `generate` (cache donated) after a chunked prefill of the
context, the "small" config (benchmarks/common.py), batch 1, bfloat16 compute. The quantised
model is `ed.quant.quantize_model` of the bfloat16 one (128 x 128 FP8 blocks, 1 x 32 FP4 blocks).
Their steps alternate (`common.timed_pair`); "ratio" is the median over the pairs of bf16
seconds / quantised seconds (above 1: quantised is faster). The resident weight bytes of both
are measured on the live arrays.

    python benchmarks/quantized.py [--contexts 1024 4096] [--steps 32] [--layers 8]

Writes benchmarks/results/quantized.{json,md}.
"""

import argparse

import jax
import jax.numpy as jnp
from common import markdown, set_threads, small_config, timed_pair, write
from decode import WARMUP, ours_stepper

import equinox_dsv4 as ed


def resident_bytes(model) -> int:
    return sum(a.nbytes for a in jax.tree.leaves(model))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--layers", type=int, default=8, help="decoder layers of the config")
    args = parser.parse_args()
    threads = set_threads()
    config = small_config(args.layers)
    dense = ed.DeepseekV4(config, key=jax.random.key(0), dtype=jnp.bfloat16)
    quantized = ed.quant.quantize_model(dense)
    sizes = {"bf16": resident_bytes(dense), "quantized": resident_bytes(quantized)}
    split = ed.quant.weight_bytes(quantized)
    print(
        f"resident weights: bf16 {sizes['bf16'] / 2**20:.1f} MiB, quantised "
        f"{sizes['quantized'] / 2**20:.1f} MiB ({split['quantized'] / 2**20:.1f} MiB of it "
        "FP8/FP4 values and scales)",
        flush=True,
    )
    rows, table = [], []
    for context in args.contexts:
        timing = timed_pair(
            ours_stepper(quantized, context, args.steps),
            ours_stepper(dense, context, args.steps),
            args.steps,
            WARMUP,
        )
        row = {
            "context": context,
            "quantized_ms": 1e3 * timing["ours_seconds"],
            "bf16_ms": 1e3 * timing["reference_seconds"],
            "ratio": timing["ratio"],
        }
        rows.append(row)
        table.append(
            [context, f"{row['quantized_ms']:.2f}", f"{row['bf16_ms']:.2f}", f"{row['ratio']:.2f}"]
        )
        print(table[-1], flush=True)
    md = markdown(["context", "quantised ms / token", "bf16 ms / token", "bf16 / quantised"], table)
    md += (
        f"\nResident weights: bf16 {sizes['bf16'] / 2**20:.1f} MiB, quantised "
        f"{sizes['quantized'] / 2**20:.1f} MiB (x{sizes['quantized'] / sizes['bf16']:.2f}).\n"
    )
    write(
        "quantized",
        rows,
        md,
        {"config": config.to_hf(), "threads": threads, "steps": args.steps, "bytes": sizes},
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
