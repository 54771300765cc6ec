"""The Lightning Indexer: picks, per query, which compressed entries a CSA layer attends to.

It keeps its own, narrower compressed keys (a `CSACompressor` at `index_head_dim`) and scores
query `t` against entry `j` as `I[t, j] = sum_h w[t, h] relu(q[t, h] . K[j])`, where `q` comes from
the attention's low-rank query (`qr`) and the head weights `w` from the block input. Entries a
query may not see yet (`j >= (t + 1) // ratio`) are excluded; the `index_topk` best remain, and
picks that still point at an unseeable entry (fewer visible entries than `index_topk`) become
the sentinel `-1`. The indexer affects the output only through this selection.
"""

from typing import ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
from jax.typing import DTypeLike
from jaxtyping import Array, Float, Int, PRNGKeyArray

from ..config import Config
from ..execution import Policy, map_chunks, policy_field, sequence_parts, wider_dtype
from ..quant import RELEASE, act_quant, bf16_round, index_round_trip
from ._cache import Chunk, CompressorState
from ._compressor import CSACompressor
from ._layers import Linear, einsum_f32
from ._rope import RoPE


# Queries scored per step of a long chunk (bounds the [queries, heads, keys] scores).
QUERIES_PER_STEP = 512


def visible_blocks(positions: Int[Array, "*batch"], ratio: int) -> Int[Array, "*batch"]:
    """How many compressed entries the query at each position may use: those whose block has
    ended at or before it, `(t + 1) // ratio`."""
    return (positions + 1) // ratio


class LightningIndexer(eqx.Module):
    """Top-k selection of compressed entries for CSA layers."""

    # Up to this many queries per sequence (decoding) the keys are the score product's rows.
    FEW_QUERIES: ClassVar[int] = 8

    wq_b: Linear
    weights_proj: Linear
    compressor: CSACompressor
    n_heads: int = eqx.field(static=True)
    head_dim: int = eqx.field(static=True)
    topk: int = eqx.field(static=True)
    ratio: int = eqx.field(static=True)
    rope: RoPE = eqx.field(static=True)
    numerics: str = eqx.field(static=True)
    policy: Policy | None = policy_field()

    def __init__(self, config: Config, *, key: PRNGKeyArray, dtype: DTypeLike = jnp.float32):
        q_key, w_key, c_key = jr.split(key, 3)
        self.n_heads = config.index_n_heads
        self.head_dim = config.index_head_dim
        self.topk = config.index_topk
        self.ratio = config.compress_rate_csa
        self.wq_b = Linear(
            config.q_lora_rank,
            self.n_heads * self.head_dim,
            (None, "q_lora_in"),
            key=q_key,
            dtype=dtype,
        )
        self.weights_proj = Linear(
            config.hidden_size, self.n_heads, (None, "embed"), key=w_key, dtype=dtype
        )
        self.compressor = CSACompressor(
            config, self.head_dim, key=c_key, dtype=dtype, index_keys=True
        )
        self.rope = RoPE.for_layer(config, compressed=True)
        self.numerics = config.numerics
        self.policy = None

    def scores(
        self,
        x: Float[Array, "batch seq d_model"],
        qr: Float[Array, "batch seq q_lora"],
        keys: Float[Array, "batch blocks index_dim"],
        positions: Int[Array, "batch seq"],
    ) -> Float[Array, "batch seq blocks"]:
        """Float32 index scores of every query against every compressed key."""
        b, s, _ = x.shape
        q = self.wq_b(act_quant(qr, self.numerics))
        q = self.rope(q.reshape(b, s, self.n_heads, self.head_dim), positions)
        q = index_round_trip(q, self.numerics)
        scale = (self.head_dim * self.n_heads) ** -0.5
        if self.numerics == RELEASE:
            return self._release_scores(x, q, keys, scale)
        w = self.weights_proj(x, dtype=jnp.float32) * scale
        if s <= self.FEW_QUERIES:
            # A few queries (decoding): the keys as the rows of the product, read as stored,
            # in their own dtype (docs/design.md, "Indexer keys as rows").
            c = wider_dtype(q, keys)
            logits = jnp.einsum(
                "bnk,bshk->bnsh", keys.astype(c), q.astype(c), preferred_element_type=jnp.float32
            )
            return jnp.einsum("bnsh,bsh->bsn", jax.nn.relu(logits), w)
        # Many queries (a prefill chunk): the keys as the product's columns, faster from 16
        # queries on.
        logits = einsum_f32("bshk,bnk->bshn", q, keys)
        return jnp.einsum("bshn,bsh->bsn", jax.nn.relu(logits), w)

    def _release_scores(self, x, q, keys, scale):
        # As the official code computes them in bfloat16: each head's product, the head
        # weights (`weights_proj` output, then scaled), each weighted term and the head sum
        # rounded to bfloat16; every product and the sum accumulated in float32.
        w = bf16_round(bf16_round(self.weights_proj(x, dtype=jnp.float32)) * scale)
        if q.shape[1] <= self.FEW_QUERIES:  # the keys as the product's rows (see `scores`)
            c = wider_dtype(q, keys)
            logits = jnp.einsum(
                "bnk,bshk->bshn", keys.astype(c), q.astype(c), preferred_element_type=jnp.float32
            )
        else:
            logits = einsum_f32("bshk,bnk->bshn", q, keys)
        terms = bf16_round(jax.nn.relu(bf16_round(logits)) * w[..., None])
        return bf16_round(jnp.sum(terms, axis=2))

    def select(
        self,
        x: Float[Array, "batch seq d_model"],
        qr: Float[Array, "batch seq q_lora"],
        keys: Float[Array, "batch blocks index_dim"],
        positions: Int[Array, "batch seq"],
    ) -> Int[Array, "batch seq topk"]:
        """The `min(index_topk, blocks)` best visible keys per query, `-1` for picks the query
        may not see (order unspecified)."""
        if keys.shape[1] == 0:
            return jnp.zeros((*positions.shape, 0), jnp.int32)

        def chunk(x, qr, positions):
            scores = self.scores(x, qr, keys, positions)
            visible = visible_blocks(positions, self.ratio)[..., None]
            entry = jnp.broadcast_to(jnp.arange(keys.shape[1], dtype=jnp.int32), scores.shape)
            scores = jnp.where(entry < visible, scores, -jnp.inf)
            _, picked = jax.lax.top_k(scores, min(self.topk, keys.shape[1]))
            return jnp.where(picked < visible, picked, -1).astype(jnp.int32)

        # In chunks of queries: the scores before the head sum are [queries, heads, keys]. Each
        # device takes its own queries where the sequence is split over devices.
        parts = sequence_parts(positions.shape[1], self.policy)
        return map_chunks(chunk, (x, qr, positions), QUERIES_PER_STEP, parts)

    def __call__(
        self, x: Float[Array, "batch seq d_model"], qr: Float[Array, "batch seq q_lora"]
    ) -> Int[Array, "batch seq topk"]:
        """**Arguments:**

        - `x`: the normed block input at positions `0 .. seq-1`.
        - `qr`: the attention's normed low-rank query `[batch, seq, q_lora_rank]`.

        **Returns:** int32 indices of the selected entries, `min(index_topk, seq // ratio)` per
        query, with `-1` for picks the query may not see. Their order is unspecified.
        """
        b, s, _ = x.shape
        positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
        return self.select(x, qr, self.compressor(x), positions)

    @jax.named_scope("indexer")
    def step(
        self,
        x: Float[Array, "batch chunk d_model"],
        qr: Float[Array, "batch chunk q_lora"],
        chunk: Chunk,
        state: CompressorState,
    ) -> tuple[Int[Array, "batch chunk topk"], CompressorState]:
        """Update the index keys with the chunk (see `AbstractCompressor.step`), then select for
        each of its queries. **Returns:** `(picks, state)`."""
        state = self.compressor.step(x, chunk, state)
        positions = chunk.positions(x.shape[1])
        return self.select(x, qr, state.layer_entries, positions), state

    def empty_state(
        self, batch: int, max_len: int, dtype: DTypeLike, rewind: int = 0
    ) -> CompressorState:
        return self.compressor.empty_state(batch, max_len, dtype, rewind)
