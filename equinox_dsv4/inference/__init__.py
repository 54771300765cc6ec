"""`equinox_dsv4.inference`: generation with the compressed KV cache.

Sampling (`Sampling`, `sample`; each row its own: `SamplingRows`, `sample_rows`; the
speculative rule `accept_drafts`), the jitted prefill and
decode steps, `generate` (one host loop for plain and speculative decoding, the MTP blocks or
the DSpark drafter drafting), and the cache's size (`cache_bytes`).

May import: config, quant, execution, nn, parallel.
"""

from ._drafting import AbstractDrafter as AbstractDrafter, MTPDrafter as MTPDrafter
from ._dspark import DSparkDrafter as DSparkDrafter, DSparkState as DSparkState
from ._generate import (
    decode_step as decode_step,
    drafter_for as drafter_for,
    generate as generate,
    prefill as prefill,
    speculative_step as speculative_step,
)
from ._sampling import (
    Sampling as Sampling,
    SamplingRows as SamplingRows,
    accept_drafts as accept_drafts,
    draw_rows as draw_rows,
    filtered_logits as filtered_logits,
    filtered_rows as filtered_rows,
    sample as sample,
    sample_rows as sample_rows,
    split_keys as split_keys,
)
from ._sizes import cache_bytes as cache_bytes, cache_bytes_per_token as cache_bytes_per_token


__all__ = [
    "generate",
    "prefill",
    "decode_step",
    "speculative_step",
    "drafter_for",
    "AbstractDrafter",
    "MTPDrafter",
    "DSparkDrafter",
    "DSparkState",
    "Sampling",
    "SamplingRows",
    "sample",
    "filtered_logits",
    "sample_rows",
    "filtered_rows",
    "draw_rows",
    "split_keys",
    "accept_drafts",
    "cache_bytes",
    "cache_bytes_per_token",
]
