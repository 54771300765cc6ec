"""Serve DeepSeek-V4 over OpenAI's API: chat and text completions, streamed or whole, with
reasoning and tool calls parsed, many clients at once (continuous batching).

    python examples/serve.py [--checkpoint DIR | --hf DIR] [--host 127.0.0.1] [--port 8000]
        [--slots N] [--max-len L] [--speculative mtp|dspark]

With no model argument it serves the embedded default: a tiny model with RANDOM (seeded)
weights, whose text is meaningless; it shows the whole path working. Endpoints: POST
/v1/chat/completions, POST /v1/completions, GET /v1/models, GET /health. Needs the serve
extra (`pip install -e ".[serve]"`). Ctrl-C or SIGTERM: stop accepting, cancel the running
replies, exit 0.
"""

import argparse
import contextlib
import pathlib
import signal

from _common import (
    add_adapter_argument,
    add_model_arguments,
    check_vocabulary,
    load_model,
    new_parser,
    run_reporting_errors,
    say,
    with_adapter,
)

import equinox_dsv4 as ed


def main(argv: list[str] | None = None) -> int:
    parser = new_parser(__doc__)
    add_model_arguments(parser)
    add_adapter_argument(parser)
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--slots", type=int, default=8, help="replies generated at once")
    parser.add_argument(
        "--max-len", type=int, default=4096, help="tokens per slot: prompt and reply together"
    )
    parser.add_argument(
        "--chunk", type=int, default=256, help="prompt tokens per prefill step (between decodes)"
    )
    parser.add_argument(
        "--prefill-rows", type=int, default=4, help="rows a prefill step runs at most"
    )
    parser.add_argument(
        "--queue", type=int, default=64, help="requests waiting for a slot before a 429"
    )
    parser.add_argument("--name", help="the model's name in the API (default: from the source)")
    parser.add_argument(
        "--reasoning-effort",
        default="none",
        help="for requests that give none: none (chat mode), minimal, low, medium, high, xhigh, "
        "max",
    )
    parser.add_argument(
        "--revision",
        choices=ed.text.REVISIONS,
        help="the chat protocol's revision (default: the checkpoint's release)",
    )
    parser.add_argument(
        "--speculative",
        choices=("mtp", "dspark"),
        help="draft with the MTP blocks or the DSpark drafter, verified per row",
    )
    parser.add_argument("--layers", type=int, help="default model: keep the first N layers")
    return run_reporting_errors(run, parser.parse_args(argv))


def run(args: argparse.Namespace) -> int:
    try:
        import uvicorn

        from equinox_dsv4 import serve
    except ImportError as e:
        raise ValueError(f"{e.name} is missing: pip install -e '.[serve]'") from None
    if args.reasoning_effort not in serve.REASONING_EFFORTS:
        raise ValueError(f"--reasoning-effort: one of {', '.join(serve.REASONING_EFFORTS)}")
    for name in ("slots", "max_len", "chunk", "prefill_rows", "port"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    model, described = load_model(args, mtp=args.speculative or False, layers=args.layers)
    say(f"model: {described}")
    model = with_adapter(model, args)
    check_vocabulary(model)
    announced = ed.Config.from_json(pathlib.Path(args.hf) / "config.json") if args.hf else None
    revision = args.revision or ("0731" if (announced or model.config).dspark else "original")
    eos = model.config.eos_token_id
    stops = frozenset([eos] if isinstance(eos, int) else eos or [])
    engine = serve.Engine(
        model,
        slots=args.slots,
        max_len=args.max_len,
        chunk=args.chunk,
        prefill_rows=args.prefill_rows,
        max_waiting=args.queue,
        speculative=args.speculative,
    )
    drafting = f", drafting with {args.speculative}" if args.speculative else ""
    say(f"compiling the steps ({args.slots} slots of {args.max_len} tokens{drafting}) ...")
    engine.warm_up()
    name = args.name or pathlib.Path(args.checkpoint or args.hf or "equinox-dsv4-tiny").name
    app = serve.make_app(
        engine,
        model_name=name,
        encode=ed.encode_text,
        decode=lambda ids: ed.decode_text(ids, skip_special_tokens=False),
        stop_tokens=stops,
        revision=revision,
        default_effort=args.reasoning_effort,
    )
    say(f"serving {name} on http://{args.host}:{args.port}/v1 (protocol: {revision})")
    config = uvicorn.Config(
        app, host=args.host, port=args.port, log_level="warning", timeout_graceful_shutdown=5
    )
    _server_class()(config).run()
    say("stopped")
    return 0


def _server_class():
    import uvicorn

    class Server(uvicorn.Server):
        # uvicorn raises a captured SIGINT / SIGTERM again once it has shut down, so the
        # process would end by the signal; a server stopped on request exits 0 instead.
        @contextlib.contextmanager
        def capture_signals(self):
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, self.handle_exit)
            yield

    return Server


if __name__ == "__main__":
    raise SystemExit(main())
