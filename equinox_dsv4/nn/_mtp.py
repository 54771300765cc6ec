"""The multi-token-prediction (MTP) block, for training (a full forward from position 0) and for
drafting (a cached decode at each sequence's position, as the official block does with
`start_pos`).

Depth `j` (from 1) sees, at position `t`, the streams depth `j - 1` left at `t` (depth 0: the main
model's final streams) and token `t + j`, and predicts token `t + j + 1`. Its attention is a
sliding window over its own keys, so its cache is one `LayerCache` (ring only), kept as a
`KVCache` of a one-layer stack: the same sharding, positions and `rewind` as the main cache.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
from jax.typing import DTypeLike
from jaxtyping import Array, Float, Int, PRNGKeyArray

from ..config import MOE, SLIDING, Config
from ..quant import act_quant
from ._block import Block
from ._cache import Chunk, KVCache, LayerCache
from ._hyper import HyperHead
from ._layers import Embedding, Linear, RMSNorm
from ._moe import RouterStats


class MTPBlock(eqx.Module):
    """One multi-token-prediction block (DeepSeek-V3 style, as in DeepSeek-V4's release).

    From the main model's final streams `X` and the *next* tokens `ids'` (so position `t` predicts
    token `t + 2`): `X' = e_proj(enorm(embed(ids')))` broadcast over streams `+ h_proj(hnorm(X))`,
    then a sliding-only, learned-routing decoder block, then its own stream collapse and norm,
    then the shared head. The embedding and head are the main model's. A further depth takes
    this block's output streams in place of `X` and the tokens one step further ahead.
    """

    block: Block
    e_proj: Linear
    h_proj: Linear
    enorm: RMSNorm
    hnorm: RMSNorm
    norm: RMSNorm
    hc_head: HyperHead

    def __init__(self, config: Config, *, key: PRNGKeyArray, dtype: DTypeLike = jnp.float32):
        b_key, e_key, h_key, hc_key = jr.split(key, 4)
        d, eps = config.hidden_size, config.rms_norm_eps
        self.block = Block(config, SLIDING, MOE, key=b_key, dtype=dtype)
        self.e_proj = Linear(d, d, ("embed_out", "embed"), key=e_key, dtype=dtype)
        self.h_proj = Linear(d, d, ("embed_out", "embed"), key=h_key, dtype=dtype)
        self.enorm = RMSNorm(d, eps)
        self.hnorm = RMSNorm(d, eps)
        self.norm = RMSNorm(d, eps)
        self.hc_head = HyperHead(config, key=hc_key)

    def __call__(
        self,
        streams: Float[Array, "batch seq streams d_model"],
        next_ids: Int[Array, "batch seq"],
        embed: Embedding,
    ) -> tuple[Float[Array, "batch seq d_model"], Float[Array, "batch seq streams d_model"]]:
        """**Arguments:**

        - `streams`: the main model's final streams (before its stream collapse), or the
          previous depth's output streams.
        - `next_ids`: the tokens one step ahead of the ones that produced `streams`.
        - `embed`: the main model's embedding.

        **Returns:** `(h, streams')`: the normed hidden state for the head and this block's
        output streams (the input of a further MTP depth).
        """
        h, x, _ = self.with_stats(streams, next_ids, embed)
        return h, x

    def with_stats(
        self,
        streams: Float[Array, "batch seq streams d_model"],
        next_ids: Int[Array, "batch seq"],
        embed: Embedding,
    ) -> tuple[
        Float[Array, "batch seq d_model"], Float[Array, "batch seq streams d_model"], RouterStats
    ]:
        """As `__call__`, plus the block's `RouterStats`."""
        x, stats = self.block.with_stats(self._input(streams, next_ids, embed), next_ids)
        return self.norm(self.hc_head(x)), x, stats

    @jax.named_scope("mtp")
    def step(
        self,
        streams: Float[Array, "batch chunk streams d_model"],
        next_ids: Int[Array, "batch chunk"],
        chunk: Chunk,
        cache: LayerCache,
        embed: Embedding,
    ) -> tuple[
        Float[Array, "batch chunk d_model"], Float[Array, "batch chunk streams d_model"], LayerCache
    ]:
        """The block on a chunk of positions appended to its cache (see `Block.step`).
        **Returns:** `(h, streams', cache)` as `__call__`, with the updated cache."""
        x = self._input(streams, next_ids, embed)
        x, cache, _ = self.block.step(x, next_ids, chunk, cache)
        return self.norm(self.hc_head(x)), x, cache

    def decode(
        self,
        streams: Float[Array, "batch chunk streams d_model"],
        next_ids: Int[Array, "batch chunk"],
        cache: KVCache,
        count: Int[Array, " batch"],
        embed: Embedding,
    ) -> tuple[
        Float[Array, "batch chunk d_model"], Float[Array, "batch chunk streams d_model"], KVCache
    ]:
        """`step` on this block's `KVCache` (`init_cache`) at the cache's positions, the first
        `count[b]` positions of row `b` real; the positions advance by `count`."""
        layer = jax.tree.map(lambda a: a[0], cache.layers[0][0])
        h, x, layer = self.step(streams, next_ids, Chunk(cache.positions, count), layer, embed)
        layers = ((jax.tree.map(lambda a: a[None], layer),),)
        return h, x, KVCache(layers, cache.positions + count, cache.max_len, cache.max_rewind)

    def init_cache(self, batch: int, max_len: int, dtype: DTypeLike, rewind: int = 0) -> KVCache:
        """An empty cache of this block (a one-layer stack; `rewind`: see `KVCache.rewind`)."""
        layer = self.block.attn.init_cache(batch, max_len, dtype, rewind)
        layer = jax.tree.map(lambda a: a[None], layer)
        return KVCache(((layer,),), jnp.zeros((batch,), jnp.int32), max_len, rewind)

    def _input(self, streams, next_ids, embed):
        n = self.block.attn.numerics
        e = self.e_proj(act_quant(self.enorm(embed(next_ids)), n))
        return e[:, :, None, :] + self.h_proj(act_quant(self.hnorm(streams), n))


def check_mtp_depth(n_blocks: int, depth: int) -> None:
    if not 0 <= depth < n_blocks:
        if n_blocks == 0:
            raise ValueError("this model has no MTP block (num_nextn_predict_layers == 0)")
        raise ValueError(f"depth must be in 0 .. {n_blocks - 1}, got {depth}")
