"""The floor under one decoded token of the small config: the output head's matrix-vector
product (129280 x 512 weights, read once per token), timed side by side in JAX and torch.

Decoding one token must read the head, the embedding row, each layer's dense weights and the
chosen experts' weights. On a CPU this is memory-bound and the head alone is most of it. This
script times that single product in both frameworks, the same way the decode benchmark times a
step (median over repeats, after a warm-up), so the decode ratios can be read against it.

    python benchmarks/decode_floor.py [--dtype float32]

Writes benchmarks/results/decode_floor.{json,md}.
"""

import argparse

import jax
import jax.numpy as jnp
import numpy as np
from common import block, markdown, set_threads, small_config, timed, write


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    threads = set_threads()
    import torch

    config = small_config()
    v, d = config.vocab_size, config.hidden_size
    rng = np.random.default_rng(0)
    w = rng.normal(size=(v, d)).astype(np.float32) * 0.02
    x = rng.normal(size=(1, d)).astype(np.float32)
    dtype = jnp.dtype(args.dtype)
    jw, jx = jnp.asarray(w, dtype), jnp.asarray(x, dtype)
    head = jax.jit(lambda x, w: jnp.einsum("bi,oi->bo", x, w, preferred_element_type=jnp.float32))
    ours = timed(lambda: block(head(jx, jw)), args.repeats)
    tdtype = torch.float32 if args.dtype == "float32" else torch.bfloat16
    tw, tx = torch.from_numpy(w).to(tdtype), torch.from_numpy(x).to(tdtype)
    with torch.no_grad():
        ref = timed(lambda: torch.nn.functional.linear(tx, tw), args.repeats)
    nbytes = v * d * dtype.itemsize
    rows = [
        {
            "dtype": args.dtype,
            "head_bytes": nbytes,
            "jax_ms": 1e3 * ours,
            "torch_ms": 1e3 * ref,
            "jax_GBps": nbytes / ours / 1e9,
            "torch_GBps": nbytes / ref / 1e9,
        }
    ]
    table = markdown(
        ["dtype", "head MiB", "JAX ms", "torch ms", "JAX GB/s", "torch GB/s"],
        [
            [
                r["dtype"],
                f"{r['head_bytes'] / 2**20:.0f}",
                f"{r['jax_ms']:.2f}",
                f"{r['torch_ms']:.2f}",
                f"{r['jax_GBps']:.1f}",
                f"{r['torch_GBps']:.1f}",
            ]
            for r in rows
        ],
    )
    write("decode_floor", rows, table, {"threads": threads})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
