"""How much memory a decoding cache takes: per token of context, and for a batch at a length,
against a plain multi-query cache of the same layers."""

import jax.numpy as jnp
import numpy as np
from jax.typing import DTypeLike

from .._typecheck import typechecked
from ..config import CSA, HCA, SLIDING, Config
from ..nn import ring_slots, window_slots


@typechecked
def cache_bytes_per_token(config: Config, dtype: DTypeLike = jnp.bfloat16) -> dict[str, float]:
    """Bytes of cache per token of context, per layer of each attention type, in the limit of
    a long context (the fixed-size sliding ring and compressor buffers excluded)."""
    item = np.dtype(dtype).itemsize
    return {
        SLIDING: 0.0,
        CSA: (config.head_dim + config.index_head_dim) * item / config.compress_rate_csa,
        HCA: config.head_dim * item / config.compress_rate_hca,
    }


@typechecked
def cache_bytes(
    config: Config,
    max_len: int,
    batch: int = 1,
    dtype: DTypeLike = jnp.bfloat16,
    *,
    rewind: int = 0,
) -> dict[str, int]:
    """Total cache bytes for `batch` sequences of `max_len` tokens: the compressed cache of this
    model (as `init_cache(..., rewind=rewind)` allocates it) and, for comparison, a plain
    multi-query cache of the same layers (one K and one V head of `head_dim` per token per
    layer)."""
    item = np.dtype(dtype).itemsize
    window = window_slots(config.sliding_window, rewind) * config.head_dim * item
    total = 0
    for layer_type in config.layer_types:
        total += window
        if layer_type == SLIDING:
            continue
        overlap = layer_type == CSA
        ratio = config.compress_rate_csa if overlap else config.compress_rate_hca
        widths = [config.head_dim] + ([config.index_head_dim] if overlap else [])
        for d in widths:
            # kv and gate rings, float32
            state = 2 * ring_slots(ratio, overlap, rewind) * (2 if overlap else 1) * d * 4
            total += (max_len // ratio) * d * item + state
    plain = len(config.layer_types) * max_len * 2 * config.head_dim * item
    return {"compressed": batch * total, "plain_mqa": batch * plain}
