"""The model's replies to messages: reasoning, content and DSML tool calls.

A reply is what the model writes after the prompt's assistant opener:

    [{reasoning}</think>]{content}[\\n\\n<｜DSML｜tool_calls>...</｜DSML｜tool_calls>]<｜end▁of▁sentence｜>

`parse_reply` reads it as the release's `parse_message_from_completion_text` does, and refuses
what that refuses, with a `ValueError`.
"""

import re
from typing import Any

from .._typecheck import typechecked
from ._chat import BOS, DSML, END_THINK, EOS, THINK, to_json


CALLS_OPEN = f"\n\n<{DSML}tool_calls"
CALLS_CLOSE = f"</{DSML}tool_calls>"
INVOKE, INVOKE_CLOSE = f"<{DSML}invoke", f"</{DSML}invoke"
PARAMETER, PARAMETER_CLOSE = f"<{DSML}parameter", f"/{DSML}parameter"
# The release's grammar for an invoke's name and for one parameter (`$` also before a final
# newline, as there).
NAME = re.compile(r'^\s*name="(.*?)">\n$', re.DOTALL)
PARAMETER_BODY = re.compile(r'^ name="(.*?)" string="(true|false)">(.*?)<$', re.DOTALL)


class _Reader:
    """A cursor over the reply that reads up to the first of several stop strings."""

    def __init__(self, text: str):
        self.text, self.at = text, 0

    def until(self, *stops: str) -> tuple[str, str | None]:
        """The text before the nearest stop (the earlier-listed one on a tie) and that stop; the
        rest of the text and None when no stop follows. The cursor moves past the stop."""
        best, found = len(self.text), None
        for stop in stops:
            where = self.text.find(stop, self.at)
            if where != -1 and where < best:
                best, found = where, stop
        piece = self.text[self.at : best]
        self.at = best + len(found) if found else len(self.text)
        return piece, found

    @property
    def done(self) -> bool:
        return self.at >= len(self.text)


def _arguments(parameters: dict[str, tuple[str, str]]) -> str:
    """The JSON-string arguments: string parameters quoted, the others inserted as written."""
    items = []
    for name, (value, string) in parameters.items():
        written = to_json(value, "a parameter") if string == "true" else value
        items.append(f"{to_json(name, 'a parameter name')}: {written}")
    return "{" + ", ".join(items) + "}"


def _tool_calls(reader: _Reader) -> tuple[list[dict[str, Any]], str | None]:
    calls: list[dict[str, Any]] = []
    stop = None
    while not reader.done:
        gap, stop = reader.until(INVOKE, CALLS_CLOSE)
        if gap != ">\n":
            raise ValueError(f"tool calls: expected '>\\n' before an invoke, found {gap!r}")
        if stop == CALLS_CLOSE:
            break
        if stop is None:
            raise ValueError("tool calls: the block ends without an invoke or its close")
        head, stop = reader.until(PARAMETER, INVOKE_CLOSE)
        name = NAME.match(head)
        if name is None:
            raise ValueError(f"tool calls: malformed invoke name {head!r}")
        parameters: dict[str, tuple[str, str]] = {}
        while stop == PARAMETER:
            body, stop = reader.until(PARAMETER_CLOSE)
            parameter = PARAMETER_BODY.match(body)
            if parameter is None:
                raise ValueError(f"tool calls: malformed parameter {body!r}")
            key, string, value = parameter.groups()
            if key in parameters:
                raise ValueError(f"tool calls: parameter {key!r} given twice")
            parameters[key] = (value, string)
            gap, stop = reader.until(PARAMETER, INVOKE_CLOSE)
            if gap != ">\n":
                raise ValueError(f"tool calls: expected '>\\n' after a parameter, found {gap!r}")
        calls.append(
            {
                "type": "function",
                "function": {"name": name.group(1), "arguments": _arguments(parameters)},
            }
        )
    return calls, stop


@typechecked
def parse_invoke(text: str) -> dict[str, Any]:
    """One tool call of a reply's DSML block, from `<｜DSML｜invoke` through
    `</｜DSML｜invoke>`, as `parse_reply` reads it (for a reply read as it is generated).

    **Returns:** `{"type": "function", "function": {"name": ..., "arguments": <JSON string>}}`.

    **Raises:** `ValueError` for what the release's parser refuses."""
    if not text.startswith(INVOKE) or not text.endswith(INVOKE_CLOSE + ">"):
        raise ValueError(f"not one DSML invoke block: {text[:60]!r}")
    calls, stop = _tool_calls(_Reader(">\n" + text + "\n" + CALLS_CLOSE))
    if len(calls) != 1 or stop != CALLS_CLOSE:
        raise ValueError(f"not one DSML invoke block: {text[:60]!r}")
    return calls[0]


@typechecked
def parse_reply(text: str, *, thinking: bool = False) -> dict[str, Any]:
    """Split a reply into reasoning, content and tool calls, as the release's parser does.

    **Arguments:**

    - `text`: the model's reply with its special tokens (`decode_text(ids,
      skip_special_tokens=False)`), from after the prompt's `<｜Assistant｜><think>` or
      `<｜Assistant｜></think>` through `<｜end▁of▁sentence｜>`.
    - `thinking`: the prompt was in thinking mode, so the reply opens with reasoning that
      `</think>` closes.

    **Returns:** `{"role": "assistant", "content": ..., "reasoning_content": ..., "tool_calls":
    [{"type": "function", "function": {"name": ..., "arguments": <JSON string>}}, ...]}`, ready
    to go back into `chat_prompt`'s messages (give each call an `id` for its result).

    **Raises:** `ValueError` for a reply the release refuses: no `</think>` in thinking mode, no
    `<｜end▁of▁sentence｜>` after plain content, text after the end, malformed DSML, special
    tokens inside the reasoning or content.
    """
    reader = _Reader(text)
    reasoning = ""
    if thinking:
        reasoning, stop = reader.until(END_THINK, CALLS_OPEN)
        if stop != END_THINK:
            raise ValueError("the reply has no </think> closing its reasoning")
    content, stop = reader.until(EOS, CALLS_OPEN)
    calls: list[dict[str, Any]] = []
    if stop == CALLS_OPEN:
        calls, stop = _tool_calls(reader)
        rest, stop = reader.until(EOS)
        if rest:
            raise ValueError(f"text after the tool calls: {rest[:80]!r}")
    elif stop != EOS:
        raise ValueError("the reply does not end with <｜end▁of▁sentence｜>")
    if not reader.done or stop not in (EOS, None):
        raise ValueError(f"text after the end of the reply: {text[reader.at :][:80]!r}")
    for token in (BOS, EOS, THINK, END_THINK, DSML):
        if token in content or token in reasoning:
            raise ValueError(f"special token {token!r} inside the reply's reasoning or content")
    return {
        "role": "assistant",
        "content": content,
        "reasoning_content": reasoning,
        "tool_calls": calls,
    }
