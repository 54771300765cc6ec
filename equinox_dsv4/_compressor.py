"""KV compressors: one learned, gated pooling of every `ratio` tokens into one KV entry.

HCA (heavily compressed attention, ratio 128) pools each block of `ratio` tokens on its own. CSA
(compressed sparse attention, ratio 4) pools overlapping windows of `2 * ratio` tokens with stride
`ratio`: each token projects two series, `Ca | Cb`, and entry `i` pools `Ca` of block `i - 1` with
`Cb` of block `i`. The pooling weights are a softmax over the slots of a window, separately per
channel, of the gate projection plus a learned per-slot bias (`ape`). The entry is then
RMS-normalised and rotated (compress RoPE) at the position of its block's first token, `i * ratio`.

Projections and pooling run in float32 (as in the official code) and the entry is cast back to
the input dtype before its norm. Only complete blocks are emitted.
"""

import abc

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
from jax.typing import DTypeLike
from jaxtyping import Array, Float, PRNGKeyArray

from ._config import Config
from ._layers import Linear, RMSNorm, lead
from ._rope import RoPE


def pool(
    kv: Float[Array, "*batch slots width"], gate: Float[Array, "*batch slots width"]
) -> Float[Array, "*batch width"]:
    """Per-channel softmax over the slots of a window, then the weighted sum (float32)."""
    return jnp.sum(kv * jax.nn.softmax(gate, axis=-2), axis=-2)


class AbstractCompressor(eqx.Module):
    """Projections, slot bias and entry norm shared by both compressors; subclasses say how
    many series a token projects and how the slots of a window are laid out."""

    wkv: Linear
    wgate: Linear
    ape: Float[Array, "ratio width"]
    norm: RMSNorm
    ratio: int = eqx.field(static=True)
    head_dim: int = eqx.field(static=True)
    rope: RoPE = eqx.field(static=True)

    def __init__(
        self,
        config: Config,
        head_dim: int,
        *,
        key: PRNGKeyArray,
        dtype: DTypeLike = jnp.float32,
    ):
        """**Arguments:**

        - `config`: the model config (hidden size, ratios, RoPE, norm eps).
        - `head_dim`: width of an entry (`config.head_dim` for attention, `config.index_head_dim`
          for the Lightning Indexer).
        - `key`: PRNG key.
        - `dtype`: dtype of the projection weights (`ape` and the norm weight stay float32).
        """
        ratio, series = self.layout(config)
        kv_key, gate_key = jr.split(key)
        width = series * head_dim
        self.wkv = Linear(config.hidden_size, width, (None, "embed"), key=kv_key, dtype=dtype)
        self.wgate = Linear(config.hidden_size, width, (None, "embed"), key=gate_key, dtype=dtype)
        self.ape = jnp.zeros((ratio, width), jnp.float32)
        self.norm = RMSNorm(head_dim, config.rms_norm_eps)
        self.ratio = ratio
        self.head_dim = head_dim
        self.rope = RoPE.for_layer(config, compressed=True)

    def param_axes(self, name: str) -> tuple[str | None, ...]:
        assert name == "ape"
        return (None, None)

    @staticmethod
    @abc.abstractmethod
    def layout(config: Config) -> tuple[int, int]:
        """`(ratio, series)`: tokens per block and projected series per token."""

    @abc.abstractmethod
    def slots(
        self, kv: Float[Array, "batch n ratio width"], gate: Float[Array, "batch n ratio width"]
    ) -> tuple[Float[Array, "batch n slots head_dim"], Float[Array, "batch n slots head_dim"]]:
        """The kv and gate of the slots each entry pools."""

    def __call__(self, x: Float[Array, "batch seq d_model"]) -> Float[Array, "batch n head_dim"]:
        """**Arguments:** `x`, the normed block input at positions `0 .. seq-1`.

        **Returns:** the `seq // ratio` compressed entries, in `x.dtype`.
        """
        if x.shape[1] < self.ratio:
            return jnp.zeros((x.shape[0], 0, self.head_dim), x.dtype)
        kv, gate = self.slots(*self.blocks(x))
        return self.finish(pool(kv, gate), x.dtype)

    def blocks(
        self, x: Float[Array, "batch seq d_model"]
    ) -> tuple[Float[Array, "batch n ratio width"], Float[Array, "batch n ratio width"]]:
        """Float32 kv and gate (+ ape) of the complete blocks of `x`."""
        n = x.shape[1] // self.ratio
        x = x[:, : n * self.ratio]
        kv = self.wkv(x, dtype=jnp.float32).reshape(x.shape[0], n, self.ratio, -1)
        gate = self.wgate(x, dtype=jnp.float32).reshape(x.shape[0], n, self.ratio, -1)
        return kv, gate + lead(self.ape, gate.ndim)

    def finish(
        self, pooled: Float[Array, "batch n head_dim"], dtype: DTypeLike
    ) -> Float[Array, "batch n head_dim"]:
        """Norm, then RoPE at each block's first position, in the activation dtype."""
        entries = self.norm(pooled.astype(dtype))
        positions = jnp.arange(entries.shape[1], dtype=jnp.int32) * self.ratio
        positions = jnp.broadcast_to(positions, entries.shape[:2])
        return self.rope(entries, positions)


class HCACompressor(AbstractCompressor):
    """Heavily compressed attention's compressor: entry `i` pools tokens `[i m, (i+1) m)`."""

    @staticmethod
    def layout(config: Config) -> tuple[int, int]:
        return config.compress_rate_hca, 1

    def slots(
        self, kv: Float[Array, "batch n ratio width"], gate: Float[Array, "batch n ratio width"]
    ) -> tuple[Float[Array, "batch n slots head_dim"], Float[Array, "batch n slots head_dim"]]:
        return kv, gate


class CSACompressor(AbstractCompressor):
    """Compressed sparse attention's compressor (also the Lightning Indexer's, at its own width):
    entry `i` pools `Ca` of block `i - 1` and `Cb` of block `i` over `2 * ratio` slots. Block 0 has
    no predecessor, so those slots get zero kv and zero weight."""

    @staticmethod
    def layout(config: Config) -> tuple[int, int]:
        return config.compress_rate_csa, 2

    def slots(
        self, kv: Float[Array, "batch n ratio width"], gate: Float[Array, "batch n ratio width"]
    ) -> tuple[Float[Array, "batch n slots head_dim"], Float[Array, "batch n slots head_dim"]]:
        d = self.head_dim
        shift = ((0, 0), (1, 0), (0, 0), (0, 0))
        prev_kv = jnp.pad(kv[:, :-1, :, :d], shift)
        prev_gate = jnp.pad(gate[:, :-1, :, :d], shift, constant_values=-jnp.inf)
        kv = jnp.concatenate([prev_kv, kv[..., d:]], axis=2)
        gate = jnp.concatenate([prev_gate, gate[..., d:]], axis=2)
        return kv, gate
