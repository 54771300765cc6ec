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

import equinox as eqx
import jax.numpy as jnp
import jax.random as jr
import numpy as np
from jax.typing import DTypeLike
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray

from ._compressor import CSACompressor, HCACompressor
from ._config import CSA, HCA, SLIDING, Config
from ._indexer import LightningIndexer, visible_blocks
from ._layers import Linear, RMSNorm, einsum_f32, f32, lead, rms_normalize
from ._rope import RoPE


def _window_mask(blocks: int, window: int) -> np.ndarray:
    # Query q of block n (position n*W + q) against key t of the (previous, current) block pair
    # (position (n-1)*W + t): causal, within the window, and not before position 0.
    n = np.arange(blocks)[:, None, None]
    q = np.arange(window)[None, :, None]
    t = np.arange(2 * window)[None, None, :]
    qpos, kpos = n * window + q, (n - 1) * window + t
    return (kpos <= qpos) & (qpos - kpos < window) & (kpos >= 0)


def attend(
    q: Float[Array, "batch seq heads head_dim"],
    kv: Float[Array, "batch seq head_dim"],
    sinks: Float[Array, " heads"],
    window: int,
    compressed: Float[Array, "batch entries head_dim"] | None = None,
    compressed_mask: Bool[Array, "batch seq entries"] | None = None,
) -> Float[Array, "batch seq heads head_dim"]:
    """Softmax attention of every query over its sliding window of `kv` (queries and keys at
    positions `0 .. seq-1`), plus the compressed entries `compressed_mask` allows, plus a sink.

    Queries are processed in blocks of `window`, each against its own and the previous block's
    keys, so the cost is linear in `seq`. Logits and softmax are float32; the probabilities are
    cast to the value dtype for the value matmul, which accumulates in float32.
    """
    b, s, h, k = q.shape
    w = window
    nb = -(-s // w)
    pad = ((0, 0), (0, nb * w - s))
    qb = jnp.pad(q, pad + ((0, 0), (0, 0))).reshape(b, nb, w, h, k)
    cur = jnp.pad(kv, pad + ((0, 0),)).reshape(b, nb, w, k)
    prev = jnp.pad(cur[:, :-1], ((0, 0), (1, 0), (0, 0), (0, 0)))
    keys = jnp.concatenate([prev, cur], axis=2)  # [b, n, 2w, k]
    scale = k**-0.5

    logits = einsum_f32("bnqhk,bntk->bnhqt", qb, keys)
    mask = jnp.asarray(_window_mask(nb, w))[None, :, None]
    logits = jnp.where(mask, logits * scale, -jnp.inf)
    sink = lead(f32(sinks)[:, None], 4)  # [1, 1, h, 1]
    top = jnp.maximum(jnp.max(logits, axis=-1), sink)
    use_compressed = compressed is not None and compressed.shape[1] > 0
    if use_compressed:
        assert compressed is not None and compressed_mask is not None
        c_logits = einsum_f32("bnqhk,bmk->bnhqm", qb, compressed)
        c_mask = jnp.pad(compressed_mask, pad + ((0, 0),)).reshape(b, nb, 1, w, -1)
        c_logits = jnp.where(c_mask, c_logits * scale, -jnp.inf)
        top = jnp.maximum(top, jnp.max(c_logits, axis=-1))
    probs = jnp.exp(logits - top[..., None])
    denom = jnp.sum(probs, axis=-1) + jnp.exp(sink - top)
    out = einsum_f32("bnhqt,bntk->bnqhk", probs.astype(kv.dtype), keys)
    if use_compressed:
        c_probs = jnp.exp(c_logits - top[..., None])
        denom = denom + jnp.sum(c_probs, axis=-1)
        out = out + einsum_f32("bnhqm,bmk->bnqhk", c_probs.astype(kv.dtype), compressed)
    out = out / jnp.transpose(denom, (0, 1, 3, 2))[..., None]
    return out.reshape(b, nb * w, h, k)[:, :s].astype(q.dtype)


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
            config.q_lora_rank, h * k, ("heads_x_dim", "q_lora"), key=keys[1], dtype=dtype
        )
        self.wkv = Linear(d, k, ("head_dim", "embed"), key=keys[2], dtype=dtype)
        self.kv_norm = RMSNorm(k, config.rms_norm_eps)
        self.wo_a = Linear(h * k // g, g * o, ("groups_x_rank", None), key=keys[3], dtype=dtype)
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

    def param_axes(self, name: str) -> tuple[str | None, ...]:
        assert name == "attn_sink"
        return ("heads",)

    def __call__(self, x: Float[Array, "batch seq d_model"]) -> Float[Array, "batch seq d_model"]:
        """**Arguments:** `x`, the normed block input `[batch, seq, d_model]` at positions
        `0 .. seq-1` (a full causal forward).

        **Returns:** the attention output `[batch, seq, d_model]` in `x.dtype`.
        """
        b, s, _ = x.shape
        positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
        qr = self.q_norm(self.wq_a(x))
        q = self.wq_b(qr).reshape(b, s, self.n_heads, self.head_dim)
        q = self.rope(rms_normalize(q, self.eps), positions)
        kv = self.rope(self.kv_norm(self.wkv(x)), positions)

        compressed = mask = None
        if self.compressor is not None:
            compressed = self.compressor(x)
            if self.indexer is not None:
                mask = selection_mask(self.indexer(x, qr), compressed.shape[1])
            else:
                entry = jnp.arange(compressed.shape[1], dtype=jnp.int32)
                visible = visible_blocks(positions, self.compressor.ratio)
                mask = entry[None, None, :] < visible[..., None]
        o = attend(q, kv, self.attn_sink, self.window, compressed, mask)
        return self.project_out(self.rope(o, positions, inverse=True))

    def project_out(
        self, o: Float[Array, "batch seq heads head_dim"]
    ) -> Float[Array, "batch seq d_model"]:
        """Grouped low-rank output projection: contiguous head groups through the block-diagonal
        `wo_a`, then `wo_b`."""
        b, s = o.shape[:2]
        g = self.o_groups
        grouped = o.reshape(b, s, g, -1)
        wo_a = self.wo_a.weight.reshape(g, -1, grouped.shape[-1])
        z = jnp.einsum("bsgi,goi->bsgo", grouped, wo_a.astype(o.dtype))
        return self.wo_b(z.reshape(b, s, -1))


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
