"""The DSpark drafter of V4-Flash-0731 and the V4-*-DSpark releases: a block of drafts from the
trunk's context in one pass of a few sliding-window stages, corrected token by token by a
first-order Markov head, with a confidence per draft.

Context: during the trunk's forward the residual streams after each layer of
`dspark_target_layer_ids` are averaged over the streams; the averages, concatenated, go through
`main_proj` and `main_norm` into `main_x`, one row per trunk position. Each stage keeps a ring of
`sliding_window` context rows, row `p` being `kv_norm(wkv(main_x[p]))` rotated to position `p`
(the trunk's K=V form, with its FP8 round trip under release numerics). The context reaches
the drafter only through these rings.

Drafting at context length `n` (rows `0 .. n-1` written; the anchor, the token after them,
at position `n`): slots `[anchor, noise, ..., noise]` at positions `n .. n + B - 1`, embedded by
the trunk's table and copied into the streams, run through every stage (stage `s`: a V4
decoder block whose attention lets every slot see the ring's rows and all `B` slots, with its
per-head sink); the last stage's stream collapse, norm and the trunk's head give base logits.
Slot `i` predicts the token at position `n + i + 1`. Then, serially, `logits[i] += W2 W1[prev]`
(`prev`: the anchor for slot 0, the previous draft after it) and draft `i` is drawn from
`logits[i]`; the confidence of slot `i` is `sigmoid(proj([h_i, W1[prev]]))` with `h_i` the
collapsed streams before the norm: the chance that draft `i` survives verification given that
the drafts before it did.

Letters: b batch, q block slots, t keys (ring rows, then slots), h heads, k head dim.
"""

from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
from jax.typing import DTypeLike
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray

from ..config import MOE, SLIDING, Config
from ..execution import Policy, constrain_batch, policy_field, set_rows
from ..quant import act_quant
from ._attention import Attention, _rows
from ._block import Block
from ._cache import Chunk, KVCache, LayerCache, window_slots
from ._hyper import HyperHead
from ._layers import Embedding, Linear, RMSNorm, einsum_f32, f32, lead


class DraftBlock(eqx.Module):
    """One block of drafts per sequence: the tokens, the Markov-corrected logits they were
    drawn from (float32) and each draft's confidence (float32, in (0, 1))."""

    tokens: Int[Array, "batch block"]
    logits: Float[Array, "batch block vocab"]
    confidence: Float[Array, "batch block"]


class DSpark(eqx.Module):
    """The drafter (see the module docstring). Its embedding and head are the trunk's, passed
    to `draft`; its stages' rings live in a `KVCache` of their own (`init_cache`)."""

    main_proj: Linear
    main_norm: RMSNorm
    stages: tuple[Block, ...]
    norm: RMSNorm
    hc_head: HyperHead
    markov_w1: Embedding
    markov_w2: Linear
    confidence: Linear
    targets: tuple[int, ...] = eqx.field(static=True)
    block_size: int = eqx.field(static=True)
    noise_token: int = eqx.field(static=True)
    window: int = eqx.field(static=True)
    policy: Policy | None = policy_field()

    def __init__(self, config: Config, *, key: PRNGKeyArray, dtype: DTypeLike = jnp.float32):
        """**Arguments:** `config` (its `dspark_*` fields set), the PRNG `key`, and the `dtype`
        of the linear, expert and embedding weights (norms, mHC parameters, sinks and the
        confidence projection stay float32)."""
        if not config.dspark:
            raise ValueError("config has no DSpark drafter (set its dspark_* fields)")
        assert config.dspark_target_layer_ids is not None
        assert config.dspark_markov_rank is not None and config.dspark_block_size is not None
        assert config.dspark_noise_token_id is not None
        d, rank, n_taps = (
            config.hidden_size,
            config.dspark_markov_rank,
            len(config.dspark_target_layer_ids),
        )
        keys = jr.split(key, 5 + config.dspark_stages)
        self.main_proj = Linear(d * n_taps, d, ("embed_out", "embed"), key=keys[0], dtype=dtype)
        self.main_norm = RMSNorm(d, config.rms_norm_eps)
        self.stages = tuple(Block(config, SLIDING, MOE, key=k, dtype=dtype) for k in keys[5:])
        self.norm = RMSNorm(d, config.rms_norm_eps)
        self.hc_head = HyperHead(config, key=keys[1])
        self.markov_w1 = Embedding(config.vocab_size, rank, key=keys[2], dtype=dtype)
        self.markov_w2 = Linear(rank, config.vocab_size, ("vocab", None), key=keys[3], dtype=dtype)
        self.confidence = Linear(d + rank, 1, (None, None), key=keys[4], dtype=jnp.float32)
        self.targets = tuple(config.dspark_target_layer_ids)
        self.block_size = config.dspark_block_size
        self.noise_token = config.dspark_noise_token_id
        self.window = config.sliding_window
        self.policy = None

    # --- context

    def context(
        self, taps: Float[Array, "batch seq taps d_model"]
    ) -> Float[Array, "batch seq d_model"]:
        """`main_x` from the trunk's stream averages after the target layers (`taps[..., i, :]`
        after layer `targets[i]`)."""
        b, s, n, d = taps.shape
        x = act_quant(taps.reshape(b, s, n * d), self.stages[0].attn.numerics)
        return self.main_norm(self.main_proj(x))

    def ring_rows(
        self, main_x: Float[Array, "batch seq d_model"], positions: Int[Array, "batch seq"]
    ) -> tuple[Float[Array, "batch seq head_dim"], ...]:
        """Each stage's ring rows for context `main_x` at `positions`."""
        return tuple(_keys(stage.attn, main_x, positions) for stage in self.stages)

    def init_cache(self, batch: int, max_len: int, dtype: DTypeLike, rewind: int = 0) -> KVCache:
        """Empty rings, one per stage (stacked along a leading axis), for `batch` sequences of
        up to `max_len` positions, of which `rewind` may be taken back (`KVCache.rewind`)."""
        head_dim = self.stages[0].attn.head_dim
        slots = window_slots(self.window, rewind)
        layer = LayerCache(jnp.zeros((batch, slots, head_dim), dtype), None, None)
        # Stacked along the stages as a layer stack's caches are (not through the constructor,
        # whose annotations are one layer's).
        layer = jax.tree.map(lambda a: jnp.broadcast_to(a, (len(self.stages), *a.shape)), layer)
        return KVCache(((layer,),), jnp.zeros((batch,), jnp.int32), max_len, rewind)

    def extend(
        self,
        taps: Float[Array, "batch chunk taps d_model"],
        cache: KVCache,
        count: Int[Array, " batch"],
    ) -> KVCache:
        """Write the context rows of a chunk of trunk positions (row `b`'s first `count[b]`
        real, at `cache.positions[b] ...`) into every stage's ring; the positions advance by
        `count`."""
        t = taps.shape[1]
        chunk = Chunk(cache.positions, count)
        ring = cache.layers[0][0].ring
        index = chunk.ring_index(t, ring.shape[2])
        main_x = self.context(taps)
        rows = self.ring_rows(main_x, chunk.positions(t))
        ring = jnp.stack(
            [
                set_rows(ring[s], index, r.astype(ring.dtype), self.policy)
                for s, r in enumerate(rows)
            ]
        )
        layers = ((eqx.tree_at(lambda c: c.ring, cache.layers[0][0], ring),),)
        return KVCache(layers, cache.positions + count, cache.max_len, cache.max_rewind)

    # --- drafting

    def block_logits(
        self,
        anchor: Int[Array, " batch"],
        cache: KVCache,
        embed: Embedding,
        head: Linear,
    ) -> tuple[Float[Array, "batch block vocab"], Float[Array, "batch block d_model"]]:
        """The stages on one block after the context in `cache`: the base logits (float32,
        before the Markov correction) and the collapsed streams before the final norm."""
        b, q, w = anchor.shape[0], self.block_size, self.window
        n = cache.positions
        ids = jnp.concatenate(
            [anchor[:, None], jnp.full((b, q - 1), self.noise_token, anchor.dtype)], axis=1
        )
        positions = n[:, None] + jnp.arange(q, dtype=jnp.int32)[None]
        # The window of context rows before the block, oldest first.
        ring = cache.layers[0][0].ring
        before = n[:, None] - w + jnp.arange(w, dtype=jnp.int32)[None]
        at, valid = before % ring.shape[2], before >= 0
        e = embed(ids)
        x = jnp.broadcast_to(e[:, :, None, :], (b, q, self.hc_head.fn.shape[0], e.shape[-1]))
        for s, stage in enumerate(self.stages):
            x = constrain_batch(_stage(stage, x, ids, positions, _rows(ring[s], at), valid))
        h = self.hc_head(x)
        return head(self.norm(h), dtype=jnp.float32), h

    def draft(
        self,
        anchor: Int[Array, " batch"],
        cache: KVCache,
        embed: Embedding,
        head: Linear,
        choose: Callable[[Float[Array, "batch vocab"], int], Int[Array, " batch"]] | None = None,
    ) -> DraftBlock:
        """One block of drafts after the context in `cache`, `anchor` (the token at position
        `cache.positions`) first.

        **Arguments:**

        - `anchor`: the last committed token of each sequence, not yet in the context.
        - `cache`: the rings (`extend`); `embed`, `head`: the trunk's.
        - `choose`: `(logits, slot) -> tokens`, how a draft is drawn from its corrected
          logits (default: argmax).

        **Returns:** a `DraftBlock`.
        """
        base, h = self.block_logits(anchor, cache, embed, head)
        if choose is None:
            choose = _argmax
        prev, tokens, logits, conf = anchor, [], [], []
        for i in range(self.block_size):
            z, c = self.correct(base[:, i], h[:, i], prev)
            prev = choose(z, i)
            tokens.append(prev)
            logits.append(z)
            conf.append(jax.nn.sigmoid(c))
        return DraftBlock(
            jnp.stack(tokens, axis=1), jnp.stack(logits, axis=1), jnp.stack(conf, axis=1)
        )

    def correct(
        self,
        base: Float[Array, "*batch vocab"],
        h: Float[Array, "*batch d_model"],
        prev: Int[Array, "*batch"],
    ) -> tuple[Float[Array, "*batch vocab"], Float[Array, "*batch"]]:
        """A slot's Markov-corrected logits `base + W2 W1[prev]` and its confidence logit
        `proj([h, W1[prev]])` (float32), `prev` the token before the slot's."""
        e = self.markov_w1(prev)
        z = base + self.markov_w2(e, dtype=jnp.float32)
        c = self.confidence(jnp.concatenate([f32(h), f32(e)], axis=-1))[..., 0]
        return z, c

    # --- training

    def train_outputs(
        self,
        taps: Float[Array, "batch seq taps d_model"],
        ids: Int[Array, "batch seq"],
        anchors: Int[Array, "batch anchors"],
        embed: Embedding,
        head: Linear,
    ) -> tuple[Float[Array, "batch anchors block vocab"], Float[Array, "batch anchors block"]]:
        """The drafter on a block at each anchor of sequences seen whole by the trunk (`taps`
        of a forward over `ids` from position 0), as drafting there would run it: the block at
        anchor `a` after the context rows `0 .. a-1`, its first slot `ids[:, a]`. The Markov
        head is fed the true tokens (slot `j`'s `prev` is `ids[:, a + j]`).

        **Returns:** the corrected logits (slot `j` predicts the token at `a + j + 1`) and
        the confidence logits, float32."""
        b, t = ids.shape
        n, q, w = anchors.shape[1], self.block_size, self.window
        main_x = self.context(taps)
        rows = self.ring_rows(main_x, jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t)))
        context = anchors[..., None] - w + jnp.arange(w, dtype=jnp.int32)[None, None]  # [b, n, w]
        valid = (context >= 0).reshape(b * n, w)
        at = jnp.clip(context, 0, t - 1).reshape(b, n * w)
        positions = anchors[..., None] + jnp.arange(q, dtype=jnp.int32)[None, None]  # [b, n, q]
        first = jnp.take_along_axis(ids, anchors, axis=1)
        block = jnp.concatenate(
            [first[..., None], jnp.full((b, n, q - 1), self.noise_token, ids.dtype)], axis=-1
        ).reshape(b * n, q)
        e = embed(block)
        x = jnp.broadcast_to(e[:, :, None, :], (b * n, q, self.hc_head.fn.shape[0], e.shape[-1]))
        flat = positions.reshape(b * n, q)
        for s, stage in enumerate(self.stages):
            ctx = _rows(rows[s], at).reshape(b * n, w, -1)
            x = constrain_batch(_stage(stage, x, block, flat, ctx, valid))
        h = self.hc_head(x)
        base = head(self.norm(h), dtype=jnp.float32)
        prev = jnp.take_along_axis(ids, jnp.clip(positions, 0, t - 1).reshape(b, n * q), axis=1)
        z, c = self.correct(base, h, prev.reshape(b * n, q))
        return z.reshape(b, n, q, -1), c.reshape(b, n, q)


def _argmax(logits: Array, slot: int) -> Array:
    del slot
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)


def _keys(attn: Attention, x: Array, positions: Array) -> Array:
    # The layer's K=V rows of normed inputs `x` at `positions`, as `Attention.step` writes them.
    return attn.project(x, positions)[2]


def _stage(
    block: Block,
    x: Float[Array, "batch block streams d_model"],
    ids: Int[Array, "batch block"],
    positions: Int[Array, "batch block"],
    rows: Float[Array, "batch window head_dim"],
    valid: Bool[Array, "batch window"],
) -> Float[Array, "batch block streams d_model"]:
    # A decoder block whose attention is `_block_attention`; everything else as `Block.step`.
    u, post, comb = block.hc_attn(x)
    a = _block_attention(block.attn, block.attn_norm(u), positions, rows, valid)
    x = block.hc_attn.mix(a, x, post, comb)
    u, post, comb = block.hc_ffn(x)
    f, _ = block.ffn.with_stats(block.ffn_norm(u), ids)
    return block.hc_ffn.mix(f, x, post, comb)


def _block_attention(
    attn: Attention,
    x: Float[Array, "batch block d_model"],
    positions: Int[Array, "batch block"],
    rows: Float[Array, "batch window head_dim"],
    valid: Bool[Array, "batch window"],
) -> Float[Array, "batch block d_model"]:
    # Every slot sees the valid context rows and every slot's key (no causal mask inside the
    # block), plus the per-head sink; the block's keys are not written anywhere.
    b, q, _ = x.shape
    queries, _, own = attn.project(x, positions)
    keys = jnp.concatenate([rows.astype(own.dtype), own], axis=1)
    seen = jnp.concatenate([valid, jnp.ones((b, q), jnp.bool_)], axis=1)
    logits = einsum_f32("bqhk,btk->bqht", queries, keys) * attn.head_dim**-0.5
    logits = jnp.where(seen[:, None, None, :], logits, -jnp.inf)
    sink = lead(f32(attn.attn_sink)[:, None], 4)  # [1, 1, h, 1]
    top = jnp.maximum(jnp.max(logits, axis=-1, keepdims=True), sink)
    probs = jnp.exp(logits - top)
    denom = jnp.sum(probs, axis=-1, keepdims=True) + jnp.exp(sink - top)
    o = einsum_f32("bqht,btk->bqhk", probs.astype(keys.dtype), keys) / denom
    o = attn.rope(o.astype(x.dtype), positions, inverse=True)
    return attn.project_out(o)
