"""The floor under one decoded token of the small config, and the best decode ratio against
transformers that it allows on this machine.

Decoding one token must read the head, the embedding row, each layer's dense weights and the
chosen experts' weights (plus caches, small at these contexts). On a CPU this is memory-bound.
This script times the largest of those reads, the output head's matrix-vector product
(129280 x 512 weights), side by side in JAX and torch, the same way the decode benchmark times
a step (median over repeats, after a warm-up). At the faster of the two rates it prices the
weights a whole step must read (counted from the model: embedding and hash tables one row,
routed experts `top_k / n_experts` of theirs) and divides transformers' decode step, timed in
the same run, by that floor: no implementation on this machine can beat that ratio.

    python benchmarks/decode_floor.py [--dtype float32] [--context 4096]

Writes benchmarks/results/decode_floor.{json,md}.
"""

import argparse

import jax
import jax.numpy as jnp
import numpy as np
from common import (
    block,
    markdown,
    reference_model,
    set_threads,
    small_config,
    timed,
    weight_kinds,
    write,
)
from decode import WARMUP, reference_stepper

import equinox_dsv4 as ed


def step_bytes(config: ed.Config, dtype) -> int:
    """Weight bytes one decoded token must read: all of them, except that the embedding and the
    hash routers' tables give one row each and the routed experts `top_k / n_experts`."""
    kinds = weight_kinds(config, dtype)
    experts = kinds["experts"] * config.num_experts_per_tok / config.n_routed_experts
    return int(kinds["other"] + kinds["row"] + experts)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=16)
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
    weights = step_bytes(config, dtype)
    floor = weights / (nbytes / min(ours, ref))  # at the faster of the two rates
    reference = reference_stepper(reference_model(config, dtype), args.context)
    step = timed(reference, args.steps, WARMUP)
    row = {
        "dtype": args.dtype,
        "head_bytes": nbytes,
        "jax_ms": 1e3 * ours,
        "torch_ms": 1e3 * ref,
        "jax_GBps": nbytes / ours / 1e9,
        "torch_GBps": nbytes / ref / 1e9,
        "step_bytes": weights,
        "floor_ms": 1e3 * floor,
        "context": args.context,
        "transformers_step_ms": 1e3 * step,
        "best_ratio": step / floor,
    }
    table = markdown(
        ["dtype", "head MiB", "JAX ms", "torch ms", "JAX GB/s", "torch GB/s"],
        [
            [
                row["dtype"],
                f"{row['head_bytes'] / 2**20:.0f}",
                f"{row['jax_ms']:.2f}",
                f"{row['torch_ms']:.2f}",
                f"{row['jax_GBps']:.1f}",
                f"{row['torch_GBps']:.1f}",
            ]
        ],
    )
    table += "\n" + markdown(
        [
            "weights per token MiB",
            "floor ms (at the faster rate)",
            f"transformers ms / token at {args.context}",
            "best possible ratio",
        ],
        [
            [
                f"{row['step_bytes'] / 2**20:.0f}",
                f"{row['floor_ms']:.2f}",
                f"{row['transformers_step_ms']:.1f}",
                f"{row['best_ratio']:.1f}x",
            ]
        ],
    )
    rows = [row]
    write("decode_floor", rows, table, {"threads": threads})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
