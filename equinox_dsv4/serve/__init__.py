"""`equinox_dsv4.serve`: an OpenAI-compatible server with continuous batching.

The engine (`Engine`: a fixed number of cache rows that requests take and free between jitted
steps), the reply read as it is generated (`ReplyStream`: reasoning, content, and tool calls
handed out once parsed), the OpenAI requests and answers (`chat_job`, `completion_job`,
`Answer`, `ApiError`, the reasoning-effort mapping `EFFORTS`) and the ASGI application
(`make_app`, Starlette; `examples/serve.py` runs it with uvicorn). Needs the `serve` extra;
not imported by `equinox_dsv4` itself.

May import: config, text, execution, nn, parallel, inference.
"""

from ._api import (
    EFFORTS as EFFORTS,
    REASONING_EFFORTS as REASONING_EFFORTS,
    Answer as Answer,
    ApiError as ApiError,
    Job as Job,
    chat_job as chat_job,
    completion_job as completion_job,
)
from ._app import make_app as make_app
from ._engine import Engine as Engine, QueueFull as QueueFull, Request as Request
from ._stream import Event as Event, ReplyStream as ReplyStream


__all__ = [
    "Engine",
    "Request",
    "QueueFull",
    "ReplyStream",
    "Event",
    "make_app",
    "chat_job",
    "completion_job",
    "Job",
    "Answer",
    "ApiError",
    "EFFORTS",
    "REASONING_EFFORTS",
]
