"""Decode latency per token against context length, ours and transformers.

Ours: the jitted decode step of `generate` (cache donated), after a chunked prefill of the
context. transformers: its eager forward with its own cache, one token per call, after its
prefill; only at the context lengths it manages on this machine (`--reference-contexts`). Where
both run, their steps alternate (`common.timed_pair`; the ratio is the median of the pairs').
Batch 1, the "small" config (benchmarks/common.py), float32 weights unless `--dtype` says
otherwise (both frameworks), 8 layers unless `--layers` says otherwise (from 12 layers on, the
model scans its repeating (HCA, CSA) layers).

    python benchmarks/decode.py [--contexts 1024 4096 16384 65536] [--steps 32]
                                [--layers 8] [--dtype float32] [--keep-freed-memory]

Writes benchmarks/results/decode.{json,md,png}; with `--layers N` other than 8 or `--dtype
bfloat16`, benchmarks/results/decode[-N-layers][-bfloat16].{json,md}.
"""

import argparse

import jax
import jax.numpy as jnp
import numpy as np
from common import (
    add_keep_freed_memory,
    block,
    keep_freed_memory,
    markdown,
    random_ids,
    reference_and_ours,
    set_threads,
    small_config,
    timed_pair,
    timed_with_faults,
    write,
)

import equinox_dsv4 as ed


# Untimed steps first: the first steps of a context ran up to 1.25x slower (archive/NOTES.md, Round
# 4).
WARMUP = 4


def ours_stepper(model, context: int, steps: int):
    """Our decode step after a prefill of `context` tokens, compiled: one call decodes one
    token and blocks until it is done."""
    ids = random_ids(1, context)
    max_len = -(-(context + 2 * steps + 8) // 64) * 64
    cache = model.init_cache(1, max_len)
    greedy = ed.Sampling()
    key = jax.random.key(0)
    token, cache = ed.inference.prefill(
        model, jnp.asarray(ids), jnp.asarray([context]), cache, key, greedy, 2048
    )

    def step():
        nonlocal token, cache
        token, cache = ed.inference.decode_step(
            model, token, jnp.ones((1,), jnp.int32), cache, key, greedy
        )
        block(token)

    step()  # compile
    return step


def reference_stepper(reference, context: int):
    """transformers' decode step after its prefill of `context` tokens, with its cache."""
    import torch

    ids = torch.from_numpy(random_ids(1, context).astype(np.int64))
    with torch.no_grad():
        out = reference(
            input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=True, logits_to_keep=1
        )
    cache = out.cache
    token = out.logits[:, -1:].argmax(-1)
    mask = torch.ones((1, context + 1), dtype=torch.long)

    def step():
        nonlocal cache, token, mask
        with torch.no_grad():
            out = reference(input_ids=token, attention_mask=mask, cache=cache, use_cache=True)
        cache, token = out.cache, out.logits[:, -1:].argmax(-1)
        mask = torch.ones((1, mask.shape[1] + 1), dtype=torch.long)

    return step


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 16384, 65536])
    parser.add_argument("--reference-contexts", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--layers", type=int, default=8, help="decoder layers of the config")
    parser.add_argument(
        "--dtype",
        choices=["float32", "bfloat16"],
        default="float32",
        help="weight dtype of both models",
    )
    add_keep_freed_memory(parser)
    args = parser.parse_args()
    if args.layers < 1:
        parser.error(f"--layers must be positive, got {args.layers}")
    suffix = "" if args.layers == 8 else f"-{args.layers}-layers"
    suffix += ("" if args.dtype == "float32" else f"-{args.dtype}") + keep_freed_memory(args)
    threads = set_threads()
    config = small_config(args.layers)
    reference, model = reference_and_ours(config, jnp.dtype(args.dtype))
    rows, table = [], []
    for context in args.contexts:
        ours = ours_stepper(model, context, args.steps)
        if context in args.reference_contexts:
            # Steps alternate between the two, so that both see the same memory bandwidth.
            timing = timed_pair(ours, reference_stepper(reference, context), args.steps, WARMUP)
            ours_s, ours_faults = timing["ours_seconds"], timing["ours_faults"]
            ref_s, ref_faults = timing["reference_seconds"], timing["reference_faults"]
        else:
            ours_s, ours_faults = timed_with_faults(ours, args.steps, WARMUP)
            ref_s = ref_faults = None
        row = {
            "context": context,
            "ours_ms": 1e3 * ours_s,
            "transformers_ms": None if ref_s is None else 1e3 * ref_s,
            "speedup": None if ref_s is None else timing["ratio"],
            "ours_page_faults": ours_faults,
            "transformers_page_faults": ref_faults,
        }
        rows.append(row)
        table.append(
            [
                context,
                f"{row['ours_ms']:.2f}",
                "-" if ref_s is None else f"{row['transformers_ms']:.1f}",
                "-" if ref_s is None else f"{row['speedup']:.1f}x",
                f"{ours_faults:.0f} / " + ("-" if ref_s is None else f"{ref_faults:.0f}"),
            ]
        )
        print(table[-1], flush=True)
    base = rows[0]["ours_ms"]
    for row, cells in zip(rows, table, strict=True):
        row["ours_vs_first"] = row["ours_ms"] / base
        cells.insert(4, f"{row['ours_vs_first']:.2f}")
    md = markdown(
        [
            "context",
            "ours ms / token",
            "transformers ms / token",
            "ratio",
            f"ours vs {rows[0]['context']}",
            "page faults per token, ours / transformers",
        ],
        table,
    )
    write(
        "decode" + suffix,
        rows,
        md,
        {"config": config.to_hf(), "threads": threads, "steps": args.steps, "dtype": args.dtype},
    )
    if not suffix:
        _plot(rows)
    return 0


def _plot(rows):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from common import RESULTS

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([r["context"] for r in rows], [r["ours_ms"] for r in rows], "o-", label="ours")
    ref = [r for r in rows if r["transformers_ms"] is not None]
    ax.plot(
        [r["context"] for r in ref],
        [r["transformers_ms"] for r in ref],
        "s--",
        label="transformers",
    )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context tokens")
    ax.set_ylabel("ms per decoded token")
    ax.set_title("Decode latency, small config, batch 1, float32")
    ax.legend()
    fig.tight_layout()
    fig.savefig(RESULTS / "decode.png", dpi=120)


if __name__ == "__main__":
    raise SystemExit(main())
