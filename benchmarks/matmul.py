"""XLA:CPU's matmul against torch's on the prefill's shapes, side by side in one run.

The prefill comparison (prefill.py) is only about our code if both frameworks multiply
matrices equally fast. This times `jnp.dot` (jitted) and `torch.matmul` on the same operands,
same thread count, in float32 and bfloat16: the whole-model square product, the MoE's
projections at 2048 tokens x top-4 (8192 rows) and per 2048 tokens, and one 128-row expert
block. A kernel gap measured here is outside our code. In bfloat16 XLA is timed twice: with a
bf16 result (`jnp.dot` as it is), and with a float32 result cast to bf16 after, the form
`equinox_dsv4`'s layers use on XLA:CPU, whose bf16 kernel takes only that one.

    python benchmarks/matmul.py [--repeats 7]

Writes benchmarks/results/matmul.{json,md}.
"""

import argparse

import jax
import jax.numpy as jnp
import numpy as np
from common import block, fast_matmul, markdown, set_threads, timed, write


SHAPES = ((2048, 2048, 2048), (8192, 512, 512), (2048, 512, 512), (128, 512, 512))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    threads = set_threads()
    import torch

    rng = np.random.default_rng(0)
    rows, table = [], []
    for dtype_name in ("float32", "bfloat16"):
        tdtype = getattr(torch, dtype_name)
        for m, k, n in SHAPES:
            a = rng.normal(size=(m, k)).astype(np.float32)
            b = rng.normal(size=(k, n)).astype(np.float32)
            ja, jb = jnp.asarray(a, dtype_name), jnp.asarray(b, dtype_name)
            dot = jax.jit(jnp.dot)
            jax_s = timed(lambda ja=ja, jb=jb, dot=dot: block(dot(ja, jb)), args.repeats)
            f32_result_s = None
            if dtype_name != "float32":
                f32_result_s = timed(lambda ja=ja, jb=jb: block(fast_matmul(ja, jb)), args.repeats)
            ta, tb = torch.from_numpy(a).to(tdtype), torch.from_numpy(b).to(tdtype)
            with torch.no_grad():
                torch_s = timed(lambda ta=ta, tb=tb: torch.matmul(ta, tb), args.repeats)
            flops = 2 * m * k * n
            row = {
                "dtype": dtype_name,
                "shape": [m, k, n],
                "jax_gflops": flops / jax_s / 1e9,
                "jax_f32_result_gflops": None
                if f32_result_s is None
                else flops / f32_result_s / 1e9,
                "torch_gflops": flops / torch_s / 1e9,
                "torch_over_jax": jax_s / torch_s,
                "torch_over_jax_f32_result": None
                if f32_result_s is None
                else f32_result_s / torch_s,
            }
            rows.append(row)
            table.append(
                [
                    dtype_name,
                    f"{m} x {k} x {n}",
                    f"{row['jax_gflops']:.0f}",
                    "-" if f32_result_s is None else f"{row['jax_f32_result_gflops']:.0f}",
                    f"{row['torch_gflops']:.0f}",
                    f"{row['torch_over_jax']:.2f}x",
                    "-" if f32_result_s is None else f"{row['torch_over_jax_f32_result']:.2f}x",
                ]
            )
            print(table[-1], flush=True)
    md = markdown(
        [
            "dtype",
            "m x k x n",
            "XLA GFLOP/s",
            "XLA GFLOP/s, float32 result",
            "torch GFLOP/s",
            "torch speed / XLA speed",
            "torch / XLA, float32 result",
        ],
        table,
    )
    write("matmul", rows, md, {"threads": threads})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
