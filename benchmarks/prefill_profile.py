"""Which XLA:CPU kernels cap the bfloat16 prefill, and by how much.

Our jitted prefill (`prefill.py`'s: the small config, batch 1, `--tokens` tokens, last
position's logits) is timed, then traced with `jax.profiler`; every XLA:CPU kernel whose
compiled instruction is a dot, or a fusion containing one, is a matrix product, and its FLOPs
are counted from the compiled program's shapes (2 x result elements x contracted size). In the
same run: a large `jnp.dot` (2048^3, float32 result, `common.fast_matmul`) gives the matmul rate
the issue's target is stated against; the prefill's useful FLOPs (`prefill.prefill_flops`)
over its time give its share of that rate; the products' own rate bounds what the prefill
could reach if everything else took no time. The `--top` products that take longest are then
timed alone, same shapes and dtype, in XLA (as our layers compute them: bf16 operands, float32
result) and in torch, alternately.

    python benchmarks/prefill_profile.py [--tokens 2048] [--dtype bfloat16]

Writes benchmarks/results/prefill_profile[-float32].{json,md}.
"""

import argparse
import collections
import glob
import re
import tempfile

import equinox as eqx
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
from prefill import matmul_flops_per_second, prefill_flops

import equinox_dsv4 as ed


@eqx.filter_jit
def prefill(model, ids):
    cache = model.init_cache(ids.shape[0], ids.shape[1])
    return model.decode(ids, cache, last_only=True)[0]


def parse(hlo: str) -> tuple[dict, dict]:
    """(instruction name -> (shape, opcode, operands, line), fusion name -> called computation
    name) of a compiled HLO module's text."""
    pattern = r"^\s*(?:ROOT )?%?([\w.\-]+) = (\S+) ([\w\-]+)\(([^)]*)\)(.*)$"
    table = {m[1]: (m[2], m[3], m[4], m[5]) for m in re.finditer(pattern, hlo, re.M)}
    computations, current = collections.defaultdict(list), None
    for line in hlo.splitlines():
        head = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{\s*$", line)
        if head:
            current = head[1]
        else:
            m = re.match(r"^\s*(?:ROOT )?%?([\w.\-]+) = ", line)
            if m and current:
                computations[current].append(m[1])
    return table, computations


def dims(shape: str) -> list[int]:
    m = re.match(r"\w+\[([\d,]*)\]", shape)
    return [int(d) for d in m[1].split(",") if d] if m else []


def dot_flops(name: str, table: dict) -> float:
    shape, _, operands, rest = table[name]
    lhs = table.get(operands.split(",")[0].strip().lstrip("%"))
    m = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", rest)
    if lhs is None or m is None:
        return 0.0
    contracted = np.prod([dims(lhs[0])[int(i)] for i in m[1].split(",") if i] or [1])
    return 2.0 * float(np.prod(dims(shape) or [1])) * float(contracted)


def products(name: str, table: dict, computations: dict) -> list[str]:
    """The dots `name` computes: itself, or the dots of the computation it calls."""
    if name not in table:
        return []
    _, opcode, _, rest = table[name]
    if opcode == "dot":
        return [name]
    called = re.search(r"calls=%?([\w.\-]+)", rest)
    if opcode != "fusion" or not called:
        return []
    return [n for n in computations.get(called[1], []) if table.get(n, ("", ""))[1] == "dot"]


def signature(dot: str, table: dict) -> str:
    shape, _, operands, rest = table[dot]
    ops = [table.get(o.strip().lstrip("%"), ("?",))[0] for o in operands.split(",")]
    contract = re.findall(r"(lhs|rhs)_contracting_dims=\{([\d,]*)\}", rest)
    return f"{' x '.join(ops)} -> {shape} contract {dict(contract)}"


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
    hlo = prefill.lower(model, ids).compile().compiled.as_text()
    table, computations = parse(hlo)
    peak = matmul_flops_per_second(dtype)
    seconds = timed(lambda: block(prefill(model, ids)), args.repeats)
    useful = prefill_flops(config, args.tokens)

    with tempfile.TemporaryDirectory() as d:
        jax.profiler.start_trace(d)
        for _ in range(args.repeats):
            block(prefill(model, ids))
        jax.profiler.stop_trace()
        (path,) = glob.glob(f"{d}/**/*.xplane.pb", recursive=True)
        data = jax.profiler.ProfileData.from_file(path)
    mm_s = other_s = mm_flops = 0.0
    by_shape = collections.Counter()
    for plane in data.planes:
        for line in plane.lines:
            if "XLAEigen" not in line.name:
                continue
            for event in line.events:
                name = event.name
                if name.startswith(("ThunkExecutor", "while", "end: ", "call")):
                    continue
                s = event.duration_ns / 1e9 / args.repeats
                dots = products(name, table, computations)
                if dots:
                    mm_s += s
                    mm_flops += sum(dot_flops(n, table) for n in dots) / args.repeats
                    by_shape[signature(dots[0], table)] += s
                else:
                    other_s += s
    row = {
        "dtype": args.dtype,
        "tokens": args.tokens,
        "prefill_ms": 1e3 * seconds,
        "useful_flops": useful,
        "useful_GFLOPs": useful / seconds / 1e9,
        "matmul_GFLOPs": peak / 1e9,
        "of_matmul": useful / seconds / peak,
        "products_ms": 1e3 * mm_s,
        "products_flops": mm_flops,
        "products_GFLOPs": mm_flops / mm_s / 1e9,
        "products_of_matmul": mm_flops / mm_s / peak,
        "other_kernels_ms": 1e3 * other_s,
        "bound_if_rest_free": useful / mm_s / peak,
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
