"""Batched decode throughput: tokens per second at batch 1, 8, 32, 64 after a 4k context, ours
and transformers on the same weights, against a floor that counts the experts a batch touches.

Both frameworks get the same work: `--contexts-distinct` (8) different 4096-token prompts,
repeated to fill the batch (row `b` holds prompt `b % 8`), then steps that each feed every row
its own random token (drawn per step, the same for both), so that rows route to experts as
different tokens do even where they share a prompt; each step also computes the next tokens
(ours: greedy sampling in the step; transformers: the argmax of its logits). transformers
prefills each distinct prompt alone (one forward with its cache) and its caches are joined
along the batch and repeated (`reorder_cache`); ours prefills the whole batch. Steps of the
two alternate (`common.timed_pair`), float32, the small config, 2 threads each.

The floor: the bytes a step must read at the rate of the output head's product timed alone in
the same run (`decode_profile.py`'s yardstick): every weight once, except the embedding (one
row per sequence) and each layer's routed experts, of which a batch of `B` tokens touches the
fraction `1 - (1 - k/E)^B` expected of uniform top-k routing; plus each sequence's cache reads
(its sliding window, the CSA layers' top-k entries and all their index keys, the HCA layers'
entries).

    python benchmarks/batched_decode.py [--batches 1 8 32 64] [--context 4096] [--steps 16]

Writes benchmarks/results/batched_decode.{json,md,png}.
"""

import argparse

import jax
import jax.numpy as jnp
import numpy as np
from common import (
    block,
    markdown,
    random_ids,
    reference_and_ours,
    set_threads,
    small_config,
    timed,
    timed_pair,
    weight_kinds,
    write,
)
from decode import WARMUP

import equinox_dsv4 as ed


def floor_bytes(config: ed.Config, batch: int, context: int, itemsize: int) -> float:
    """Bytes one decode step of `batch` sequences after `context` tokens must read."""
    kinds = weight_kinds(config, jnp.float32 if itemsize == 4 else jnp.bfloat16)
    k, e = config.num_experts_per_tok, config.n_routed_experts
    touched = 1 - (1 - k / e) ** batch
    weights = kinds["other"] + kinds["experts"] * touched + kinds["row"] * batch
    d, di = config.head_dim, config.index_head_dim
    per_row = 0
    for layer in config.layer_types:
        per_row += min(context, config.sliding_window) * d
        if layer == ed.config.CSA:
            entries = context // config.compress_rate_csa
            per_row += min(entries, config.index_topk) * d + entries * di
        elif layer == ed.config.HCA:
            per_row += context // config.compress_rate_hca * d
    return weights + batch * per_row * itemsize


def ours_stepper(model, prompts: np.ndarray, batch: int, feed: np.ndarray):
    """Our decode step on `batch` rows (row b holds prompt b % len(prompts)), each call feeding
    the next row of `feed` [steps, batch]; blocks until done."""
    ids = jnp.asarray(prompts[np.arange(batch) % len(prompts)])
    context = ids.shape[1]
    cache = model.init_cache(batch, context + 256)
    greedy, key = ed.Sampling(), jax.random.key(0)
    _, cache = ed.inference.prefill(
        model, ids, jnp.full((batch,), context), cache, key, greedy, 2048
    )
    tokens = [jnp.asarray(f) for f in feed]
    i = 0

    def step():
        nonlocal cache, i
        active = jnp.ones((batch,), jnp.int32)
        out, cache = ed.inference.decode_step(
            model, tokens[i % len(tokens)], active, cache, key, greedy
        )
        i += 1
        block(out)

    return step


def reference_caches(reference, prompts: np.ndarray):
    """transformers' cache after each prompt alone, joined along the batch."""
    import torch

    caches = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.from_numpy(p[None].astype(np.int64))
            out = reference(
                input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=True, logits_to_keep=1
            )
            caches.append(out.cache)
    joined = caches[0]
    for i, layer in enumerate(joined.layers):
        others = [c.layers[i] for c in caches[1:]]
        layer.keys = torch.cat([layer.keys] + [o.keys for o in others])
        layer.values = layer.keys
        for field in ("buffer_kv", "buffer_gate", "compressed_kv", "overlap_kv", "overlap_gate"):
            states = getattr(layer, field, None)
            for name, tensor in (states or {}).items():
                if tensor is not None:
                    states[name] = torch.cat([tensor] + [getattr(o, field)[name] for o in others])
    return joined


def reference_stepper(reference, joined, n_prompts: int, batch: int, context: int, feed):
    import copy

    import torch

    cache = copy.deepcopy(joined)
    cache.reorder_cache(torch.arange(batch) % n_prompts)
    tokens = [torch.from_numpy(f.astype(np.int64))[:, None] for f in feed]
    length = context
    i = 0

    def step():
        nonlocal cache, length, i
        mask = torch.ones((batch, length + 1), dtype=torch.long)
        with torch.no_grad():
            out = reference(
                input_ids=tokens[i % len(tokens)],
                attention_mask=mask,
                cache=cache,
                use_cache=True,
            )
        out.logits[:, -1].argmax(-1)
        cache, length, i = out.cache, length + 1, i + 1

    return step


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--contexts-distinct", type=int, default=8)
    parser.add_argument("--steps", type=int, default=16)
    args = parser.parse_args()
    threads = set_threads()
    config = small_config()
    reference, model = reference_and_ours(config, jnp.float32)
    prompts = random_ids(args.contexts_distinct, args.context)
    joined = reference_caches(reference, prompts)
    head_w = model.embed.weight
    x = jnp.ones((1, head_w.shape[1]), head_w.dtype)
    head = jax.jit(lambda x, w: jnp.einsum("bi,oi->bo", x, w))
    head_bytes = head_w.size * head_w.dtype.itemsize
    rng = np.random.default_rng(1)
    rows, table = [], []
    for batch in args.batches:
        feed = rng.integers(2, config.vocab_size, (args.steps + 2 * WARMUP, batch))
        ours = ours_stepper(model, prompts, batch, feed)
        ref = reference_stepper(
            reference, joined, args.contexts_distinct, batch, args.context, feed
        )
        timing = timed_pair(ours, ref, args.steps, WARMUP)
        head_s = timed(lambda: block(head(x, head_w)), args.steps, 2)
        nbytes = floor_bytes(config, batch, args.context, 4)
        floor_s = nbytes / head_bytes * head_s
        ours_s, ref_s = timing["ours_seconds"], timing["reference_seconds"]
        row = {
            "batch": batch,
            "ours_ms": 1e3 * ours_s,
            "transformers_ms": 1e3 * ref_s,
            "ours_tok_s": batch / ours_s,
            "transformers_tok_s": batch / ref_s,
            "ratio": timing["ratio"],
            "floor_bytes": nbytes,
            "head_GBps": head_bytes / head_s / 1e9,
            "floor_ms": 1e3 * floor_s,
            "floor_tok_s": batch / floor_s,
            "ours_of_floor": floor_s / ours_s,
        }
        rows.append(row)
        table.append(
            [
                batch,
                f"{row['ours_ms']:.1f}",
                f"{row['transformers_ms']:.1f}",
                f"{row['ours_tok_s']:.0f}",
                f"{row['transformers_tok_s']:.0f}",
                f"{row['ratio']:.2f}x",
                f"{nbytes / 2**20:.0f}",
                f"{row['floor_tok_s']:.0f}",
                f"{100 * row['ours_of_floor']:.0f}%",
            ]
        )
        print(table[-1], flush=True)
    header = [
        "batch",
        "ours ms / step",
        "transformers ms / step",
        "ours tok/s",
        "transformers tok/s",
        "ratio",
        "floor MiB / step",
        "floor tok/s",
        "ours of floor",
    ]
    extra = {"config": config.to_hf(), "threads": threads, "context": args.context}
    write("batched_decode", rows, markdown(header, table), extra)
    _plot(rows)
    return 0


def _plot(rows):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from common import RESULTS

    fig, ax = plt.subplots(figsize=(6, 4))
    b = [r["batch"] for r in rows]
    ax.plot(b, [r["ours_tok_s"] for r in rows], "o-", label="ours")
    ax.plot(b, [r["transformers_tok_s"] for r in rows], "s--", label="transformers")
    ax.plot(b, [r["floor_tok_s"] for r in rows], ":", color="gray", label="bandwidth floor")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("batch (sequences)")
    ax.set_ylabel("decoded tokens / s")
    ax.set_title("Batched decode, small config, 4k context, float32")
    ax.legend()
    fig.tight_layout()
    fig.savefig(RESULTS / "batched_decode.png", dpi=120)


if __name__ == "__main__":
    raise SystemExit(main())
