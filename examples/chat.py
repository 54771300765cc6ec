"""Chat with DeepSeek-V4 in the terminal, in the release's chat protocol.

Type a message and the reply streams as it is generated. The conversation is kept: each turn's
prompt is the whole history written by `equinox_dsv4.chat_prompt` (in thinking mode the reasoning
of earlier turns is dropped, as the release does, unless tools are in play). With `--tools FILE`
(OpenAI function tools, a JSON list) the model may call them: the calls are parsed
(`equinox_dsv4.parse_reply`) and printed, you type each result, and the model goes on.

Commands: /think (toggle thinking mode), /effort max|high|none, /prompt (print the prompt
text so far), /reset, /help, /quit (or end of input).

`--messages FILE` runs once instead: the conversation in FILE (a JSON list of messages, or
{"messages": [...], "tools": [...]}) gets one reply, printed; `--json` also prints the parsed
reply as one JSON line.

With no model argument it runs the embedded default: a tiny model with RANDOM (seeded) weights,
whose replies are meaningless and seldom in the protocol's format (they are then kept as plain
text); `--checkpoint DIR` or `--hf DIR` for real weights, as for examples/generate.py.
"""

import argparse
import copy
import json
import pathlib
import sys
from collections.abc import Callable
from typing import Any

import jax
from _common import (
    TextStream,
    add_adapter_argument,
    add_model_arguments,
    add_sampling_arguments,
    check_vocabulary,
    load_model,
    new_parser,
    run_reporting_errors,
    sampling,
    with_adapter,
)

import equinox_dsv4 as ed


EOS = "<｜end▁of▁sentence｜>"
HELP = "/think, /effort low|high|max|none, /prompt, /reset, /help, /quit"


class Conversation:
    """The messages so far and the protocol's options; replies parsed into the history."""

    def __init__(
        self,
        *,
        system: str | None = None,
        tools: list | None = None,
        thinking: bool = False,
        reasoning_effort: str | None = None,
        messages: list | None = None,
        revision: str = "original",
    ):
        self.messages: list[dict[str, Any]] = list(messages or [])
        if tools:
            if self.messages and self.messages[0].get("role") == "system":
                self.messages[0] = {**self.messages[0], "tools": tools}
            else:
                self.messages.insert(0, {"role": "system", "content": system or "", "tools": tools})
        elif system is not None and not any(m.get("role") == "system" for m in self.messages):
            self.messages.insert(0, {"role": "system", "content": system})
        # What /reset keeps: the system message.
        self.start = [m for m in self.messages[:1] if m.get("role") == "system"]
        self.thinking = thinking
        self.reasoning_effort = reasoning_effort
        self.revision = revision
        self.calls = 0
        self.pending: list[dict[str, Any]] = []  # tool calls of the last reply awaiting results
        self.prompt()  # refuse a bad conversation before any generation

    def prompt(self) -> str:
        return ed.chat_prompt(
            self.messages,
            thinking=self.thinking,
            reasoning_effort=self.reasoning_effort,
            revision=self.revision,
        )

    def ask(self, text: str) -> None:
        if self.pending:
            raise ValueError("the model's tool calls are waiting for their results")
        self.messages.append({"role": "user", "content": text})

    def answer(self, reply: str) -> tuple[dict[str, Any] | None, str | None]:
        """Add the model's reply (text with its special tokens) to the history.

        Returns the parsed reply, or None and the reason when the reply is not in the protocol's
        format (cut off by the token limit, or a model that was never trained on it): then its
        visible text is kept as the assistant's content.
        """
        try:
            parsed = ed.parse_reply(reply, thinking=self.thinking)
        except ValueError as e:
            visible = ed.decode_text(ed.encode_text(reply))
            self.messages.append({"role": "assistant", "content": visible})
            return None, str(e)
        message = {k: v for k, v in copy.deepcopy(parsed).items() if v or k in ("role", "content")}
        for call in message.get("tool_calls", []):
            call["id"] = f"call_{self.calls}"
            self.calls += 1
        self.messages.append(message)
        self.pending = list(message.get("tool_calls", []))
        return parsed, None

    def give_result(self, call: dict[str, Any], result: str) -> None:
        self.pending.remove(call)
        self.messages.append({"role": "tool", "tool_call_id": call["id"], "content": result})

    def reset(self) -> None:
        self.messages = list(self.start)
        self.pending = []


def describe(call: dict[str, Any]) -> str:
    return f"{call['function']['name']}({call['function']['arguments']}) [{call['id']}]"


class Replier:
    """Generates a reply to a prompt, streaming its text to `out` (default: `sys.stdout` as it
    is when the replier is made, so that a redirection of it holds)."""

    def __init__(self, model: ed.DeepseekV4, args: argparse.Namespace, out=None):
        out = sys.stdout if out is None else out
        self.model, self.args, self.out = model, args, out
        self.sampling = sampling(args)
        self.key = jax.random.key(args.seed)
        self.colour = out.isatty()
        self.eos = ed.text.load_tokenizer().token_to_id(EOS)

    def __call__(self, prompt: str, thinking: bool) -> str:
        ids = ed.encode_text(prompt)
        if len(ids) + 1 > self.args.max_len:
            raise ValueError(
                f"the conversation has {len(ids)} tokens, more than --max-len {self.args.max_len} "
                "allows: /reset, or raise --max-len"
            )
        stream = TextStream(skip_special_tokens=False)
        reasoning = thinking
        if reasoning:
            self._write("\033[2m" if self.colour else "(thinking) ")

        def show(tokens, running):
            # Called with each new token; a reply's last call brings the end of sentence.
            nonlocal reasoning
            text = stream.push(tokens[0]).replace(EOS, "")
            if reasoning and "</think>" in text:
                reasoning = False
                before, after = text.split("</think>", 1)
                text = before + ("\033[0m\n" if self.colour else "\n(answer) ") + after
            self._write(text)

        self.key, key = jax.random.split(self.key)
        ed.generate(
            self.model,
            [ids],
            max_new_tokens=self.args.max_new_tokens,
            sampling=self.sampling,
            key=key,
            max_len=self.args.max_len,
            stop_tokens=[self.eos],
            callback=show,
        )
        if reasoning and self.colour:
            self._write("\033[0m")
        self._write("\n")
        return ed.decode_text(stream.ids, skip_special_tokens=False)

    def _write(self, text: str) -> None:
        self.out.write(text)
        self.out.flush()


def turn(conversation: Conversation, reply: Callable[[str, bool], str], log) -> dict | None:
    """One reply from the model: parsed, added to the history, its tool calls printed."""
    parsed, problem = conversation.answer(reply(conversation.prompt(), conversation.thinking))
    if problem is not None:
        print(f"[the reply is not in the chat format ({problem}); kept as plain text]", file=log)
    for call in conversation.pending:
        print(f"[tool call] {describe(call)}", file=log)
    return parsed


def interact(conversation: Conversation, reply, read: Callable[[str], str], log) -> None:
    """The terminal loop: `read(prompt)` gives the next line (EOFError ends)."""
    while True:
        try:
            line = read("you> ").strip()
        except EOFError:
            return
        if not line:
            continue
        if line.startswith("/"):
            command, _, value = line.partition(" ")
            if command == "/quit":
                return
            if command == "/think":
                conversation.thinking = not conversation.thinking
                print(f"[thinking mode {'on' if conversation.thinking else 'off'}]", file=log)
            elif command == "/effort" and value.strip() in ("low", "high", "max", "none"):
                effort, before = value.strip(), conversation.reasoning_effort
                conversation.reasoning_effort = None if effort == "none" else effort
                try:
                    conversation.prompt()
                    print(f"[reasoning effort {effort}]", file=log)
                except ValueError as e:  # "low" in the original protocol
                    conversation.reasoning_effort = before
                    print(f"[error: {e}]", file=log)
            elif command == "/prompt":
                print(conversation.prompt(), file=log)
            elif command == "/reset":
                conversation.reset()
                print("[conversation cleared]", file=log)
            else:
                print(f"[commands: {HELP}]", file=log)
            continue
        kept = len(conversation.messages)
        try:
            conversation.ask(line)
            turn(conversation, reply, log)
            while conversation.pending:
                for call in list(conversation.pending):
                    try:
                        result = read(f"result of {describe(call)}> ")
                    except EOFError:
                        return
                    conversation.give_result(call, result)
                turn(conversation, reply, log)
        except ValueError as e:  # e.g. the conversation outgrew --max-len: undo this exchange
            del conversation.messages[kept:]
            conversation.pending = []
            print(f"[error: {e}]", file=log)


def read_json(path: str, what: str) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not JSON ({e}); {what}") from None


def main(argv: list[str] | None = None) -> int:
    parser = new_parser(__doc__)
    add_model_arguments(parser)
    add_adapter_argument(parser)
    parser.add_argument("--system", help="system prompt")
    parser.add_argument("--tools", metavar="FILE", help="OpenAI function tools (JSON list)")
    parser.add_argument("--thinking", action="store_true", help="start in thinking mode")
    parser.add_argument(
        "--reasoning-effort",
        choices=("low", "high", "max"),
        help="the release's effort instruction (thinking mode); 'low' only in the 0731 protocol",
    )
    parser.add_argument(
        "--revision",
        choices=ed.text.REVISIONS,
        help="the chat protocol's revision (default: the loaded checkpoint's release: 0731 for "
        "a checkpoint with a DSpark drafter, else the original)",
    )
    parser.add_argument("--messages", metavar="FILE", help="reply once to this conversation")
    parser.add_argument("--json", action="store_true", help="with --messages: print the parse")
    add_sampling_arguments(parser, max_new_tokens=64)
    parser.add_argument(
        "--max-len", type=int, default=4096, help="cache length: the longest conversation"
    )
    return run_reporting_errors(run, parser.parse_args(argv))


def run(args: argparse.Namespace) -> int:
    tools = None
    if args.tools:
        tools = read_json(args.tools, "expected a list of OpenAI function tools")
        if isinstance(tools, dict) and "tools" in tools:
            tools = tools["tools"]
    messages = None
    if args.messages:
        data = read_json(args.messages, "expected a list of messages")
        if isinstance(data, dict):
            tools = tools or data.get("tools")
            data = data.get("messages")
        if not isinstance(data, list) or not data:
            raise ValueError(f"{args.messages}: expected a non-empty list of messages")
        messages = data
    elif args.json:
        raise ValueError("--json goes with --messages")
    conversation = Conversation(
        system=args.system,
        tools=tools,
        thinking=args.thinking,
        reasoning_effort=args.reasoning_effort,
        messages=messages,
        # Checked before loading in the revision that accepts the effort; set below.
        revision=args.revision or ("0731" if args.reasoning_effort == "low" else "original"),
    )
    sampling(args)  # refuse bad sampling options before loading the model
    model, described = load_model(args, mtp=False)
    print(f"model: {described}", file=sys.stderr)
    model = with_adapter(model, args)
    # V4-Flash-0731 is the release that ships a DSpark drafter and the 0731 protocol; the chat
    # loads no drafter, so a release checkpoint's config.json tells.
    announced = ed.Config.from_json(pathlib.Path(args.hf) / "config.json") if args.hf else None
    released = "0731" if (announced or model.config).dspark else "original"
    conversation.revision = args.revision or released
    how = "given" if args.revision else "the checkpoint's release"
    print(f"chat protocol: {conversation.revision} revision ({how})", file=sys.stderr)
    conversation.prompt()
    check_vocabulary(model)
    reply = Replier(model, args)
    if messages is not None:
        parsed = turn(conversation, reply, sys.stderr)
        if args.json:
            print(json.dumps(parsed, ensure_ascii=False))
        return 0
    print(f"[{HELP}]", file=sys.stderr)

    def read(prompt: str) -> str:
        if sys.stdin.isatty():
            return input(prompt)
        line = sys.stdin.readline()
        if not line:
            raise EOFError
        print(prompt + line.rstrip("\n"), file=sys.stderr)  # the transcript shows the input
        return line.rstrip("\n")

    interact(conversation, reply, read, sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
