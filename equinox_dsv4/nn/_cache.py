"""The decoding state: an immutable pytree shaped like the layer stack.

Per layer (`LayerCache`):

- `ring`: the raw K=V of the last positions, position `p` in slot `p % ring_length`;
- for CSA / HCA layers, the compressor's `CompressorState`: the projected kv and gate (plus slot
  bias) of the last positions, position `p` in slot `p % slots` (the open block, and for CSA the
  last complete block too, whose `Ca` half the next entry pools), and the emitted entries, entry
  `i` in row `i`, preallocated to `max_len // ratio`;
- for CSA layers, the Lightning Indexer's own `CompressorState` (its entries are the index keys).

Every write goes to the slot or row of its position, and everything is read by position, so a
cache holds the same values whatever was written past a sequence's position: setting
`positions` back takes tokens back (`KVCache.rewind`, what speculative decoding needs). Rings
hold `rewind - 1` slots more than the context needs, so that the tokens taken back did not
overwrite any the context still reads.

`KVCache` holds, per `LayerStack` of the plan, one `LayerCache` per period position with a
leading `repeats` axis (1 for a layer on its own), so the cache travels with the weights; plus
the number of tokens each sequence has in the cache. Nothing here is a Python-level branch on
values: every shape is fixed by `(batch, max_len)`, so decoding never recompiles.

A decode step through a stack keeps the compressed entries, the arrays that grow with the
context, as whole stacks and writes each layer's new ones into them in place (`LayerCache.split`
/ `join`, `CompressorState.layer`); the fixed-size rest of each layer's state is sliced out
and stacked anew, as the layer's weights are. (Sliced out and stacked anew too, the entries
would be copied on every token.)
"""

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.typing import DTypeLike
from jaxtyping import Array, Float, Int

from .._typecheck import typechecked
from ..execution import Policy, error_if, set_rows


class Chunk(eqx.Module):
    """Where a chunk of `t` tokens per sequence goes: sequence `b`'s tokens at positions
    `start[b], start[b] + 1, ...`, of which the first `count[b]` are real (the rest is padding:
    computed, but neither cached nor visible to real tokens)."""

    start: Int[Array, " batch"]
    count: Int[Array, " batch"]

    @classmethod
    def whole(cls, batch: int, seq: int) -> "Chunk":
        """A whole sequence of `seq` real tokens from position 0 (a full causal forward)."""
        return cls(jnp.zeros((batch,), jnp.int32), jnp.full((batch,), seq, jnp.int32))

    def positions(self, t: int) -> Int[Array, "batch t"]:
        """The positions of the chunk's `t` tokens."""
        return self.start[:, None] + jnp.arange(t, dtype=jnp.int32)[None]

    def ring_index(self, t: int, slots: int) -> tuple[Int[Array, "batch t"], Int[Array, "batch t"]]:
        """`(sequence, slot)` of each of the chunk's tokens in a ring of `slots` rows holding
        position `p` in slot `p % slots`: the real tokens' slots, of the last `slots` of them
        only (earlier ones would be overwritten within the chunk), `slots` (written nowhere,
        see `set_rows`) for the others."""
        i = jnp.arange(t, dtype=jnp.int32)[None]
        count = self.count[:, None]
        write = (i < count) & (i >= count - slots)
        slot = jnp.where(write, self.positions(t) % slots, slots)
        return jnp.broadcast_to(jnp.arange(slot.shape[0])[:, None], slot.shape), slot


class CompressorState(eqx.Module):
    """A compressor's running state. `kv` / `gate` (float32, the gate with its slot bias) hold
    the projections of position `p` in slot `p % slots`, `slots` a multiple of the ratio that
    covers the open block and (CSA) the block before it; `entries` the emitted compressed
    entries, `pos // ratio` of them.

    In a view of a stacked cache (`LayerCache.join` with a layer), `entries` is the whole
    stack's, `[layers, batch, blocks, head_dim]`, and `layer` the index of this state's layer
    in it; read the layer's entries with `layer_entries`, write them with `write_entries`."""

    kv: Float[Array, "batch slots width"]
    gate: Float[Array, "batch slots width"]
    entries: Float[Array, "*layers batch blocks head_dim"]
    layer: Int[Array, ""] | int | None = None

    @property
    def layer_entries(self) -> Float[Array, "batch blocks head_dim"]:
        """This layer's entries."""
        if self.layer is None:
            return self.entries
        return _index(self.entries, self.layer)

    def layer_rows(
        self, index: Int[Array, "batch seq picks"]
    ) -> Float[Array, "batch seq picks head_dim"]:
        """This layer's entries `index[b]` of each sequence `b` (in range), gathered from
        the stack in place: `layer_entries` then a gather would copy the whole layer first.
        The sequences are the gather's batch, where they are in the stack (a batch split over
        devices stays split; mapped with `vmap`, the stack was transposed first)."""
        b = index.shape[0]
        flat = index.reshape(b, -1, 1)
        width = self.entries.shape[-1]
        if self.layer is None:  # [batch, blocks, head_dim]
            starts, batch_axis, axes = flat, 0, (1,)
        else:  # [layers, batch, blocks, head_dim]
            layer = jnp.broadcast_to(jnp.asarray(self.layer, flat.dtype), flat.shape)
            starts, batch_axis, axes = jnp.concatenate([layer, flat], -1), 1, (0, 2)
        numbers = jax.lax.GatherDimensionNumbers(
            offset_dims=(2,),
            collapsed_slice_dims=axes,
            start_index_map=axes,
            operand_batching_dims=(batch_axis,),
            start_indices_batching_dims=(0,),
        )
        sizes = (1,) * (self.entries.ndim - 1) + (width,)
        out = jax.lax.gather(
            self.entries, starts, numbers, sizes, mode=jax.lax.GatherScatterMode.PROMISE_IN_BOUNDS
        )
        return out.reshape(*index.shape, width)

    def write_entries(
        self,
        index: tuple[Int[Array, "..."], Int[Array, "..."]],
        values: Float[Array, "... head_dim"],
        policy: Policy | None,
    ) -> Float[Array, "*layers batch blocks head_dim"]:
        """`entries` with this layer's entries `index = (sequences, blocks)` set to `values`
        (see `set_rows`, in the form `policy` says: an index past the end writes nothing)."""
        return set_rows(self.entries, index, values, policy, layer=self.layer)

    @classmethod
    def empty(
        cls,
        batch: int,
        max_len: int,
        ratio: int,
        head_dim: int,
        overlap: bool,
        dtype: DTypeLike,
        rewind: int = 0,
    ) -> "CompressorState":
        width = (2 if overlap else 1) * head_dim
        slots = ring_slots(ratio, overlap, rewind)
        return cls(
            kv=jnp.zeros((batch, slots, width), jnp.float32),
            gate=jnp.zeros((batch, slots, width), jnp.float32),
            entries=jnp.zeros((batch, max_len // ratio, head_dim), dtype),
        )


def ring_slots(ratio: int, overlap: bool, rewind: int = 0) -> int:
    """Slots of a compressor's ring: the open block, the one before it for overlapping (CSA)
    windows, and room for `rewind - 1` more positions, in whole blocks."""
    return ratio * ((2 if overlap else 1) + -(-max(rewind - 1, 0) // ratio))


def window_slots(window: int, rewind: int = 0) -> int:
    """Slots of an attention layer's ring of raw keys: the window, and room for `rewind - 1`
    more positions."""
    return window + max(rewind - 1, 0)


class LayerCache(eqx.Module):
    """One attention layer's state (see the module docstring)."""

    ring: Float[Array, "batch window head_dim"]
    compressor: CompressorState | None
    indexer: CompressorState | None

    def split(self) -> tuple[tuple[Array | None, Array | None], "LayerCache"]:
        """`((compressor entries, indexer entries), rest)`: the arrays that grow with the
        context (`None` where there is no compressor or indexer), and this cache without them
        (their places `None`, as is a view's `layer`). `join` puts them back."""

        def cut(s: CompressorState | None) -> CompressorState | None:
            if s is None:
                return None
            return eqx.tree_at(_entries_and_layer, s, (None, None), is_leaf=_none)

        entries = tuple(None if s is None else s.entries for s in (self.compressor, self.indexer))
        return entries, self._with_states(cut(self.compressor), cut(self.indexer))

    def join(
        self,
        entries: tuple[Array | None, Array | None],
        layer: Int[Array, ""] | int | None = None,
    ) -> "LayerCache":
        """The inverse of `split`: this cache (`split`'s rest) with `entries`. With `layer`, the
        entries are a stack's, `[layers, ...]`, and the result is a view of layer `layer` of it
        (see `CompressorState`), which writes its new entries into the stack."""

        def put(s: CompressorState | None, e: Array | None) -> CompressorState | None:
            if s is None:
                return None
            return eqx.tree_at(_entries_and_layer, s, (e, layer), is_leaf=_none)

        return self._with_states(put(self.compressor, entries[0]), put(self.indexer, entries[1]))

    def _with_states(self, compressor, indexer) -> "LayerCache":
        # By tree surgery, not the constructor: a stacked cache's leaves have a `layers` axis
        # that the annotations (one layer's) do not.
        return eqx.tree_at(
            lambda c: (c.compressor, c.indexer), self, (compressor, indexer), is_leaf=_none
        )


def _entries_and_layer(s: CompressorState) -> tuple:
    return s.entries, s.layer


def _none(x) -> bool:
    return x is None


def _index(a: Array, i: Array | int) -> Array:
    return jax.lax.dynamic_index_in_dim(a, i, keepdims=False)


class KVCache(eqx.Module):
    """The whole model's decoding state (see the module docstring). Build it with
    `DeepseekV4.init_cache`; `DeepseekV4.decode` returns the updated one.

    `rewind` (static): how many of the tokens appended by the last `decode` call `rewind` may
    take back."""

    layers: tuple[tuple[LayerCache, ...], ...]
    positions: Int[Array, " batch"]
    max_len: int = eqx.field(static=True)
    max_rewind: int = eqx.field(static=True, default=0)

    @typechecked
    def rewind(self, n: Int[Array, " batch"]) -> "KVCache":
        """This cache with the last `n[b]` tokens of sequence `b` taken back: the cache a
        `decode` of only the tokens before them would have left. `n[b]` may be at most
        `max_rewind` and at most the tokens the last `decode` call appended to that sequence
        (a runtime error otherwise, for the first bound; the second is the caller's to keep)."""
        n = jnp.asarray(n, jnp.int32)
        bad = (n < 0) | (n > self.max_rewind) | (n > self.positions)
        n = error_if(n, jnp.any(bad), f"rewind: n must be in 0 .. {self.max_rewind}")
        return self.at_positions(self.positions - n)

    def at_positions(self, positions: Int[Array, " batch"]) -> "KVCache":
        """This cache with `positions` set (unchecked; see `rewind`)."""
        return eqx.tree_at(lambda c: c.positions, self, positions)

    @typechecked
    def take_rows(self, rows: Int[Array, " n"]) -> "KVCache":
        """The cache of sequences `rows` alone, a batch of `n` (for a step that runs on a few
        rows of a larger cache; `put_rows` writes them back)."""
        return jax.tree_util.tree_map_with_path(
            lambda path, a: jnp.take(a, rows, axis=_batch_axis(path)), self
        )

    @typechecked
    def put_rows(self, rows: Int[Array, " n"], part: "KVCache") -> "KVCache":
        """This cache with sequences `rows` replaced by `part`'s (as `take_rows` took them;
        `rows` distinct)."""

        def put(path, a, b):
            index = (slice(None),) * _batch_axis(path) + (rows,)
            return a.at[index].set(b, unique_indices=True)

        return jax.tree_util.tree_map_with_path(put, self, part)


def _batch_axis(path) -> int:
    # Under `.layers` every array has a leading layer axis (a stack's, or a stack of one).
    return 1 if path[0] == jax.tree_util.GetAttrKey("layers") else 0
