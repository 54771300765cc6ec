"""Which XLA:CPU kernels cap the bfloat16 prefill, and by how much.

Our jitted prefill (`prefill.prefill`: the small config, batch 1, `--tokens` tokens, last
position's logits) is timed, alternating with a large `jnp.dot` (2048^3, float32 result,
`common.fast_matmul`) that gives the matmul rate the issue's target is stated against; the
prefill's useful FLOPs (`ed.train.forward_flops`) over its time give its share of that rate (the
median over the alternating pairs). Then it is traced with `jax.profiler`: every XLA:CPU kernel
whose compiled instruction is a dot, or a fusion containing one, is a matrix product, and its
FLOPs are counted from the compiled program's shapes (2 x result elements x contracted size);
the products' own rate (their profiled time against the paired matmul rate) bounds what the
prefill could reach if everything else took no time. The other kernels are put on parts of the
model by their op names, with the bytes they read and write against a stream's rate measured in
the same run. The `--top` products that take longest are then timed alone, same shapes and
dtype, in XLA (as our layers compute them: bf16 operands, float32 result) and in torch,
alternately.

    python benchmarks/prefill_profile.py [--tokens 2048] [--dtype bfloat16]

Writes benchmarks/results/prefill_profile[-float32].{json,md}.
"""

import argparse
import collections
import re

import jax
import jax.numpy as jnp
import numpy as np
from common import (
    block,
    fast_matmul,
    markdown,
    random_ids,
    set_threads,
    small_config,
    timed,
    timed_pair,
    write,
)
from hlo import dims, kernel_bytes, kernel_events, op_name, parse, products
from prefill import prefill

import equinox_dsv4 as ed


MATMUL_SIZE = 2048

# The kernels that hold no product, by the part of the model their op name places them in
# (first match); their bytes against a stream's rate measured in the same run.
PARTS = (
    (r"/moe/while/", "routed experts: the block loop (weight and row slices, block writes)"),
    (r"/moe/", "routing, dispatch (sorting, gathers, top-k sums), shared expert"),
    (r"/indexer/", "attention: indexer (scores, top-k)"),
    (r"/compressor/", "attention: compressors"),
    (r"/attention/", "attention: the rest (norms, RoPE, masks, softmax, cache writes)"),
    (r"/block/", "mHC (Sinkhorn, mixing) and norms"),
    (r".", "embedding, head, the rest"),
    (r"", "conversions and copies XLA added (no op name)"),
)


def stream_bytes_per_second(repeats: int, size: int = 1 << 26) -> float:
    """Bytes per second of a float32 array read once (its sum, 256 MiB): the rate a
    memory-bound kernel can reach (a written result would add the page faults of a fresh
    buffer each call)."""
    x = jnp.ones((size,), jnp.float32)
    total = jax.jit(jnp.sum)
    return x.nbytes / timed(lambda: block(total(x)), repeats)


def dot_flops(name: str, table: dict) -> float:
    dot = table[name]
    lhs = table.get(dot.operands[0]) if dot.operands else None
    m = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", dot.attributes)
    if lhs is None or m is None:
        return 0.0
    contracted = np.prod([dims(lhs.shape)[int(i)] for i in m[1].split(",") if i] or [1])
    return 2.0 * float(np.prod(dims(dot.shape) or [1])) * float(contracted)


def signature(name: str, table: dict) -> str:
    dot = table[name]
    ops = [table[o].shape if o in table else "?" for o in dot.operands]
    contract = re.findall(r"(lhs|rhs)_contracting_dims=\{([\d,]*)\}", dot.attributes)
    return f"{' x '.join(ops)} -> {dot.shape} contract {dict(contract)}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--top", type=int, default=5)
    args = parser.parse_args()
    threads = set_threads()
    import torch

    dtype = jnp.dtype(args.dtype)
    config = small_config()
    model = ed.DeepseekV4(config, key=jax.random.key(0), dtype=dtype)
    ids = jnp.asarray(random_ids(1, args.tokens))
    table, computations = parse(prefill.lower(model, ids).compile().compiled.as_text())
    useful = ed.train.forward_flops(config, args.tokens)
    # The prefill and the matmul alternate, and the share is the median over those pairs: this
    # machine's rates drift by a quarter within minutes, and both drift together.
    square = jnp.ones((MATMUL_SIZE, MATMUL_SIZE), dtype)
    pair = timed_pair(
        lambda: block(prefill(model, ids)),
        lambda: block(fast_matmul(square, square)),
        args.repeats * 2,
    )
    seconds = pair["ours_seconds"]
    peak = 2 * MATMUL_SIZE**3 / pair["reference_seconds"]
    share = pair["ratio"] * useful / (2 * MATMUL_SIZE**3)

    mm_s = other_s = mm_flops = 0.0
    stream = stream_bytes_per_second(args.repeats)
    by_shape = collections.Counter()
    part_s, part_bytes, part_kernels = (collections.Counter() for _ in range(3))
    for name, kernel_s in kernel_events(lambda: block(prefill(model, ids)), args.repeats):
        s = kernel_s / args.repeats
        dots = products(name, table, computations)
        if dots:
            mm_s += s
            mm_flops += sum(dot_flops(n, table) for n in dots) / args.repeats
            by_shape[signature(dots[0], table)] += s
        else:
            other_s += s
            part = "(not in the compiled text)"
            if name in table:
                op = op_name(name, table, computations)
                part = next(p for key, p in PARTS if re.search(key, op))
                part_bytes[part] += kernel_bytes(name, table, computations) / args.repeats
            part_s[part] += s
            part_kernels[part] += 1 / args.repeats
    row = {
        "dtype": args.dtype,
        "tokens": args.tokens,
        "prefill_ms": 1e3 * seconds,
        "useful_flops": useful,
        "useful_GFLOPs": useful / seconds / 1e9,
        "matmul_GFLOPs": peak / 1e9,
        "of_matmul": share,
        "products_ms": 1e3 * mm_s,
        "products_flops": mm_flops,
        "products_GFLOPs": mm_flops / mm_s / 1e9,
        "products_of_matmul": mm_flops / mm_s / peak,
        "other_kernels_ms": 1e3 * other_s,
        "bound_if_rest_free": useful / mm_s / peak,
        "stream_GBs": stream / 1e9,
        "other_kernels": [
            {
                "part": part,
                "kernels": round(part_kernels[part]),
                "ms": 1e3 * t,
                "bytes": part_bytes[part],
                "of_stream": part_bytes[part] / t / stream,
            }
            for part, t in part_s.most_common()
        ],
    }
    md = markdown(
        [
            "dtype, tokens",
            "prefill ms",
            "useful GFLOP/s (of matmul)",
            "matmul GFLOP/s (2048^3)",
            "products: ms, GFLOP/s (of matmul)",
            "other kernels ms",
            "of matmul if the rest took no time",
        ],
        [
            [
                f"{args.dtype}, {args.tokens}",
                f"{row['prefill_ms']:.1f}",
                f"{row['useful_GFLOPs']:.0f} ({100 * row['of_matmul']:.0f}%)",
                f"{peak / 1e9:.0f}",
                f"{row['products_ms']:.1f}, {row['products_GFLOPs']:.0f} "
                f"({100 * row['products_of_matmul']:.0f}%)",
                f"{row['other_kernels_ms']:.1f}",
                f"{100 * row['bound_if_rest_free']:.0f}%",
            ]
        ],
    )
    md += "\n" + markdown(
        [
            "kernels without a product, by part",
            "kernels",
            "ms",
            "MiB read + written",
            f"GB/s (of the {stream / 1e9:.1f} GB/s stream)",
        ],
        [
            [
                p["part"],
                p["kernels"],
                f"{p['ms']:.1f}",
                f"{p['bytes'] / 2**20:.0f}",
                f"{p['bytes'] / p['ms'] / 1e6:.1f} ({100 * p['of_stream']:.0f}%)",
            ]
            for p in row["other_kernels"]
        ],
    )
    # The longest products, alone: XLA as our layers compute them against torch.
    tdtype = torch.float32 if args.dtype == "float32" else torch.bfloat16
    shapes, lines = [], []
    for sig, s in by_shape.most_common(args.top):
        m = re.match(r"\w+\[([\d,]*)\]\S* x \w+\[([\d,]*)\]", sig)
        a_dims, b_dims = dims("x[" + m[1] + "]"), dims("x[" + m[2] + "]")
        if len(a_dims) != 2 or len(b_dims) != 2:
            lines.append([sig, f"{1e3 * s:.2f}", "-", "-", "-"])
            continue
        contract = dict(re.findall(r"'(lhs|rhs)': '([\d,]*)'", sig))
        a = jnp.ones(a_dims, dtype)
        b = jnp.ones(b_dims, dtype)
        lc, rc = int(contract.get("lhs", "1")), int(contract.get("rhs", "0"))
        a2 = a if lc == 1 else a.T
        b2 = b if rc == 0 else b.T
        flops = 2.0 * a2.shape[0] * a2.shape[1] * b2.shape[1]
        ta = torch.ones(tuple(a2.shape), dtype=tdtype)
        tb = torch.ones(tuple(b2.shape), dtype=tdtype)

        def ours(a2=a2, b2=b2):
            block(fast_matmul(a2, b2))

        def theirs(ta=ta, tb=tb):
            torch.matmul(ta, tb)

        pair = timed_pair(ours, theirs, args.repeats * 4, 2)
        xla, tor = flops / pair["ours_seconds"] / 1e9, flops / pair["reference_seconds"] / 1e9
        shapes.append(
            {"signature": sig, "ms_in_prefill": 1e3 * s, "xla_GFLOPs": xla, "torch_GFLOPs": tor}
        )
        lines.append(
            [
                f"{a2.shape[0]} x {a2.shape[1]} x {b2.shape[1]}",
                f"{1e3 * s:.2f}",
                f"{xla:.0f}",
                f"{tor:.0f}",
                f"{tor / xla:.2f}x",
            ]
        )
    row["longest_products"] = shapes
    md += "\n" + markdown(
        [
            "product m x k x n",
            "ms in the prefill",
            "XLA GFLOP/s alone",
            "torch GFLOP/s alone",
            "torch / XLA",
        ],
        lines,
    )
    suffix = "" if args.dtype == "bfloat16" else f"-{args.dtype}"
    write("prefill_profile" + suffix, [row], md, {"config": config.to_hf(), "threads": threads})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
