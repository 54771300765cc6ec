"""`equinox_dsv4.text`: the release's chat protocol and tokenizer.

Conversations to prompt text (`chat_prompt`, byte for byte the release's encoder), replies back
to messages with reasoning and tool calls (`parse_reply`), and the tokenizer.

May import: nothing of the package.
"""

from ._chat import (
    ASSISTANT as ASSISTANT,
    BOS as BOS,
    DSML as DSML,
    END_THINK as END_THINK,
    EOS as EOS,
    MARKERS as MARKERS,
    REASONING_EFFORTS as REASONING_EFFORTS,
    REASONING_EFFORTS_0731 as REASONING_EFFORTS_0731,
    REVISIONS as REVISIONS,
    ROLES as ROLES,
    THINK as THINK,
    USER as USER,
    chat_prompt as chat_prompt,
)
from ._reply import (
    CALLS_CLOSE as CALLS_CLOSE,
    CALLS_OPEN as CALLS_OPEN,
    INVOKE_CLOSE as INVOKE_CLOSE,
    parse_invoke as parse_invoke,
    parse_reply as parse_reply,
)
from ._tokenizer import (
    decode_text as decode_text,
    encode_text as encode_text,
    load_tokenizer as load_tokenizer,
)


__all__ = [
    "chat_prompt",
    "parse_reply",
    "parse_invoke",
    "encode_text",
    "decode_text",
    "load_tokenizer",
    "BOS",
    "EOS",
    "USER",
    "ASSISTANT",
    "THINK",
    "END_THINK",
    "DSML",
    "MARKERS",
    "CALLS_OPEN",
    "CALLS_CLOSE",
    "INVOKE_CLOSE",
    "ROLES",
    "REASONING_EFFORTS",
    "REASONING_EFFORTS_0731",
    "REVISIONS",
]
