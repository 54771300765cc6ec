"""KV compressors: one learned, gated pooling of every `ratio` tokens into one KV entry.

HCA (heavily compressed attention, ratio 128) pools each block of `ratio` tokens on its own. CSA
(compressed sparse attention, ratio 4) pools overlapping windows of `2 * ratio` tokens with stride
`ratio`: each token projects two series, `Ca | Cb`, and entry `i` pools `Ca` of block `i - 1` with
`Cb` of block `i`. The pooling weights are a softmax over the slots of a window, separately per
channel, of the gate projection plus a learned per-slot bias (`ape`). The entry is then
RMS-normalised and rotated (compress RoPE) at the position of its block's first token, `i * ratio`.

Projections and pooling run in float32 (as in the official code) and the entry is cast back to
the input dtype before its norm. Only complete blocks are emitted; the open block's (and for CSA
the last complete block's) projections wait in the `CompressorState`'s ring, each position in
its own slot, so a sequence can be fed in chunks of any size (one token at a time included),
and taken back (`KVCache.rewind`), and gives the same entries as in one piece.
"""

import abc

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
from jax.typing import DTypeLike
from jaxtyping import Array, Float, Int, PRNGKeyArray

from ..config import Config
from ..execution import Policy, policy_field, set_rows
from ..quant import index_round_trip, kv_round_trip
from ._cache import Chunk, CompressorState
from ._layers import Linear, RMSNorm
from ._rope import RoPE


def pool(
    kv: Float[Array, "*batch slots width"], gate: Float[Array, "*batch slots width"]
) -> Float[Array, "*batch width"]:
    """Per-channel softmax over the slots of a window, then the weighted sum (float32)."""
    return jnp.sum(kv * jax.nn.softmax(gate, axis=-2), axis=-2)


def _window(x: Array, start: Int[Array, " batch"], size: int) -> Array:
    # Rows start[b] .. start[b] + size - 1 of x[b] along axis 1 (start in range).
    return jax.vmap(lambda row, s: jax.lax.dynamic_slice_in_dim(row, s, size))(x, start)


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
    rope_dim: int = eqx.field(static=True)
    numerics: str = eqx.field(static=True)
    index_keys: bool = eqx.field(static=True)
    policy: Policy | None = policy_field()

    def __init__(
        self,
        config: Config,
        head_dim: int,
        *,
        key: PRNGKeyArray,
        dtype: DTypeLike = jnp.float32,
        index_keys: bool = False,
    ):
        """**Arguments:**

        - `config`: the model config (hidden size, ratios, RoPE, norm eps, numerics).
        - `head_dim`: width of an entry (`config.head_dim` for attention, `config.index_head_dim`
          for the Lightning Indexer).
        - `key`: PRNG key.
        - `dtype`: dtype of the projection weights (`ape` and the norm weight stay float32).
        - `index_keys`: the Lightning Indexer's compressor (under `"release"` numerics its
          entries get the indexer's Hadamard + FP4 round trip, not the KV's FP8 one).
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
        self.rope_dim = config.qk_rope_head_dim
        self.numerics = config.numerics
        self.index_keys = index_keys
        self.policy = None

    def param_axes(self, name: str) -> tuple[str | None, ...]:
        assert name == "ape"
        return (None, None)

    @staticmethod
    @abc.abstractmethod
    def layout(config: Config) -> tuple[int, int]:
        """`(ratio, series)`: tokens per block and projected series per token."""

    @property
    def overlap(self) -> bool:
        return self.wkv.weight.shape[-2] == 2 * self.head_dim

    @abc.abstractmethod
    def slots(
        self,
        kv: Float[Array, "batch n ratio width"],
        gate: Float[Array, "batch n ratio width"],
        before: tuple[Float[Array, "batch ratio width"], Float[Array, "batch ratio width"]],
        first_block: Int[Array, " batch"],
    ) -> tuple[Float[Array, "batch n slots head_dim"], Float[Array, "batch n slots head_dim"]]:
        """The kv and gate of the slots each entry pools; `kv[:, j]` is the block with global
        index `first_block + j`, `before` the kv and gate of the block before it."""

    def empty_state(
        self, batch: int, max_len: int, dtype: DTypeLike, rewind: int = 0
    ) -> CompressorState:
        return CompressorState.empty(
            batch, max_len, self.ratio, self.head_dim, self.overlap, dtype, rewind
        )

    def __call__(self, x: Float[Array, "batch seq d_model"]) -> Float[Array, "batch n head_dim"]:
        """**Arguments:** `x`, the normed block input at positions `0 .. seq-1`.

        **Returns:** the `seq // ratio` compressed entries, in `x.dtype`.
        """
        b, s, _ = x.shape
        return self.step(x, Chunk.whole(b, s), self.empty_state(b, s, x.dtype)).entries

    @jax.named_scope("compressor")
    def step(
        self, x: Float[Array, "batch chunk d_model"], chunk: Chunk, state: CompressorState
    ) -> CompressorState:
        """Feed the chunk's real tokens (`Chunk`: the first `count[b]` tokens of `x[b]`, at
        positions `start[b] ...`) and emit the entries of every block they complete into
        `state.entries`.

        The open block's earlier tokens (from `state`) and the chunk are laid out on a block
        grid starting at the open block's first position, so blocks are pooled in parallel
        whatever each sequence's offset."""
        b, t, _ = x.shape
        m = self.ratio
        start, count = chunk.start, chunk.count
        positions = chunk.positions(t)
        kv = self.wkv(x, dtype=jnp.float32)
        gate = self.wgate(x, dtype=jnp.float32) + jnp.take(self.ape, positions % m, axis=0)

        open_len = start % m  # tokens of the open block already in `state`
        first_block = start // m
        ring_blocks = state.kv.shape[1] // m

        def ring_block(ring, block):  # the block's m slots: contiguous in the ring
            return _window(ring, (block % ring_blocks) * m, m)

        grid = -(-(m + t) // m) * m
        from_state = jnp.arange(grid, dtype=jnp.int32)[None] < open_len[:, None]

        # Slices, not row gathers (docs/design.md, "Compressor slices"). Grid rows past the
        # chunk are zeros.
        def lay_out(ring, new):
            chunk = _window(jnp.pad(new, ((0, 0), (m, grid - t), (0, 0))), m - open_len, grid)
            old = jnp.pad(ring_block(ring, first_block), ((0, 0), (0, grid - m), (0, 0)))
            return jnp.where(from_state[..., None], old, chunk)

        grid_kv = lay_out(state.kv, kv).reshape(b, grid // m, m, -1)
        grid_gate = lay_out(state.gate, gate).reshape(b, grid // m, m, -1)
        complete = (open_len + count) // m  # blocks closed by this chunk

        before = ring_block(state.kv, first_block - 1), ring_block(state.gate, first_block - 1)
        slots_kv, slots_gate = self.slots(grid_kv, grid_gate, before, first_block)
        pooled = pool(slots_kv, slots_gate)
        blocks = first_block[:, None] + jnp.arange(grid // m, dtype=jnp.int32)[None]
        entries = self.finish(pooled, blocks * m, state.entries.dtype)
        n_entries = state.entries.shape[-2]
        target = jnp.where(jnp.arange(grid // m)[None] < complete[:, None], blocks, n_entries)
        rows = jnp.broadcast_to(jnp.arange(b)[:, None], target.shape)
        new_entries = state.write_entries((rows, target), entries, self.policy)

        # The chunk's real tokens into their slots.
        slots = chunk.ring_index(t, state.kv.shape[1])
        ring_kv = set_rows(state.kv, slots, kv, self.policy)
        ring_gate = set_rows(state.gate, slots, gate, self.policy)
        return CompressorState(ring_kv, ring_gate, new_entries, state.layer)

    def finish(
        self,
        pooled: Float[Array, "batch n head_dim"],
        positions: Int[Array, "batch n"],
        dtype: DTypeLike,
    ) -> Float[Array, "batch n head_dim"]:
        """Norm, then RoPE at each block's first position, in the activation dtype; then the
        numerics' round trip of a KV entry or an index key."""
        entries = self.rope(self.norm(pooled.astype(dtype)), positions)
        if self.index_keys:
            return index_round_trip(entries, self.numerics)
        return kv_round_trip(entries, self.rope_dim, self.numerics)


class HCACompressor(AbstractCompressor):
    """Heavily compressed attention's compressor: entry `i` pools tokens `[i m, (i+1) m)`."""

    @staticmethod
    def layout(config: Config) -> tuple[int, int]:
        return config.compress_rate_hca, 1

    def slots(
        self,
        kv: Float[Array, "batch n ratio width"],
        gate: Float[Array, "batch n ratio width"],
        before: tuple[Float[Array, "batch ratio width"], Float[Array, "batch ratio width"]],
        first_block: Int[Array, " batch"],
    ) -> tuple[Float[Array, "batch n slots head_dim"], Float[Array, "batch n slots head_dim"]]:
        del before, first_block
        return kv, gate


class CSACompressor(AbstractCompressor):
    """Compressed sparse attention's compressor (also the Lightning Indexer's, at its own width):
    entry `i` pools `Ca` of block `i - 1` and `Cb` of block `i` over `2 * ratio` slots. Block 0 has
    no predecessor, so those slots get zero kv and zero weight."""

    @staticmethod
    def layout(config: Config) -> tuple[int, int]:
        return config.compress_rate_csa, 2

    def slots(
        self,
        kv: Float[Array, "batch n ratio width"],
        gate: Float[Array, "batch n ratio width"],
        before: tuple[Float[Array, "batch ratio width"], Float[Array, "batch ratio width"]],
        first_block: Int[Array, " batch"],
    ) -> tuple[Float[Array, "batch n slots head_dim"], Float[Array, "batch n slots head_dim"]]:
        d = self.head_dim
        # Block j's predecessor: the previous grid block, or for j = 0 the block before the
        # grid (from the ring), or nothing for the sequence's block 0 (gate -inf: zero weight).
        prev_kv = jnp.concatenate([before[0][:, None, :, :d], kv[:, :-1, :, :d]], axis=1)
        prev_gate = jnp.concatenate([before[1][:, None, :, :d], gate[:, :-1, :, :d]], axis=1)
        blocks = first_block[:, None] + jnp.arange(kv.shape[1])[None]
        prev_gate = jnp.where((blocks == 0)[:, :, None, None], -jnp.inf, prev_gate)
        prev_kv = jnp.where((blocks == 0)[:, :, None, None], 0.0, prev_kv)
        kv = jnp.concatenate([prev_kv, kv[..., d:]], axis=2)
        gate = jnp.concatenate([prev_gate, gate[..., d:]], axis=2)
        return kv, gate
