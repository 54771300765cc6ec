"""Compile time and compiled memory against depth, scanned and unrolled.

The "small" config (benchmarks/common.py) at 4, 12, 24 and 43 layers in the V4-Flash pattern;
for each, the jitted prefill of 512 tokens is lowered and compiled from the abstract model
(nothing allocated), with `scan_layers` on and off. Memory is XLA's analysis of the compiled
program (arguments + temporaries). With the scan each depth is compiled `--repeats` times, the
depths in turn (a round), and the run with the median total is reported, with every round's
ratio to the shallowest depth as well (unrolled: once, 90 s at 43 layers); an untimed compile
comes first, so that no depth pays the process's first-compile set-up.

    python benchmarks/compile_depth.py [--layers 4 12 24 43] [--repeats 3]

Writes benchmarks/results/compile_depth.{json,md,png}.
"""

import argparse
import dataclasses
import time

import equinox as eqx
import jax
import jax.numpy as jnp
from common import markdown, small_config, write

import equinox_dsv4 as ed


def compile_once(config: ed.Config, tokens: int = 512) -> dict:
    model = eqx.filter_eval_shape(ed.DeepseekV4, config, key=jax.random.key(0))
    ids = jax.ShapeDtypeStruct((1, tokens), jnp.int32)

    def prefill(model, ids):
        cache = model.init_cache(1, tokens)
        return model.decode(ids, cache, last_only=True)[0]

    t0 = time.perf_counter()
    lowered = jax.jit(prefill).lower(model, ids)
    t1 = time.perf_counter()
    compiled = lowered.compile()
    t2 = time.perf_counter()
    memory = compiled.memory_analysis()
    return {
        "trace_lower_seconds": t1 - t0,
        "compile_seconds": t2 - t1,
        "total_seconds": t2 - t0,
        "argument_bytes": memory.argument_size_in_bytes,
        "temp_bytes": memory.temp_size_in_bytes,
        "plan": ed.config.LayerPlan.from_config(config).describe(),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[4, 12, 24, 43])
    parser.add_argument(
        "--repeats", type=int, default=3, help="compiles per depth with the scan (median kept)"
    )
    args = parser.parse_args()
    compile_once(small_config(min(args.layers)))  # untimed: first-compile set-up
    rows, table = [], []
    for scan in (True, False):
        runs = {layers: [] for layers in args.layers}
        for _ in range(args.repeats if scan else 1):
            for layers in args.layers:
                config = dataclasses.replace(small_config(layers), scan_layers=scan)
                runs[layers].append(compile_once(config))
                seconds = runs[layers][-1]["total_seconds"]
                print(f"{layers} layers, {'scan' if scan else 'unrolled'}: {seconds:.1f} s")
        for layers in args.layers:
            ordered = sorted(runs[layers], key=lambda r: r["total_seconds"])
            row = {
                "layers": layers,
                "scan": scan,
                **ordered[len(ordered) // 2],
                "total_seconds_runs": [r["total_seconds"] for r in runs[layers]],
            }
            rows.append(row)
            mib = 2**20
            table.append(
                [
                    layers,
                    "scan" if scan else "unrolled",
                    f"{row['trace_lower_seconds']:.1f}",
                    f"{row['compile_seconds']:.1f}",
                    f"{row['total_seconds']:.1f}",
                    " / ".join(f"{t:.1f}" for t in row["total_seconds_runs"]),
                    f"{row['argument_bytes'] / mib:.0f}",
                    f"{row['temp_bytes'] / mib:.0f}",
                ]
            )
            print(table[-1], flush=True)
    first = {r["scan"]: r for r in rows if r["layers"] == args.layers[0]}
    for row, cells in zip(rows, table, strict=True):
        base = first[row["scan"]]
        row["vs_shallowest"] = row["total_seconds"] / base["total_seconds"]
        # Per round too: the depths of one round were compiled within seconds of each other.
        rounds = zip(row["total_seconds_runs"], base["total_seconds_runs"], strict=True)
        row["vs_shallowest_runs"] = [t / b for t, b in rounds]
        cells.append(f"{row['vs_shallowest']:.2f}")
        cells.append(" / ".join(f"{r:.2f}" for r in row["vs_shallowest_runs"]))
    md = markdown(
        [
            "layers",
            "stack",
            "trace + lower s",
            "compile s",
            "total s",
            "each run's total s",
            "arguments MiB",
            "temporaries MiB",
            f"total vs {args.layers[0]} layers",
            "each round's",
        ],
        table,
    )
    write("compile_depth", rows, md)
    _plot(rows)
    return 0


def _plot(rows):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from common import RESULTS

    fig, ax = plt.subplots(figsize=(6, 4))
    for scan in (True, False):
        sel = [r for r in rows if r["scan"] == scan]
        ax.plot(
            [r["layers"] for r in sel],
            [r["total_seconds"] for r in sel],
            "o-",
            label="scan" if scan else "unrolled",
        )
    ax.set_xlabel("layers")
    ax.set_ylabel("trace + compile seconds")
    ax.set_title("Prefill (512 tokens) compile time, small config")
    ax.legend()
    fig.tight_layout()
    fig.savefig(RESULTS / "compile_depth.png", dpi=120)


if __name__ == "__main__":
    raise SystemExit(main())
