"""Speculative decoding with the MTP block and with a DSpark drafter against plain decoding, on
a model that has learnt something: random weights accept no drafts.

A small model (the embedded tiny default's layer pattern, hidden 128, one MTP block) is trained
here with `ed.make_train_step` (next-token and MTP losses, AdamW) on tests/data/overfit.txt,
tokenised with the real tokenizer and renumbered densely (a head of the text's own
vocabulary). A DSpark drafter (three stages reading the last three layers, blocks of 5, as
V4-Flash-0731's) is then trained on the frozen trunk with `ed.make_train_step(..., dspark=...)`.
Then `ed.generate` continues prompts cut from the text, plain, with `speculative="mtp"` and
with `speculative="dspark"` (the same trunk), greedy and sampled, at batch 1 and 8; the runs
alternate, each timed after a warm-up run that compiles. Greedy outputs are checked equal.

The text is 2,000 tokens and the model memorises much of it, so its drafts are accepted more
often than a real model's on new text: the acceptance here is a high one. What a step costs
against a plain one (the verify call's extra positions, the MTP block, the sampling rule) is
what this CPU shows whatever the acceptance.

    python benchmarks/speculative.py [--steps 400] [--dspark-steps 300] [--repeats 3]

Writes benchmarks/results/speculative.{json,md}.
"""

import argparse
import dataclasses
import statistics
import time

import equinox as eqx
import jax
import numpy as np
from common import ROOT, write
from performance import speculative_table
from tqdm import tqdm

import equinox_dsv4 as ed


def corpus() -> tuple[np.ndarray, int]:
    ids = ed.encode_text((ROOT / "tests" / "data" / "overfit.txt").read_text())
    vocab = {t: i for i, t in enumerate(sorted(set(ids)))}
    return np.array([vocab[t] for t in ids], np.int32), len(vocab)


def config(vocab: int) -> ed.Config:
    return ed.Config.tiny(
        vocab_size=vocab,
        hidden_size=128,
        moe_intermediate_size=128,
        rope_scaling=None,
        max_position_embeddings=1024,
        num_nextn_predict_layers=1,
        eos_token_id=None,
    )


def train(tokens: np.ndarray, vocab: int, steps: int, seq_len: int, batch: int, keep: set[int]):
    """Train for `steps` steps; returns the model after each step in `keep` and the loss
    history."""
    model = ed.DeepseekV4(config(vocab), key=jax.random.key(0))
    opt = ed.make_optimizer(
        3e-3, warmup_steps=min(20, steps // 2), total_steps=steps, weight_decay=0.0
    )
    state = ed.init_train_state(model, opt)
    step = ed.make_train_step(opt, mtp_weight=1.0, remat=None)
    rng = np.random.default_rng(0)
    history, kept = [], {}
    bar = tqdm(range(1, steps + 1), desc="training", unit="step")
    for i in bar:
        starts = rng.integers(0, len(tokens) - seq_len - 1, batch)
        rows = np.stack([tokens[s : s + seq_len + 1] for s in starts])
        state, metrics = step(state, ed.Batch.from_tokens(rows))
        if i % 10 == 0 or i in keep:
            lm, mtp = float(metrics["lm"]), float(metrics["mtp"])
            history.append({"step": i, "lm": lm, "mtp": mtp})
            bar.set_postfix(lm=f"{lm:.3f}", mtp=f"{mtp:.3f}")
        if i in keep:
            kept[i] = jax.tree.map(lambda a: a.copy() if eqx.is_array(a) else a, state.model)
    return kept, history


DSPARK = dict(
    dspark_block_size=5,
    dspark_markov_rank=32,
    dspark_target_layer_ids=(6, 7, 8),
    dspark_noise_token_id=0,
    dspark_stages=3,
)


def train_dspark(trunk, tokens: np.ndarray, steps: int, seq_len: int, batch: int):
    """A DSpark drafter trained on `trunk` (frozen): the model with it, and the loss history."""
    config = dataclasses.replace(trunk.config, **DSPARK)
    model = ed.DeepseekV4(config, key=jax.random.key(1))
    shared = ("embed", "layers", "hc_head", "norm", "head")
    # Copies: the drafter's steps donate their state, and the MTP model keeps the trunk's.
    trunk_parts = [
        jax.tree.map(lambda a: a.copy() if eqx.is_array(a) else a, getattr(trunk, n))
        for n in shared
    ]
    model = eqx.tree_at(lambda m: [getattr(m, n) for n in shared], model, trunk_parts)
    opt = ed.make_optimizer(
        3e-3, warmup_steps=min(20, steps // 2), total_steps=steps, weight_decay=0.0
    )
    state = ed.init_train_state(model, opt, drafter_only=True)
    step = ed.make_train_step(opt, dspark=ed.train.DSparkObjective(anchors=16))
    rng = np.random.default_rng(1)
    history = []
    bar = tqdm(range(1, steps + 1), desc="training the DSpark drafter", unit="step")
    for i in bar:
        starts = rng.integers(0, len(tokens) - seq_len - 1, batch)
        rows = np.stack([tokens[s : s + seq_len + 1] for s in starts])
        state, metrics = step(state, ed.Batch.from_tokens(rows))
        if i % 10 == 0 or i == steps:
            terms = {k: float(metrics[k]) for k in ("ce", "tv", "confidence", "accept")}
            history.append({"step": i, **terms})
            bar.set_postfix(ce=f"{terms['ce']:.3f}", accept=f"{terms['accept']:.2f}")
    return state.model, history


def measure(
    model, prompts, new_tokens: int, sampling: ed.Sampling, repeats: int, drafter: str
) -> dict:
    key = jax.random.key(1)

    def run(speculative: bool | str):
        stats: dict = {}
        start = time.perf_counter()
        out = ed.generate(
            model,
            prompts,
            max_new_tokens=new_tokens,
            sampling=sampling,
            key=key,
            speculative=speculative,
            stats=stats,
        )
        return time.perf_counter() - start, out, stats

    run(False), run(drafter)  # compile
    times: dict[bool | str, list[float]] = {False: [], drafter: []}
    last = {}
    for _ in range(repeats):
        for speculative in (False, drafter):
            seconds, out, stats = run(speculative)
            times[speculative].append(seconds)
            last[speculative] = out, stats
    (plain_out, plain_stats), (spec_out, spec_stats) = last[False], last[drafter]
    if sampling.greedy:
        assert spec_out == plain_out, "greedy speculative output differs from plain"
    tokens = sum(len(o) for o in spec_out)
    plain_s, spec_s = statistics.median(times[False]), statistics.median(times[drafter])
    plain_tokens = sum(len(o) for o in plain_out)
    rated = {
        k: spec_stats[k] for k in ("confidence_accepted", "confidence_rejected") if k in spec_stats
    }
    return {
        "drafter": drafter,
        "batch": len(prompts),
        "sampling": "greedy" if sampling.greedy else f"T={sampling.temperature}",
        "plain_tokens_per_s": plain_tokens / plain_s,
        "speculative_tokens_per_s": tokens / spec_s,
        "speedup": (tokens / spec_s) / (plain_tokens / plain_s),
        "acceptance": spec_stats["accepted"] / max(spec_stats["drafted"], 1),
        "tokens_per_main_call": (tokens - len(prompts)) / spec_stats["steps"] / len(prompts),
        "plain_steps": plain_stats["steps"],
        "speculative_steps": spec_stats["steps"],
        "plain_seconds_per_step": plain_s / max(plain_stats["steps"], 1),
        "speculative_seconds_per_step": spec_s / max(spec_stats["steps"], 1),
        "histogram": spec_stats["histogram"],
        **rated,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=400, help="training steps")
    parser.add_argument(
        "--early", type=int, default=40, help="also measure the model after this many steps"
    )
    parser.add_argument(
        "--dspark-steps", type=int, default=300, help="DSpark drafter training steps"
    )
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8, help="training batch (windows)")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    tokens, vocab = corpus()
    t0 = time.perf_counter()
    models, history = train(
        tokens, vocab, args.steps, args.seq_len, args.batch, {args.early, args.steps}
    )
    train_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    final = models[args.steps]
    dspark_model, dspark_history = train_dspark(
        final, tokens, args.dspark_steps, args.seq_len, args.batch
    )
    dspark_s = time.perf_counter() - t0
    offsets = np.linspace(0, len(tokens) - args.prompt_len - 1, 8).astype(int)
    prompts = [list(tokens[o : o + args.prompt_len]) for o in offsets]
    rows = []
    runs = [(trained, model, "mtp") for trained, model in sorted(models.items())]
    runs.append((args.steps, dspark_model, "dspark"))
    for trained, model, drafter in runs:
        loss = next(h for h in history if h["step"] == trained)
        for sampling in (ed.Sampling(), ed.Sampling(temperature=1.0)):
            for batch in (1, 8):
                row = measure(
                    model, prompts[:batch], args.new_tokens, sampling, args.repeats, drafter
                )
                rows.append({"trained_steps": trained, **loss, **row})
    table = speculative_table(rows)
    extra = {
        "training": {"steps": args.steps, "seconds": train_s, "history": history},
        "dspark_training": {
            "steps": args.dspark_steps,
            "seconds": dspark_s,
            "history": dspark_history,
        },
        "text_tokens": len(tokens),
        "vocab": vocab,
        "new_tokens": args.new_tokens,
        "prompt_len": args.prompt_len,
    }
    write("speculative", rows, table, extra)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
