"""Where a decoded token's time goes, by kernel, against the bandwidth floor of the same run.

Our jitted decode step (the small config, batch 1, after a prefill of `--context` tokens) is
timed alternately with the floor's yardstick, the output head's matrix-vector product alone in
float32 (129280 x 512 weights, the step's largest read; `common.timed_pair`, so both see the
same phase of this machine's memory bandwidth). The floor is the weights a step must read
(`decode_floor.step_bytes`, in the step's dtype: half the bytes in bfloat16) at that float32
stream's rate; "of floor" is floor / step. The head's product in the step's dtype is also timed
alone, ours against torch.

Then `jax.profiler` traces `--profile-steps` steps, and each XLA:CPU kernel (thunk) is put in
one class by what it is in the compiled program:

- `output head`: the product (a dot, or a fusion holding one) with the vocabulary-sized result;
- `routed experts: weight copies`: the dynamic slices that copy a chosen expert's weights out of
  the layer's stack before its products (XLA:CPU gives a dot whole buffers only);
- `matrix-vector products`: every other dot or fusion holding one (experts' on the copies,
  shared experts, attention projections, indexer, compressors);
- `small kernels (< 5 us each)`: elementwise and reduction fusions of a few hundred elements
  (mHC Sinkhorn rounds, norms, RoPE, routing), counted and summed;
- `other`: the rest (attention over the cache, cache updates, sampling).

The gap between the step and the sum of its kernels is the executor's own time (dispatch,
waits between dependent kernels) plus the Python call.

The routed experts are also timed alone against torch on the same shapes and weights: one
token through the top-k chosen of each of the config's layers' expert stacks, ours as the step
runs it (`_dispatch.dispatch`, one jitted call for all layers), torch with `F.linear` on the
chosen experts' views (`w[e]`, no copy), alternating, as GB/s of the chosen weights.

    python benchmarks/decode_profile.py [--dtype float32] [--context 4096] [--batch 1]

With `--batch B` above 1 the floor is `batched_decode.floor_bytes` (the experts B tokens touch,
and each row's cache reads). Writes benchmarks/results/decode_profile[-bfloat16][-batch-B].*
"""

import argparse
import collections
import re

import hlo
import jax
import jax.numpy as jnp
import numpy as np
from batched_decode import floor_bytes
from common import block, markdown, set_threads, small_config, timed_pair, write
from decode import WARMUP
from decode_floor import step_bytes

import equinox_dsv4 as ed
from equinox_dsv4.execution import dispatch, linear


CLASSES = (
    "output head",
    "routed experts: weight copies",
    "matrix-vector products",
    "small kernels (< 5 us each)",
    "other",
)


def stepper(model, context: int, batch: int):
    """Our decode step after a prefill of `context` distinct tokens per row (one call decodes
    one token per row and blocks), and the compiled step's HLO text."""
    ids = np.random.default_rng(0).integers(0, model.config.vocab_size, (batch, context))
    cache = model.init_cache(batch, context + 256)
    greedy, key = ed.Sampling(), jax.random.key(0)
    token, cache = ed.inference.prefill(
        model, jnp.asarray(ids, jnp.int32), jnp.full((batch,), context), cache, key, greedy, 2048
    )
    active = jnp.ones((batch,), jnp.int32)
    text = ed.inference.decode_step.lower(model, token, active, cache, key, greedy).compile()
    text = text.compiled.as_text()

    def step():
        nonlocal token, cache
        active = jnp.ones((batch,), jnp.int32)
        token, cache = ed.inference.decode_step(model, token, active, cache, key, greedy)
        block(token)

    step()
    return step, text


def classify(name: str, seconds: float, table: dict, computations: dict, vocab: int) -> str:
    dots = hlo.products(name, table, computations)
    if any(re.search(rf"\b{vocab}\]", table[d].shape) for d in dots):
        return "output head"
    shape = table[name].shape if name in table else ""
    if "dynamic-slice" in name and hlo.shape_bytes(shape) >= 64 * 1024:
        return "routed experts: weight copies"
    if dots:
        return "matrix-vector products"
    if seconds < 5e-6:
        return "small kernels (< 5 us each)"
    return "other"


def profile(step, steps: int, table: dict, computations: dict, vocab: int) -> dict:
    """Per class: kernels per step and milliseconds per step (XLA:CPU's thunk events)."""
    ms, count = collections.Counter(), collections.Counter()
    for name, seconds in hlo.kernel_events(step, steps):
        cls = classify(name, seconds, table, computations, vocab)
        ms[cls] += 1e3 * seconds / steps
        count[cls] += 1 / steps
    return {c: {"ms": ms[c], "kernels": count[c]} for c in CLASSES}


@jax.jit
def head(x, w):
    # As the model's head computes it (`linear`, the platform's form, a float32 result).
    return linear(x, w, dtype=jnp.float32)


def head_alone(w: np.ndarray, dtype, repeats: int) -> dict:
    """The output head's product alone in `dtype`: XLA (float32 result, as our layers) and
    torch, alternately; GB/s of the weights."""
    import torch

    jw, jx = jnp.asarray(w, dtype), jnp.ones((1, w.shape[1]), dtype)
    tdtype = torch.float32 if dtype == jnp.float32 else torch.bfloat16
    tw, tx = torch.from_numpy(w).to(tdtype), torch.ones((1, w.shape[1]), dtype=tdtype)

    def theirs():
        with torch.no_grad():
            torch.nn.functional.linear(tx, tw)

    timing = timed_pair(lambda: block(head(jx, jw)), theirs, repeats, 2)
    nbytes = w.size * jnp.dtype(dtype).itemsize
    return {
        "ours_GBps": nbytes / timing["ours_seconds"] / 1e9,
        "torch_GBps": nbytes / timing["reference_seconds"] / 1e9,
    }


def experts_alone(config: ed.Config, dtype, repeats: int) -> dict:
    """One token through `top_k` chosen experts of each layer's stack: ours (`dispatch`, as the
    decode step runs it) and torch on the experts' views, timed alternately."""
    import torch

    e, k, d, f = (
        config.n_routed_experts,
        config.num_experts_per_tok,
        config.hidden_size,
        config.moe_intermediate_size,
    )
    layers = config.num_hidden_layers
    rng = np.random.default_rng(0)
    stacks = [
        [rng.normal(size=s).astype(np.float32) * 0.04 for s in ((e, f, d), (e, d, f), (e, f, d))]
        for _ in range(layers)
    ]
    chosen = np.stack([rng.permutation(e)[:k] for _ in range(layers)]).astype(np.int32)
    x = rng.normal(size=(1, d)).astype(np.float32)
    jstacks = [[jnp.asarray(w, dtype) for w in ws] for ws in stacks]

    @jax.jit
    def ours(x, chosen, stacks):
        out = []
        for layer, (w1, w2, w3) in enumerate(stacks):
            weights = jnp.ones((1, k), jnp.float32)
            out.append(dispatch(x, chosen[layer][None], weights, w1, w2, w3, 0.0))
        return jnp.stack(out)

    tdtype = torch.float32 if dtype == jnp.float32 else torch.bfloat16
    tstacks = [[torch.from_numpy(w).to(tdtype) for w in ws] for ws in stacks]
    tx = torch.from_numpy(x).to(tdtype)

    def theirs():
        with torch.no_grad():
            for layer, (w1, w2, w3) in enumerate(tstacks):
                for j in chosen[layer]:
                    g = torch.nn.functional.linear(tx, w1[j])
                    u = torch.nn.functional.linear(tx, w3[j])
                    torch.nn.functional.linear(torch.nn.functional.silu(g) * u, w2[j])

    jx, jc = jnp.asarray(x, dtype), jnp.asarray(chosen)
    timing = timed_pair(lambda: block(ours(jx, jc, jstacks)), theirs, repeats, 2)
    nbytes = layers * k * 3 * d * f * jnp.dtype(dtype).itemsize
    return {
        "bytes": nbytes,
        "ours_ms": 1e3 * timing["ours_seconds"],
        "torch_ms": 1e3 * timing["reference_seconds"],
        "ours_GBps": nbytes / timing["ours_seconds"] / 1e9,
        "torch_GBps": nbytes / timing["reference_seconds"] / 1e9,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=1, help="sequences decoded at once")
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--profile-steps", type=int, default=10)
    args = parser.parse_args()
    threads = set_threads()
    dtype = jnp.dtype(args.dtype)
    config = small_config()
    model = ed.DeepseekV4(config, key=jax.random.key(0), dtype=dtype)
    step, hlo_text = stepper(model, args.context, args.batch)
    table, computations = hlo.parse(hlo_text)

    # The yardstick is a float32 stream whatever the step's dtype: the machine's bandwidth.
    w = model.embed.weight
    head_w = jax.random.normal(jax.random.key(1), w.shape, jnp.float32) * 0.02
    x = jnp.ones((1, w.shape[1]), jnp.float32)
    timing = timed_pair(step, lambda: block(head(x, head_w)), args.steps, WARMUP)
    step_s, head_s = timing["ours_seconds"], timing["reference_seconds"]
    head_bytes = head_w.size * 4
    weights = (
        step_bytes(config, dtype)
        if args.batch == 1
        else floor_bytes(config, args.batch, args.context, dtype.itemsize)
    )
    floor_s = weights / head_bytes * head_s
    fraction = floor_s / step_s
    kernels = profile(step, args.profile_steps, table, computations, config.vocab_size)
    traced = sum(k["ms"] for k in kernels.values())
    alone = experts_alone(config, dtype, args.steps)
    head_kernel = head_alone(np.asarray(head_w), dtype, args.steps)

    row = {
        "dtype": args.dtype,
        "context": args.context,
        "batch": args.batch,
        "step_ms": 1e3 * step_s,
        "head_alone_ms": 1e3 * head_s,
        "head_GBps": head_bytes / head_s / 1e9,
        "step_bytes": weights,
        "floor_ms": 1e3 * floor_s,
        "of_floor": fraction,
        "pair_ratio_median": timing["ratio"],
        "kernels": kernels,
        "kernels_ms": traced,
        "experts_alone": alone,
        "head_alone": head_kernel,
    }
    table = markdown(
        [
            "dtype",
            "step ms",
            "weights MiB",
            "float32 head alone ms (GB/s)",
            "floor ms",
            "of floor",
        ],
        [
            [
                args.dtype + ("" if args.batch == 1 else f", batch {args.batch}"),
                f"{row['step_ms']:.2f}",
                f"{weights / 2**20:.0f}",
                f"{row['head_alone_ms']:.2f} ({row['head_GBps']:.1f})",
                f"{row['floor_ms']:.2f}",
                f"{100 * fraction:.0f}%",
            ]
        ],
    )
    lines = [[c, f"{k['kernels']:.0f}", f"{k['ms']:.2f}"] for c, k in kernels.items()]
    lines.append(
        ["all kernels", f"{sum(k['kernels'] for k in kernels.values()):.0f}", f"{traced:.2f}"]
    )
    table += "\n" + markdown(["kernel class (traced steps)", "kernels / step", "ms / step"], lines)
    table += "\n" + markdown(
        ["kernel alone, " + args.dtype, "ours GB/s", "torch GB/s", "float32 head (bandwidth) GB/s"],
        [
            [
                f"routed experts, {alone['bytes'] / 2**20:.0f} MiB chosen",
                f"{alone['ours_GBps']:.1f} ({alone['ours_ms']:.2f} ms)",
                f"{alone['torch_GBps']:.1f} ({alone['torch_ms']:.2f} ms)",
                f"{row['head_GBps']:.1f}",
            ],
            [
                "output head",
                f"{head_kernel['ours_GBps']:.1f}",
                f"{head_kernel['torch_GBps']:.1f}",
                f"{row['head_GBps']:.1f}",
            ],
        ],
    )
    suffix = "" if args.dtype == "float32" else f"-{args.dtype}"
    suffix += "" if args.batch == 1 else f"-batch-{args.batch}"
    write("decode_profile" + suffix, [row], table, {"config": config.to_hf(), "threads": threads})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
