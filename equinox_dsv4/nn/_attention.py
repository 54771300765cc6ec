"""Shared-KV multi-query attention with sinks, a sliding window and compressed entries.

Per layer: a low-rank query (`wq_a` -> `q_norm` -> `wq_b`, then an unweighted per-head RMS norm),
one K=V head (`wkv` -> `kv_norm`) shared by every query head, RoPE on the trailing
`qk_rope_head_dim` channels of both. Query `t` sees the raw keys of positions
`t - window + 1 .. t` and, in CSA/HCA layers, compressed entries (all visible ones for HCA, the
indexer's picks for CSA). A learned per-head sink adds `exp(sink)` to the softmax denominator.
Because V = K carries the rotation, the output's rope channels are rotated back by `-t`; heads
are then projected in `o_groups` groups (`wo_a`, block-diagonal) and mixed (`wo_b`).

Letters: b batch, s/q queries, n query blocks of `window` tokens, t keys of a block, m compressed
entries, h heads, k head dim, g groups, o `o_lora_rank`.
"""

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
from jax.typing import DTypeLike
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray

from ..config import CSA, HCA, SLIDING, Config
from ..execution import (
    Q_LORA_AXES,
    Policy,
    attend_blocks,
    constrain_batch,
    constrain_features,
    grouped_linear,
    map_chunks,
    policy_field,
    resolve,
    sequence_parts,
    set_rows,
)
from ..quant import act_quant, kv_round_trip
from ._cache import Chunk, LayerCache, window_slots
from ._compressor import CSACompressor, HCACompressor
from ._indexer import LightningIndexer, visible_blocks
from ._layers import Linear, RMSNorm, einsum_f32, f32, lead, rms_normalize
from ._rope import RoPE


# Chunks of at most this many queries gather the indexer's picks; longer ones (prefill) use a
# dense mask over all entries, which is cheaper per query when the chunk is long.
GATHER_MAX_QUERIES = 16
# Query blocks (of `window` queries) attended per step of a long chunk: bounds the logits held
# at once to `BLOCKS_PER_STEP * window` queries.
BLOCKS_PER_STEP = 4


def _rows(x: Array, index: Array) -> Array:
    # x [b, n, ...] gathered at index [b, *k] along axis 1.
    flat = index.reshape(index.shape[0], -1)
    out = jnp.take_along_axis(x, flat.reshape(*flat.shape, *(1,) * (x.ndim - 2)), axis=1)
    return out.reshape(*index.shape, *x.shape[2:])


def attend(
    q: Float[Array, "batch seq heads head_dim"],
    kv: Float[Array, "batch seq head_dim"],
    sinks: Float[Array, " heads"],
    window: int,
    prefix: Float[Array, "batch window head_dim"] | None = None,
    prefix_valid: Bool[Array, "batch window"] | None = None,
    compressed: Float[Array, "batch entries head_dim"] | None = None,
    compressed_mask: Bool[Array, "batch seq entries"] | None = None,
    compressed_picks: Int[Array, "batch seq topk"] | None = None,
    picked: Float[Array, "batch seq topk head_dim"] | None = None,
    parts: int = 1,
    policy: Policy | None = None,
) -> Float[Array, "batch seq heads head_dim"]:
    """Softmax attention of a chunk of queries over their sliding window, plus compressed
    entries, plus a per-head sink.

    Query `i` of the chunk is at the position after `prefix` (the `window` keys before the
    chunk, oldest first; `prefix_valid` marks real ones) and sees the keys of the `window`
    positions ending at itself: from `prefix` and from `kv` (the chunk's own keys). Compressed
    entries are selected either densely (`compressed_mask`) or by index (`compressed_picks`,
    `-1` for none), which gathers only the picked entries, or takes them gathered already
    (`picked`: the entries at `max(compressed_picks, 0)`; `compressed` is then not needed).

    Long chunks are processed in blocks of `window` queries, each against `2 * window` keys,
    so the cost is linear in the chunk length. `parts`: the chunk's sequence is split over
    devices in this many contiguous parts (`sequence_parts`), each attended on its own device
    when it holds whole blocks. Logits and softmax are float32; probabilities
    are cast to the value dtype for the value matmul, which accumulates in float32. `policy`
    chooses the form of the blocks' attention (`execution.attend_blocks`).
    """
    b, t, h, k = q.shape
    w = window
    if prefix is None:
        prefix = jnp.zeros((b, w, k), kv.dtype)
        prefix_valid = jnp.zeros((b, w), jnp.bool_)
    assert prefix_valid is not None
    bq = w if t > w else t  # queries per block
    nb = -(-t // bq)
    qb = jnp.pad(q, ((0, 0), (0, nb * bq - t), (0, 0), (0, 0))).reshape(b, nb, bq, h, k)
    ext = jnp.concatenate([prefix, kv], axis=1)  # key j is at the chunk's position j - w
    valid = jnp.concatenate([prefix_valid, jnp.ones((b, t), jnp.bool_)], axis=1)
    if bq == w:
        # Block n's keys: ext[n w : n w + 2 w].
        ext = jnp.pad(ext, ((0, 0), (0, (nb + 1) * w - ext.shape[1]), (0, 0))).reshape(
            b, nb + 1, w, k
        )
        keys = jnp.concatenate([ext[:, :-1], ext[:, 1:]], axis=2)
        valid = jnp.pad(valid, ((0, 0), (0, (nb + 1) * w - valid.shape[1]))).reshape(b, nb + 1, w)
        valid = jnp.concatenate([valid[:, :-1], valid[:, 1:]], axis=2)
    else:
        keys, valid = ext[:, None], valid[:, None]

    def blocked(x):  # [b, t, ...] -> [b, nb, bq, ...]
        x = jnp.pad(x, ((0, 0), (0, nb * bq - t)) + ((0, 0),) * (x.ndim - 2))
        return x.reshape(b, nb, bq, *x.shape[2:])

    # Per block: the compressed keys it may attend to and which are visible.
    if compressed_picks is not None:
        use_compressed = compressed_picks.shape[-1] > 0  # min(index_topk, entries) picks
    else:
        use_compressed = compressed is not None and compressed.shape[1] > 0
    parts = parts if t % (parts * bq) == 0 else 1  # whole blocks on each device
    if use_compressed and compressed_picks is not None:
        if picked is None:
            assert compressed is not None
            picked = _rows(compressed, jnp.maximum(compressed_picks, 0))
        body = functools.partial(_blocks, compressed=None, sinks=sinks)
        inputs = (qb, keys, valid, blocked(compressed_picks >= 0), blocked(picked))
        out = map_chunks(body, inputs, BLOCKS_PER_STEP, parts)
    else:
        if use_compressed:
            assert compressed_mask is not None
            c_valid = blocked(compressed_mask)
        else:
            compressed, c_valid = None, jnp.zeros((b, nb, bq, 0), jnp.bool_)
        inputs = (qb, keys, valid, c_valid, compressed, sinks)
        out = attend_blocks(_blocks, *inputs, BLOCKS_PER_STEP, parts, policy)
    return out.reshape(b, nb * bq, h, k)[:, :t].astype(q.dtype)


def _blocks(qb, keys, valid, c_valid, *c_keys, compressed, sinks):
    # The plain attention of query blocks `[b, n, q, ...]` (`attend`): query i of a block
    # sees key j of its keys for i < j <= i + keys - queries where `valid`, and the compressed
    # entries `c_valid` marks (`compressed` for all queries alike, or `c_keys`: per query).
    bq, width, k = qb.shape[2], keys.shape[2], qb.shape[-1]
    i = np.arange(bq)[:, None]
    j = np.arange(width)[None, :]
    # Logits are laid out query-major, [b, n, q, h, t]: the heads of a query are contiguous,
    # as a product emits them without a transpose, and the sink and denominator need none
    # either (docs/design.md, "Attention logits query-major").
    in_window = jnp.asarray((i < j) & (j <= i + width - bq))[None, None, :, None]
    scale = k**-0.5
    sink = lead(f32(sinks)[:, None], 5)  # [1, 1, 1, h, 1]
    use_compressed = bool(c_keys) or compressed is not None
    logits = einsum_f32("bnqhk,bntk->bnqht", qb, keys)
    logits = jnp.where(in_window & valid[:, :, None, None, :], logits * scale, -jnp.inf)
    top = jnp.maximum(jnp.max(logits, axis=-1, keepdims=True), sink)
    if c_keys:  # picked entries, one set per query
        c_logits = einsum_f32("bnqhk,bnqjk->bnqhj", qb, c_keys[0])
    elif use_compressed:
        c_logits = einsum_f32("bnqhk,bmk->bnqhm", qb, compressed)
    if use_compressed:
        c_logits = jnp.where(c_valid[:, :, :, None], c_logits * scale, -jnp.inf)
        top = jnp.maximum(top, jnp.max(c_logits, axis=-1, keepdims=True))
    probs = jnp.exp(logits - top)
    denom = jnp.sum(probs, axis=-1, keepdims=True) + jnp.exp(sink - top)
    out = einsum_f32("bnqht,bntk->bnqhk", probs.astype(keys.dtype), keys)
    if use_compressed:
        c_probs = jnp.exp(c_logits - top)
        denom = denom + jnp.sum(c_probs, axis=-1, keepdims=True)
        c_probs = c_probs.astype(keys.dtype)
        if c_keys:
            c_out = einsum_f32("bnqhj,bnqjk->bnqhk", c_probs, c_keys[0])
        else:
            c_out = einsum_f32("bnqhm,bmk->bnqhk", c_probs, compressed)
        out = out + c_out
    return out / denom


class Attention(eqx.Module):
    """One attention sub-layer: sliding-only, CSA (with a Lightning Indexer) or HCA."""

    wq_a: Linear
    q_norm: RMSNorm
    wq_b: Linear
    wkv: Linear
    kv_norm: RMSNorm
    wo_a: Linear
    wo_b: Linear
    attn_sink: Float[Array, " heads"]
    compressor: HCACompressor | CSACompressor | None
    indexer: LightningIndexer | None
    layer_type: str = eqx.field(static=True)
    n_heads: int = eqx.field(static=True)
    head_dim: int = eqx.field(static=True)
    window: int = eqx.field(static=True)
    o_groups: int = eqx.field(static=True)
    eps: float = eqx.field(static=True)
    rope: RoPE = eqx.field(static=True)
    rope_dim: int = eqx.field(static=True)
    numerics: str = eqx.field(static=True)
    policy: Policy | None = policy_field()

    def __init__(
        self,
        config: Config,
        layer_type: str,
        *,
        key: PRNGKeyArray,
        dtype: DTypeLike = jnp.float32,
    ):
        """**Arguments:**

        - `config`: the model config.
        - `layer_type`: `"sliding_attention"`, `"compressed_sparse_attention"` or
          `"heavily_compressed_attention"`.
        - `key`: PRNG key. `dtype`: dtype of the projection weights (norm weights and sinks stay
          float32).
        """
        keys = jr.split(key, 7)
        d, h, k = config.hidden_size, config.num_attention_heads, config.head_dim
        g, o = config.o_groups, config.o_lora_rank
        self.wq_a = Linear(d, config.q_lora_rank, ("q_lora", "embed"), key=keys[0], dtype=dtype)
        self.q_norm = RMSNorm(config.q_lora_rank, config.rms_norm_eps)
        self.wq_b = Linear(
            config.q_lora_rank, h * k, ("heads_x_dim", "q_lora_in"), key=keys[1], dtype=dtype
        )
        self.wkv = Linear(d, k, ("head_dim", "embed"), key=keys[2], dtype=dtype)
        self.kv_norm = RMSNorm(k, config.rms_norm_eps)
        self.wo_a = Linear(
            h * k // g, g * o, ("groups_x_rank", "group_in"), key=keys[3], dtype=dtype
        )
        self.wo_b = Linear(g * o, d, ("embed", "groups_x_rank"), key=keys[4], dtype=dtype)
        self.attn_sink = jnp.zeros((h,), jnp.float32)
        if layer_type == SLIDING:
            self.compressor = None
        elif layer_type == CSA:
            self.compressor = CSACompressor(config, k, key=keys[5], dtype=dtype)
        elif layer_type == HCA:
            self.compressor = HCACompressor(config, k, key=keys[5], dtype=dtype)
        else:
            raise ValueError(f"unknown layer_type {layer_type!r}")
        self.indexer = (
            LightningIndexer(config, key=keys[6], dtype=dtype) if layer_type == CSA else None
        )
        self.layer_type = layer_type
        self.n_heads = h
        self.head_dim = k
        self.window = config.sliding_window
        self.o_groups = g
        self.eps = config.rms_norm_eps
        self.rope = RoPE.for_layer(config, compressed=layer_type != SLIDING)
        self.rope_dim = config.qk_rope_head_dim
        self.numerics = config.numerics
        self.policy = None

    def param_axes(self, name: str) -> tuple[str | None, ...]:
        assert name == "attn_sink"
        return ("heads",)

    def init_cache(self, batch: int, max_len: int, dtype: DTypeLike, rewind: int = 0) -> LayerCache:
        """An empty cache for `batch` sequences of up to `max_len` tokens, from which up to
        `rewind` tokens of one call can be taken back (see `KVCache.rewind`)."""
        ring = jnp.zeros((batch, window_slots(self.window, rewind), self.head_dim), dtype)
        compressor = indexer = None
        if self.compressor is not None:
            compressor = self.compressor.empty_state(batch, max_len, dtype, rewind)
        if self.indexer is not None:
            indexer = self.indexer.empty_state(batch, max_len, dtype, rewind)
        return LayerCache(ring, compressor, indexer)

    def __call__(self, x: Float[Array, "batch seq d_model"]) -> Float[Array, "batch seq d_model"]:
        """**Arguments:** `x`, the normed block input `[batch, seq, d_model]` at positions
        `0 .. seq-1` (a full causal forward).

        **Returns:** the attention output `[batch, seq, d_model]` in `x.dtype`.
        """
        b, s, _ = x.shape
        return self.step(x, Chunk.whole(b, s), self.init_cache(b, s, x.dtype))[0]

    @jax.named_scope("attention")
    def step(
        self, x: Float[Array, "batch chunk d_model"], chunk: Chunk, cache: LayerCache
    ) -> tuple[Float[Array, "batch chunk d_model"], LayerCache]:
        """Attention for a chunk of tokens appended to `cache`.

        **Arguments:**

        - `x`: the normed block input of the chunk.
        - `chunk`: the chunk's positions and real tokens (`Chunk`).
        - `cache`: this layer's state.

        **Returns:** `(output, cache)`: the output `[batch, chunk, d_model]` in `x.dtype` and the
        state with the chunk's real tokens appended.
        """
        b, t, _ = x.shape
        w = self.window
        positions = chunk.positions(t)
        # In the block's layout: else the cache's, split along the batch, could reach the
        # projections' inputs (`Policy.stationary_tokens`).
        x = constrain_batch(x, self.policy)
        q, qr, kv = self.project(x, positions)

        # The ring holds position p in slot p % slots: the window before the chunk, oldest
        # first.
        slots = cache.ring.shape[1]
        before = chunk.start[:, None] - w + jnp.arange(w, dtype=jnp.int32)[None]
        prefix = _rows(cache.ring, before % slots)
        ring = set_rows(cache.ring, chunk.ring_index(t, slots), kv, self.policy)

        compressor_state = indexer_state = None
        compressed = mask = picks = picked = None
        if self.compressor is not None:
            assert cache.compressor is not None
            compressor_state = self.compressor.step(x, chunk, cache.compressor)
            if self.indexer is not None:
                assert cache.indexer is not None
                picks, indexer_state = self.indexer.step(x, qr, chunk, cache.indexer)
                picks_in_place = resolve(self.policy).picks_in_place
                entries = compressor_state.entries.shape[-2]
                if t > GATHER_MAX_QUERIES:
                    compressed = compressor_state.layer_entries
                    mask, picks = selection_mask(picks, compressed.shape[1]), None
                elif picks.shape[-1] and picks.shape[-1] * picks_in_place <= entries:
                    # From the cache's stack in place: the layer's entries sliced out first
                    # can be a copy of all of them, per step (docs/design.md, "Picked entries
                    # gathered for short chunks").
                    picked = compressor_state.layer_rows(jnp.maximum(picks, 0))
                else:
                    compressed = compressor_state.layer_entries
            else:
                compressed = compressor_state.layer_entries
                entry = jnp.arange(compressed.shape[1], dtype=jnp.int32)
                visible = visible_blocks(positions, self.compressor.ratio)
                mask = entry[None, None, :] < visible[..., None]
        parts = sequence_parts(t, self.policy)
        o = attend(
            q,
            kv,
            self.attn_sink,
            w,
            prefix,
            before >= 0,
            compressed,
            mask,
            picks,
            picked,
            parts,
            self.policy,
        )
        out = self.project_out(self.rope(o, positions, inverse=True))
        return out, LayerCache(ring, compressor_state, indexer_state)

    def project(
        self, x: Float[Array, "batch seq d_model"], positions: Int[Array, "batch seq"]
    ) -> tuple[
        Float[Array, "batch seq heads head_dim"],
        Float[Array, "batch seq q_lora"],
        Float[Array, "batch seq head_dim"],
    ]:
        """The queries (normed per head, rotated), the low-rank query before `wq_b` (the
        indexer reads it) and the K=V entries (rotated; FP8 round trip of their non-RoPE dims
        under release numerics) of normed inputs `x` at `positions`."""
        b, t, _ = x.shape
        n = self.numerics
        xq = act_quant(x, n)  # once: wq_a and wkv read the same FP8 activations
        # A decode step's low-rank queries split as `wq_b`'s input is: else each device
        # gathers its heads' share of `wq_b` and of the indexer's (`Policy.stationary_tokens`).
        qr = constrain_features(self.q_norm(self.wq_a(xq)), b * t, self.policy, Q_LORA_AXES)
        q = self.wq_b(act_quant(qr, n)).reshape(b, t, self.n_heads, self.head_dim)
        q = self.rope(rms_normalize(q, self.eps), positions)
        kv = self.rope(self.kv_norm(self.wkv(xq)), positions)
        return q, qr, kv_round_trip(kv, self.rope_dim, n)

    def project_out(
        self, o: Float[Array, "batch seq heads head_dim"]
    ) -> Float[Array, "batch seq d_model"]:
        """Grouped low-rank output projection: contiguous head groups through the block-diagonal
        `wo_a`, then `wo_b`."""
        b, s = o.shape[:2]
        z = grouped_linear(o.reshape(b, s, self.o_groups, -1), self.wo_a.weight, self.policy)
        return self.wo_b(act_quant(z.reshape(b, s, -1), self.numerics))


def selection_mask(
    picked: Int[Array, "batch seq topk"], entries: int
) -> Bool[Array, "batch seq entries"]:
    """Dense boolean mask of the indexer's picks; the sentinel `-1` selects nothing."""
    b, s, k = picked.shape
    target = jnp.where(picked < 0, entries, picked)
    rows = jnp.broadcast_to(jnp.arange(b)[:, None, None], (b, s, k))
    cols = jnp.broadcast_to(jnp.arange(s)[None, :, None], (b, s, k))
    mask = jnp.zeros((b, s, entries + 1), jnp.bool_).at[rows, cols, target].set(True)
    return mask[..., :entries]
