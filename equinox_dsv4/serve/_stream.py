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
        # What ends the content: a stop string, and unless the text is `plain` (a completion,
        # not a chat reply) the end of sentence or a tool-call block.
        self.ends = self.stop if plain else (CALLS_OPEN, EOS, *self.stop)
        self.buffer = ""
        self.calls = 0
        self.stopped = False  # a stop string or the end of the reply was read
        self.malformed: str | None = None

    def push(self, text: str) -> list[Event]:
        """The events `text` (the reply's next piece) completes."""
        if self.phase == "done":
            return []
        self.buffer += text
        events: list[Event] = []
        while True:
            before = (self.phase, len(self.buffer))
            if self.phase == "reasoning":
                self._reasoning(events)
            elif self.phase == "content":
                self._content(events)
            elif self.phase == "calls":
                self._calls(events)
            if self.phase == "done" or (self.phase, len(self.buffer)) == before:
                return events

    def finish(self) -> list[Event]:
        """The reply ends here (its end of sentence was read, a stop string, or its length
        limit): the text held back is handed out where it cannot be the start of a marker
        (a tool-call block cut short is dropped, so is an unfinished marker)."""
        events: list[Event] = []
        if self.phase == "reasoning":
            text = self.buffer[: len(self.buffer) - _held(self.buffer, (END_THINK,))]
            if text:
                events.append(Event("reasoning", text))
        elif self.phase == "content":
            held = _held(self.buffer, self.ends)
            text = self.buffer[: len(self.buffer) - held]
            tail = self.buffer[len(text) :]
            if tail.strip() == "":  # only the blank line that opens a tool-call block
                text += tail
            if text:
                events.append(Event("content", text))
        self.buffer, self.phase = "", "done"
        return events

    @property
    def ended(self) -> bool:
        """The end of sentence or a stop string was read: nothing after it counts."""
        return self.stopped

    def _reasoning(self, events: list[Event]) -> None:
        at = self.buffer.find(END_THINK)
        if at == -1:
            text = self.buffer[: len(self.buffer) - _held(self.buffer, (END_THINK,))]
            self.buffer = self.buffer[len(text) :]
            if text:
                events.append(Event("reasoning", text))
            return
        if at:
            events.append(Event("reasoning", self.buffer[:at]))
        self.buffer, self.phase = self.buffer[at + len(END_THINK) :], "content"

    def _content(self, events: list[Event]) -> None:
        ends = [(self.buffer.find(m), m) for m in self.ends]
        found = [(at, m) for at, m in ends if at != -1]
        if not found:
            keep = _held(self.buffer, self.ends)
            text = self.buffer[: len(self.buffer) - keep]
            self.buffer = self.buffer[len(text) :]
            if text:
                events.append(Event("content", text))
            return
        at, marker = min(found, key=lambda f: f[0])
        if at:
            events.append(Event("content", self.buffer[:at]))
        if marker == CALLS_OPEN:
            self.buffer, self.phase = self.buffer[at + len(CALLS_OPEN) :], "calls"
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
        # DSML the release's parser refuses: nothing more of the block is handed out.
        self.malformed = why
        self.buffer, self.phase = "", "done"
