"""The OpenAI API's requests and answers: a request body checked field by field into what the
engine runs, and the answer (whole, or as stream chunks) built from a reply's events.

Reasoning effort: the values clients send map onto the checkpoint's ladder (`EFFORTS`);
`"none"` is chat mode (no reasoning), any other value thinking mode with the effort the
release's protocol has for it. A request without one gets the server's default.
"""

import dataclasses
import json
import math
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from ..text import chat_prompt


# The values OpenAI clients send, onto the release's efforts per protocol revision (`None`: the
# revision's default instruction, none). "none" is chat mode.
EFFORTS: dict[str, dict[str, str | None]] = {
    "original": {
        "minimal": None,
        "low": None,
        "medium": None,
        "high": "high",
        "xhigh": "max",
        "max": "max",
    },
    "0731": {
        "minimal": "low",
        "low": "low",
        "medium": "high",
        "high": "high",
        "xhigh": "max",
        "max": "max",
    },
}
REASONING_EFFORTS = ("none", *EFFORTS["original"])


class ApiError(Exception):
    """A request the server refuses: HTTP `status`, OpenAI error `type`, the `param` at fault."""

    def __init__(self, message: str, *, param: str | None = None, status: int = 400,
                 type: str = "invalid_request_error", code: str | None = None):  # fmt: skip
        super().__init__(message)
        self.message, self.param, self.status, self.type, self.code = (
            message,
            param,
            status,
            type,
            code,
        )

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


@dataclasses.dataclass
class Job:
    """What one request asks the engine for, checked."""

    ids: list[int]
    thinking: bool
    max_new_tokens: int
    temperature: float
    top_k: int
    top_p: float
    seed: int
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    # The request field an error about the prompt names.
    param: str = "messages"


_MISSING = object()


def _get(body: dict, name: str, kinds: tuple[type, ...], default: Any = _MISSING) -> Any:
    value = body.get(name, _MISSING)
    if value is _MISSING or value is None:
        if default is _MISSING:
            raise ApiError(f"'{name}' is required", param=name)
        return default
    if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
        expected = " or ".join("number" if k is float else k.__name__ for k in kinds)
        raise ApiError(f"'{name}' must be {expected}, got {json.dumps(value)[:60]}", param=name)
    return value


def _range(name: str, value: float, low: float, high: float, *, open_low: bool = False) -> None:
    if not math.isfinite(value) or value < low or value > high or (open_low and value == low):
        bounds = f"{'(' if open_low else '['}{low}, {high}]"
        raise ApiError(f"'{name}' must be in {bounds}, got {value}", param=name)


def _common(body: dict, prompt_tokens: int, max_len: int) -> dict[str, Any]:
    # The sampling and length fields both endpoints take.
    n = _get(body, "n", (int,), 1)
    if n != 1:
        raise ApiError(f"'n' must be 1 (one choice per request), got {n}", param="n")
    room = max_len - prompt_tokens
    if room < 1:
        raise ApiError(
            f"the prompt has {prompt_tokens} tokens; this server's limit is {max_len} tokens "
            f"(--max-len), prompt and reply together",
            param="messages" if "messages" in body else "prompt",
            code="context_length_exceeded",
        )
    names = ("max_completion_tokens", "max_tokens")
    given = [name for name in names if body.get(name) is not None]
    max_new = _get(body, given[0], (int,)) if given else room
    if max_new < 1:
        raise ApiError(f"'{given[0]}' must be >= 1, got {max_new}", param=given[0])
    temperature = _number(body, "temperature", 1.0)
    _range("temperature", temperature, 0.0, 2.0)
    top_p = _number(body, "top_p", 1.0)
    _range("top_p", top_p, 0.0, 1.0, open_low=True)
    top_k = _get(body, "top_k", (int,), 0)
    if top_k < 0:
        raise ApiError(f"'top_k' must be >= 0, got {top_k}", param="top_k")
    seed = _get(body, "seed", (int,), None)
    stop = _get(body, "stop", (str, list), [])
    stop = [stop] if isinstance(stop, str) else stop
    if len(stop) > 4 or not all(isinstance(s, str) and s for s in stop):
        raise ApiError(
            "'stop' must be a string or a list of up to 4 non-empty strings", param="stop"
        )
    stream = _get(body, "stream", (bool,), False)
    options = _get(body, "stream_options", (dict,), {})
    return {
        "max_new_tokens": min(max_new, room),
        "temperature": temperature,
        "top_k": top_k,
        "top_p": top_p,
        "seed": uuid.uuid4().int % 2**31 if seed is None else seed,
        "stop": tuple(stop),
        "stream": stream,
        "include_usage": bool(options.get("include_usage", False)),
    }


def _number(body: dict, name: str, default: float) -> float:
    value = _get(body, name, (int, float), default)
    try:
        return float(value)
    except OverflowError:  # an integer too large for a float
        raise ApiError(f"'{name}' is out of range: {value}", param=name) from None


def _text(content: Any, where: str) -> str:
    # A message's content as text: a string, or OpenAI's text parts.
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for i, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text":
                raise ApiError(
                    f"{where}.content[{i}]: only text parts are supported", param=f"{where}.content"
                )
            parts.append(_get(part, "text", (str,)))
        return "".join(parts)
    raise ApiError(f"{where}.content must be a string or a list of text parts", param=where)


def _messages(messages: Any, tools: list | None) -> list[dict]:
    # OpenAI's messages as the release's protocol takes them; tool-call ids checked.
    if not isinstance(messages, list) or not messages:
        raise ApiError("'messages' must be a non-empty list", param="messages")
    out, calls = [], set()
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise ApiError(f"{where} must be an object", param=where)
        message = {k: v for k, v in message.items() if v is not None and k != "name"}
        role = message.get("role")
        if role == "tool":
            answered = message.get("tool_call_id")
            if not isinstance(answered, str) or answered not in calls:
                raise ApiError(
                    f"{where}.tool_call_id {message.get('tool_call_id')!r} answers no tool call "
                    "of an earlier assistant message",
                    param=f"{where}.tool_call_id",
                )
        if "content" in message and role != "tool":
            message["content"] = _text(message["content"], where)
        for j, call in enumerate(message.get("tool_calls") or []):
            if not isinstance(call, dict) or not isinstance(call.get("id"), str) or not call["id"]:
                raise ApiError(f"{where}.tool_calls[{j}] needs a string 'id'", param=where)
            calls.add(call["id"])
        if role == "assistant":
            message.setdefault("content", "")
        out.append(message)
    if tools:
        if out[0].get("role") == "system":
            out[0] = {**out[0], "tools": tools}
        else:
            out.insert(0, {"role": "system", "content": "", "tools": tools})
    return out


def _tools(body: dict) -> list | None:
    tools = _get(body, "tools", (list,), None)
    choice = _get(body, "tool_choice", (str, dict), "auto")
    if choice not in ("auto", "none"):
        raise ApiError(
            f"'tool_choice' {json.dumps(choice)[:60]} is not supported: 'auto' or 'none'",
            param="tool_choice",
        )
    if not tools or choice == "none":
        return None
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if (
            not isinstance(tool, dict)
            or tool.get("type") != "function"
            or not isinstance(function, dict)
            or not isinstance(function.get("name"), str)
            or not function["name"]
            or not isinstance(function.get("parameters", {}), dict)
        ):
            raise ApiError(
                f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ..., "
                "'parameters': {...}}}}",
                param=f"tools[{i}]",
            )
    return tools


def chat_job(
    body: Any,
    *,
    encode: Callable[[str], Sequence[int]],
    max_len: int,
    revision: str,
    default_effort: str,
) -> Job:
    """A chat request's body as a `Job`; raises `ApiError` naming the field at fault."""
    if not isinstance(body, dict):
        raise ApiError("the request body must be a JSON object")
    effort = _get(body, "reasoning_effort", (str,), default_effort)
    if effort not in REASONING_EFFORTS:
        raise ApiError(
            f"'reasoning_effort' {effort!r}: one of {', '.join(REASONING_EFFORTS)}",
            param="reasoning_effort",
        )
    messages = _messages(body.get("messages"), _tools(body))
    thinking = effort != "none"
    try:
        prompt = chat_prompt(
            messages,
            thinking=thinking,
            reasoning_effort=EFFORTS[revision][effort] if thinking else None,
            revision=revision,
        )
    except (ValueError, TypeError) as e:
        raise ApiError(str(e), param="messages") from None
    ids = list(encode(prompt))
    return Job(ids=ids, thinking=thinking, **_common(body, len(ids), max_len))


def completion_job(body: Any, *, encode: Callable[[str], Sequence[int]], max_len: int) -> Job:
    """A completion request's body (`prompt`: text, or token ids) as a `Job`."""
    if not isinstance(body, dict):
        raise ApiError("the request body must be a JSON object")
    prompt = _get(body, "prompt", (str, list))
    if isinstance(prompt, str):
        ids = list(encode(prompt))
    elif all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt):
        ids = list(prompt)
    else:
        raise ApiError("'prompt' must be a string or a list of token ids", param="prompt")
    if not ids:
        raise ApiError("'prompt' is empty", param="prompt")
    return Job(ids=ids, thinking=False, param="prompt", **_common(body, len(ids), max_len))


class Answer:
    """The OpenAI objects of one answer: `chunk(...)` for a stream, `whole(...)` at the end."""

    def __init__(self, model: str, kind: str, prompt_tokens: int):
        prefix = "chatcmpl" if kind == "chat" else "cmpl"
        self.id = f"{prefix}-{uuid.uuid4().hex[:24]}"
        self.model, self.kind, self.prompt_tokens = model, kind, prompt_tokens
        self.created = int(time.time())
        self.calls = 0

    def call(self, call: dict) -> dict:
        """A parsed tool call with its id."""
        self.calls += 1
        return {"id": f"call_{uuid.uuid4().hex[:24]}", **call}

    def chunk(self, delta: dict | str | None, finish_reason: str | None = None) -> dict:
        kind = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish_reason}
        if self.kind == "chat":
            choice["delta"] = delta or {}
        else:
            choice["text"] = delta or ""
        return self._envelope(kind, choice)

    def _envelope(self, kind: str, choice: dict) -> dict:
        return {
            "id": self.id,
            "object": kind,
            "created": self.created,
            "model": self.model,
            "choices": [choice],
        }

    def usage(self, completion_tokens: int) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": self.prompt_tokens + completion_tokens,
        }

    def usage_chunk(self, completion_tokens: int) -> dict:
        chunk = self.chunk(None)
        chunk["choices"] = []
        chunk["usage"] = self.usage(completion_tokens)
        return chunk

    def whole(
        self,
        *,
        content: str,
        reasoning: str,
        tool_calls: list[dict],
        finish_reason: str,
        completion_tokens: int,
    ) -> dict:
        if self.kind == "chat":
            message: dict[str, Any] = {
                "role": "assistant",
                "content": content or (None if tool_calls else ""),
                "reasoning_content": reasoning or None,
            }
            if tool_calls:
                message["tool_calls"] = tool_calls
            choice: dict[str, Any] = {"index": 0, "message": message}
            kind = "chat.completion"
        else:
            choice, kind = {"index": 0, "text": content, "logprobs": None}, "text_completion"
        choice["finish_reason"] = finish_reason
        return {**self._envelope(kind, choice), "usage": self.usage(completion_tokens)}
