"""A reply read as it is generated: reasoning, content and tool calls, each handed out as soon
as it is certain.

`ReplyStream.push(text)` takes the next piece of the reply's text (special tokens included)
and returns what it now knows: reasoning text, content text, and each tool call once its DSML
invoke block has closed and parsed (by the release's grammar, `text._reply`). Text that could
still turn out to be the start of `</think>`, of a tool-call block or of a stop string is held
back until the next piece decides it, so DSML never reaches the content or the reasoning.
`finish()` ends the reply: a reply cut short (its length limit) keeps the text it has; a
tool call still open is dropped, never handed out half-parsed. The non-streamed answer is the
same events joined, so both modes agree.
"""

import dataclasses
from typing import Any

from ..text import CALLS_CLOSE, CALLS_OPEN, END_THINK, EOS, INVOKE_CLOSE, parse_invoke


@dataclasses.dataclass(frozen=True)
class Event:
    """What a piece of the reply added: `kind` is `"reasoning"` or `"content"` (`value`: text)
    or `"tool_call"` (`value`: `{"type": "function", "function": {"name", "arguments"}}`)."""

    kind: str
    value: Any


# A tool-call block's opener: after a blank line, as the release writes it, or bare.
OPENERS = (CALLS_OPEN, CALLS_OPEN.lstrip("\n"))


def _held(text: str, markers: tuple[str, ...]) -> int:
    # The length of the longest end of `text` that is the start of one of `markers`.
    best = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(text)), best, -1):
            if text.endswith(marker[:n]):
                best = n
                break
    return best


class ReplyStream:
    """The reply to a prompt in thinking mode (`thinking`: it opens with reasoning that
    `</think>` closes) or chat mode, read piece by piece; `stop`: strings that end the content
    (the string itself is not part of it); `plain`: the text of a completion, whose content
    only a stop string ends."""

    def __init__(self, *, thinking: bool, stop: tuple[str, ...] = (), plain: bool = False):
        self.phase = "reasoning" if thinking and not plain else "content"
        self.stop = tuple(s for s in stop if s)
        # What ends each part: the reasoning, `</think>` or a tool-call block (the release's
        # parser refuses the latter; its DSML still stays out of the text); the content, a
        # block, the end of sentence or a stop string. The text of a completion (`plain`) is
        # all content, which only a stop string ends.
        self.openers = () if plain else OPENERS
        self.ends = {
            "reasoning": (END_THINK, *self.openers),
            "content": (*self.openers, *(() if plain else (EOS,)), *self.stop),
        }
        self.buffer = ""
        self.calls = 0
        self.stopped = False  # the end of the reply, a stop string or malformed DSML was read
        self.malformed: str | None = None

    def push(self, text: str) -> list[Event]:
        """The events `text` (the reply's next piece) completes."""
        if self.phase == "done":
            return []
        self.buffer += text
        events: list[Event] = []
        while True:
            before = (self.phase, len(self.buffer))
            if self.phase == "calls":
                self._calls(events)
            else:
                self._text(events)
            if self.phase == "done" or (self.phase, len(self.buffer)) == before:
                return events

    def finish(self) -> list[Event]:
        """The reply ends here (its end of sentence, a stop string, or its length limit): the
        text held back is handed out, except what could have started a tool-call block (a
        block cut short is dropped whole)."""
        events: list[Event] = []
        if self.phase in ("reasoning", "content"):
            text = self.buffer[: len(self.buffer) - _held(self.buffer, self.openers)]
            tail = self.buffer[len(text) :]
            if tail.strip() == "":  # only the blank line that opens a block
                text += tail
            if text:
                events.append(Event(self.phase, text))
        self.buffer, self.phase = "", "done"
        return events

    @property
    def ended(self) -> bool:
        """The end of sentence, a stop string or malformed DSML was read: nothing after it
        counts."""
        return self.stopped

    def _text(self, events: list[Event]) -> None:
        # Reasoning or content up to the first of its ends; what could start one held back.
        ends = self.ends[self.phase]
        found = [(at, m) for m in ends if (at := self.buffer.find(m)) != -1]
        if not found:
            text = self.buffer[: len(self.buffer) - _held(self.buffer, ends)]
            self.buffer = self.buffer[len(text) :]
            if text:
                events.append(Event(self.phase, text))
            return
        at, marker = min(found, key=lambda f: f[0])
        if at:
            events.append(Event(self.phase, self.buffer[:at]))
        rest = self.buffer[at + len(marker) :]
        if marker in self.openers:
            self.buffer, self.phase = rest, "calls"
        elif marker == END_THINK:
            self.buffer, self.phase = rest, "content"
        else:  # the end of sentence or a stop string
            self.buffer, self.phase, self.stopped = "", "done", True

    def _calls(self, events: list[Event]) -> None:
        # The block after its opener: '>\n', then invokes each followed by '>\n', then its
        # close (and the end of sentence, which the engine keeps: a stop token). An invoke is
        # parsed once its close and the '>\n' after it are here.
        if self.buffer.startswith(">\n" + CALLS_CLOSE):
            self.buffer, self.phase, self.stopped = "", "done", True
            return
        close = self.buffer.find(INVOKE_CLOSE)
        end = close + len(INVOKE_CLOSE)
        if close == -1 or len(self.buffer) < end + 2:
            return
        try:
            if not self.buffer.startswith(">\n"):
                raise ValueError(f"expected '>\\n' before an invoke: {self.buffer[:20]!r}")
            call = parse_invoke(self.buffer[2:end] + ">")
            if self.buffer[end : end + 2] != ">\n":
                raise ValueError(f"expected '>\\n' after an invoke: {self.buffer[end:][:20]!r}")
        except ValueError as e:
            self._malformed(str(e))
            return
        self.calls += 1
        events.append(Event("tool_call", call))
        self.buffer = self.buffer[end:]

    def _malformed(self, why: str) -> None:
        # DSML the release's parser refuses: nothing more of the block is handed out, and
        # the reply ends here.
        self.malformed = why
        self.buffer, self.phase, self.stopped = "", "done", True
