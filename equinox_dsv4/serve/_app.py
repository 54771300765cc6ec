"""The HTTP side: an ASGI application (Starlette) of OpenAI's endpoints over an `Engine`.

Each request becomes an engine `Request` whose tokens come back through an asyncio queue;
their text is read by a `ReplyStream` (chat) and sent whole or as server-sent events. A client
that goes away mid-stream cancels its request: its row is free within one engine step.
"""

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ._api import Answer, ApiError, Job, chat_job, completion_job
from ._engine import QueueFull, Request
from ._stream import ReplyStream


class TextOf:
    """The text of a growing list of token ids (special tokens kept), handed out as it becomes
    whole: a character of several bytes can span tokens."""

    def __init__(self, decode: Callable[[Sequence[int]], str]):
        self.decode, self.ids, self.shown = decode, [], ""

    def push(self, token: int) -> str:
        self.ids.append(token)
        text = self.decode(self.ids)
        if text.endswith("\ufffd"):
            return ""
        new, self.shown = text[len(self.shown) :], text
        return new

    def rest(self) -> str:
        """At the end: what is still held back (a character left unfinished, as decoded)."""
        text = self.decode(self.ids)
        new, self.shown = text[len(self.shown) :], text
        return new


def make_app(
    engine: Any,
    *,
    model_name: str,
    encode: Callable[[str], Sequence[int]],
    decode: Callable[[Sequence[int]], str],
    stop_tokens: frozenset[int],
    revision: str = "original",
    default_effort: str = "none",
) -> Starlette:
    """The application serving `engine` (an `Engine`, or anything with its `submit`, `cancel`,
    `health`, `start`, `stop`) as the model `model_name`.

    **Arguments:**

    - `encode` / `decode`: text to token ids and back (special tokens kept).
    - `stop_tokens`: the ids that end a reply (the end of sentence).
    - `revision`: the chat protocol's revision (`"original"` or `"0731"`).
    - `default_effort`: the reasoning effort of a request that names none (`"none"`: chat
      mode).
    """
    max_len = engine.max_len

    def error(e: ApiError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status)

    async def body_of(http: HttpRequest) -> Any:
        try:
            return json.loads(await http.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ApiError(f"the request body is not JSON: {e}") from None

    async def tokens(job: Job) -> AsyncIterator[tuple[str, Any]]:
        # ("token", id) ... then ("finish", reason); the request is cancelled if the consumer
        # stops early (a client gone, a stop string).
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        def put(item):
            loop.call_soon_threadsafe(queue.put_nowait, item)

        request = Request(
            ids=job.ids,
            max_new_tokens=job.max_new_tokens,
            on_token=lambda t: put(("token", t)),
            on_finish=lambda reason: put(("finish", reason)),
            stop_tokens=stop_tokens,
            temperature=job.temperature,
            top_k=job.top_k,
            top_p=job.top_p,
            seed=job.seed,
        )
        try:
            engine.submit(request)
        except QueueFull as e:
            raise ApiError(
                f"the server is busy ({e}); try again", status=429, type="rate_limit_error"
            ) from None
        except ValueError as e:
            raise ApiError(str(e), param=job.param) from None
        except RuntimeError as e:  # the engine failed, or the server is stopping
            raise ApiError(str(e), status=503, type="server_error") from None
        try:
            while True:
                item = await queue.get()
                yield item
                if item[0] == "finish":
                    return
        finally:
            if not request.finished:
                engine.cancel(request)

    async def reply(job: Job, kind: str) -> AsyncIterator[tuple[str, Any]]:
        # The answer's events: ("reasoning" | "content", text), ("tool_call", call), then
        # ("finish", reason, completion tokens).
        text = TextOf(decode)
        stream = ReplyStream(thinking=job.thinking, stop=job.stop, plain=kind != "chat")
        produced, reason = 0, "length"
        source = tokens(job)
        try:
            async for what, value in source:
                if what == "finish":
                    reason = {"stop": "stop", "cancelled": "stop"}.get(value, value)
                    break
                produced += 1
                events = stream.push(text.push(value))
                for event in events:
                    yield event.kind, event.value
                if stream.ended:  # a stop string: the rest is not wanted
                    reason = "stop"
                    break
        finally:
            await source.aclose()
        if reason == "error":
            raise ApiError("the engine failed", status=500, type="server_error")
        for event in stream.push(text.rest()) + stream.finish():
            yield event.kind, event.value
        if reason == "stop" and stream.calls and kind == "chat":
            reason = "tool_calls"
        yield "finish", (reason, produced)

    async def answer(http: HttpRequest, job: Job, kind: str):
        out = Answer(model_name, kind, len(job.ids))
        if job.stream:
            events = reply(job, kind)
            # The first event is awaited here: a refused request (busy, bad prompt) is an error
            # status, not a stream. (Once streaming, Starlette stops the stream when the client
            # goes.)
            try:
                first = await _unless_gone(http, events.__anext__())
            except ApiError as e:
                return error(e)
            if first is _GONE:
                return Response(status_code=499)
            return StreamingResponse(_sse(out, events, first, job), media_type="text/event-stream")
        parts: dict[str, list] = {"content": [], "reasoning": [], "tool_call": []}

        async def collect():
            async for what, value in reply(job, kind):
                if what == "finish":
                    return value
                parts[what].append(out.call(value) if what == "tool_call" else value)

        try:
            ended = await _unless_gone(http, collect())
        except ApiError as e:
            return error(e)
        if ended is _GONE:
            return Response(status_code=499)
        reason, produced = ended
        return JSONResponse(
            out.whole(
                content="".join(parts["content"]),
                reasoning="".join(parts["reasoning"]),
                tool_calls=parts["tool_call"],
                finish_reason=reason,
                completion_tokens=produced,
            )
        )

    async def chat(http: HttpRequest):
        try:
            body = await body_of(http)
            job = chat_job(
                body, encode=encode, max_len=max_len, revision=revision,
                default_effort=default_effort,
            )  # fmt: skip
        except ApiError as e:
            return error(e)
        return await answer(http, job, "chat")

    async def completions(http: HttpRequest):
        try:
            job = completion_job(await body_of(http), encode=encode, max_len=max_len)
        except ApiError as e:
            return error(e)
        return await answer(http, job, "completion")

    async def models(http: HttpRequest):
        entry = {
            "id": model_name,
            "object": "model",
            "created": started,
            "owned_by": "equinox_dsv4",
        }
        return JSONResponse({"object": "list", "data": [entry]})

    async def health(http: HttpRequest):
        # 503 once the engine's loop has failed: a supervisor restarts the server.
        failed = getattr(engine, "error", None)
        status = {"status": "error", "error": repr(failed)} if failed else {"status": "ok"}
        body = {**status, "model": model_name, **engine.health()}
        return JSONResponse(body, status_code=503 if failed else 200)

    async def http_error(http: HttpRequest, e: HTTPException):
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        message = f"{http.method} {http.url.path}: {e.detail}"
        return error(ApiError(message, status=e.status_code, type=kind))

    @contextlib.asynccontextmanager
    async def lifespan(app):
        engine.start()
        try:
            yield
        finally:
            engine.stop()

    started = int(time.time())
    return Starlette(
        routes=[
            Route("/v1/chat/completions", chat, methods=["POST"]),
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/health", health, methods=["GET"]),
        ],
        exception_handlers={HTTPException: http_error},
        lifespan=lifespan,
    )


# What `_unless_gone` gives when the client went away first.
_GONE = object()


async def _unless_gone(http: HttpRequest, work: Awaitable) -> Any:
    """`await work`, unless the client goes away first: then `work` is cancelled (a request
    it was waiting on is cancelled with it, its row freed) and `_GONE` is returned."""
    task = asyncio.ensure_future(work)
    while True:
        done, _ = await asyncio.wait({task}, timeout=0.25)
        if done:
            return task.result()
        if await http.is_disconnected():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            return _GONE


async def _sse(out: Answer, events: AsyncIterator, first: tuple, job: Job) -> AsyncIterator[str]:
    # OpenAI's chunks as server-sent events, then `[DONE]`.
    def send(obj: dict) -> str:
        return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

    chat = out.kind == "chat"
    if chat:
        yield send(out.chunk({"role": "assistant", "content": ""}))
    try:
        event = first
        while True:
            what, value = event
            if what == "finish":
                reason, produced = value
                yield send(out.chunk(None, reason))
                if job.include_usage:
                    yield send(out.usage_chunk(produced))
                yield "data: [DONE]\n\n"
                return
            if what == "tool_call":
                index = out.calls
                call = out.call(value)
                yield send(out.chunk({"tool_calls": [{"index": index, **call}]}))
            elif chat:
                field = "reasoning_content" if what == "reasoning" else "content"
                yield send(out.chunk({field: value}))
            else:
                yield send(out.chunk(value))
            try:
                event = await events.__anext__()
            except StopAsyncIteration:
                return
    except ApiError as e:
        yield send(e.body())
    finally:
        await events.aclose()
