"""Prefill throughput against transformers, and achieved FLOP/s against the machine's matmul.

Ours: the jitted prefill (`decode` from an empty cache, last position's logits, as `generate`
runs it). transformers: its eager forward with a cache and `logits_to_keep=1`, same weights,
same thread count, the two run alternately (`common.timed_pair`; the ratio is the median of the
pairs' ratios). Batch 1, the "small" config (benchmarks/common.py), float32 and bfloat16.

    python benchmarks/prefill.py [--lengths 512 2048 8192] [--dtypes float32 bfloat16]
                                 [--keep-freed-memory]

Also measures a large `jnp.dot` in the same run and reports the prefill's achieved FLOP/s (model
FLOPs counted analytically, below) as a fraction of it, and the best ratio any implementation
could reach here (transformers' time over the model's FLOPs at that matmul rate). Page faults
per call are counted for both: with glibc's default malloc, a call that allocates hundreds of
MB of temporaries faults every page of them in again on each call (`--keep-freed-memory`).
Writes benchmarks/results/prefill.*.
"""

import argparse

import equinox as eqx
import jax.numpy as jnp
import numpy as np
from common import (
    add_keep_freed_memory,
    block,
    fast_matmul,
    keep_freed_memory,
    markdown,
    random_ids,
    reference_and_ours,
    set_threads,
    small_config,
    timed,
    timed_pair,
    write,
)

import equinox_dsv4 as ed


@eqx.filter_jit
def prefill(model, ids):
    """Ours: a prefill from an empty cache, the last position's logits (as `generate` runs it)."""
    cache = model.init_cache(ids.shape[0], ids.shape[1])
    return model.decode(ids, cache, last_only=True)[0]


def matmul_flops_per_second(dtype, size: int = 2048, repeats: int = 5) -> float:
    a = jnp.ones((size, size), dtype)
    seconds = timed(lambda: block(fast_matmul(a, a)), repeats)
    return 2 * size**3 / seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 2048, 8192])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument(
        "--repeats", type=int, default=5, help="timed pairs per length (2 above 4096 tokens)"
    )
    add_keep_freed_memory(parser)
    args = parser.parse_args()
    suffix = keep_freed_memory(args)
    threads = set_threads()
    import torch

    config = small_config()
    rows, table = [], []
    for dtype_name in args.dtypes:
        dtype = jnp.dtype(dtype_name)
        reference, ours = reference_and_ours(config, dtype)
        peak = matmul_flops_per_second(dtype)

        for length in args.lengths:
            ids = random_ids(1, length)
            jids = jnp.asarray(ids)
            tids = torch.from_numpy(ids.astype(np.int64))

            def reference_prefill(tids=tids, reference=reference):
                with torch.no_grad():
                    reference(
                        input_ids=tids,
                        attention_mask=torch.ones_like(tids),
                        use_cache=True,
                        logits_to_keep=1,
                    )

            # The first run of each compiles ours and warms transformers up.
            timing = timed_pair(
                lambda jids=jids, m=ours: block(prefill(m, jids)),
                reference_prefill,
                min(2, args.repeats) if length > 4096 else args.repeats,
            )
            ours_s, ours_faults = timing["ours_seconds"], timing["ours_faults"]
            ref_s, ref_faults = timing["reference_seconds"], timing["reference_faults"]
            flops = ed.train.forward_flops(config, length)
            row = {
                "dtype": dtype_name,
                "tokens": length,
                "ours_seconds": ours_s,
                "transformers_seconds": ref_s,
                "ours_tokens_per_s": length / ours_s,
                "transformers_tokens_per_s": length / ref_s,
                "speedup": timing["ratio"],
                "ours_page_faults": ours_faults,
                "transformers_page_faults": ref_faults,
                "model_flops": flops,
                "ours_flops_per_s": flops / ours_s,
                "matmul_flops_per_s": peak,
                "fraction_of_matmul": flops / ours_s / peak,
                # No implementation beats transformers by more than this here: its time over
                # the model's FLOPs at the matmul rate.
                "best_ratio": ref_s / (flops / peak),
            }
            rows.append(row)
            table.append(
                [
                    dtype_name,
                    length,
                    f"{row['ours_tokens_per_s']:.0f}",
                    f"{row['transformers_tokens_per_s']:.0f}",
                    f"{row['speedup']:.2f}x",
                    f"{row['ours_flops_per_s'] / 1e9:.1f}",
                    f"{peak / 1e9:.1f}",
                    f"{100 * row['fraction_of_matmul']:.0f}%",
                    f"{row['best_ratio']:.1f}x",
                    f"{ours_faults / 1e3:.0f}k / {ref_faults / 1e3:.0f}k",
                ]
            )
            print(table[-1], flush=True)
    md = markdown(
        [
            "dtype",
            "tokens",
            "ours tok/s",
            "transformers tok/s",
            "ratio",
            "ours GFLOP/s",
            "matmul GFLOP/s",
            "of matmul",
            "best possible ratio",
            "page faults per call, ours / transformers",
        ],
        table,
    )
    write("prefill" + suffix, rows, md, {"config": config.to_hf(), "threads": threads})
    if not suffix:
        _plot(rows)
    return 0


def _plot(rows: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from common import RESULTS

    fig, ax = plt.subplots(figsize=(6, 4))
    for dtype in sorted({r["dtype"] for r in rows}):
        sel = [r for r in rows if r["dtype"] == dtype]
        x = [r["tokens"] for r in sel]
        ax.plot(x, [r["ours_tokens_per_s"] for r in sel], "o-", label=f"ours {dtype}")
        ax.plot(
            x, [r["transformers_tokens_per_s"] for r in sel], "s--", label=f"transformers {dtype}"
        )
    ax.set_xscale("log", base=2)
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("prefill tokens / s")
    ax.set_title("Prefill throughput, small config, batch 1")
    ax.legend()
    fig.tight_layout()
    fig.savefig(RESULTS / "prefill.png", dpi=120)


if __name__ == "__main__":
    raise SystemExit(main())
