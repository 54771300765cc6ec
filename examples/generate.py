"""Generate text with DeepSeek-V4: the real tokenizer, the compressed KV cache, streaming output.

With no model argument it runs the embedded default: a tiny model built from
`equinox_dsv4/config/presets/tiny.json` with RANDOM (seeded) weights, so its text is meaningless; it
shows the whole path working. Give `--checkpoint DIR` (a model saved by `python -m convert` or
`equinox_dsv4.save`) or `--hf DIR` (a Hugging Face DeepSeek-V4 checkpoint) for real weights.
"""

import argparse
import time

import jax
from _common import (
    TextStream,
    add_adapter_argument,
    add_mesh_arguments,
    add_model_arguments,
    add_sampling_arguments,
    check_vocabulary,
    load_model,
    mesh_from,
    new_parser,
    run_reporting_errors,
    sampling,
    say,
    with_adapter,
)

import equinox_dsv4 as ed


def main(argv: list[str] | None = None) -> int:
    parser = new_parser(__doc__)
    add_model_arguments(parser)
    add_adapter_argument(parser)
    parser.add_argument("--prompt", default="What is the capital of France?")
    parser.add_argument("--raw", action="store_true", help="no chat template: the prompt as is")
    parser.add_argument("--thinking", action="store_true", help="open the reply with <think>")
    add_sampling_arguments(parser, max_new_tokens=32)
    parser.add_argument("--max-len", type=int, help="cache length (default: prompt + new)")
    parser.add_argument(
        "--speculative",
        nargs="?",
        const="mtp",
        choices=("mtp", "dspark"),
        help="draft with the model's MTP blocks (mtp, the default) or its DSpark drafter "
        "(dspark: a block of drafts per step, V4-Flash-0731), verify with one main-model call "
        "per step (same tokens when greedy, same distribution when sampling)",
    )
    parser.add_argument("--layers", type=int, help="default model: keep the first N layers")
    add_mesh_arguments(parser)
    return run_reporting_errors(run, parser.parse_args(argv))


def run(args: argparse.Namespace) -> int:
    if not args.prompt:
        raise ValueError("--prompt is empty")
    sampler = sampling(args)
    text = (
        args.prompt
        if args.raw
        else ed.chat_prompt([{"role": "user", "content": args.prompt}], thinking=args.thinking)
    )
    prompt = ed.encode_text(text)
    if args.raw:
        prompt = [0] + prompt  # <｜begin▁of▁sentence｜>
    if args.max_len is not None and len(prompt) > args.max_len:
        raise ValueError(f"the prompt has {len(prompt)} tokens, more than --max-len {args.max_len}")

    t0 = time.perf_counter()
    model, described = load_model(
        args, mtp=args.speculative or False, layers=args.layers, mesh=mesh_from(args)
    )
    say(f"model: {described} (loaded in {time.perf_counter() - t0:.1f} s)")
    model = with_adapter(model, args)
    check_vocabulary(model)

    text_stream = TextStream()
    stamps: list[float] = []

    def stream(tokens, running):
        if not running[0]:
            return
        stamps.append(time.perf_counter())
        if ed.parallel.is_primary():
            print(text_stream.push(tokens[0]), end="", flush=True)

    say(args.prompt if args.raw else f"> {args.prompt}")
    start = time.perf_counter()
    stats: dict = {}
    ed.generate(
        model,
        [prompt],
        max_new_tokens=args.max_new_tokens,
        sampling=sampler,
        key=jax.random.key(args.seed),
        max_len=args.max_len,
        callback=stream,
        speculative=args.speculative or False,
        stats=stats,
    )
    if ed.parallel.is_primary():
        print()
    prefill = stamps[0] - start
    say(
        f"prefill: {len(prompt)} tokens in {prefill:.2f} s ({len(prompt) / prefill:.1f} tokens/s, "
        "first call: includes compilation)"
    )
    if len(stamps) > 2:
        # From the second decode step on: the first one compiles.
        rate = (len(stamps) - 2) / (stamps[-1] - stamps[1])
        say(f"decode: {len(stamps) - 1} tokens, {rate:.1f} tokens/s")
    if args.speculative and stats["steps"]:
        say(
            f"speculative: {stats['accepted']} of {stats['drafted']} drafts accepted "
            f"({stats['accepted'] / max(stats['drafted'], 1):.0%}), "
            f"{(stats['tokens'] - 1) / stats['steps']:.2f} tokens per main-model call "
            f"(after the prefill's first token)"
        )
        if "confidence_accepted" in stats:

            def mean(key: str) -> str:  # NaN: no such drafts
                value = stats[key]
                return "-" if value != value else f"{value:.2f}"

            say(
                f"drafter confidence: {mean('confidence_accepted')} on accepted drafts, "
                f"{mean('confidence_rejected')} on rejected ones"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
