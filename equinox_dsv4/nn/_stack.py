"""A segment of the layer plan: the layers of a repeating period, their weights stacked along a
leading `repeats` axis (a layer that does not repeat is a stack of one), applied in order by
one period body that a driver of the execution layer runs over the repeats."""

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.typing import DTypeLike
from jaxtyping import Array, Float, Int

from ..config import Config, Segment
from ..execution import (
    InPlace,
    Policy,
    constrain_batch,
    policy_field,
    resolve,
    run_layers,
    with_policy,
)
from ._block import Block
from ._cache import Chunk, LayerCache
from ._moe import RouterStats


class LayerStack(eqx.Module):
    """A segment of the plan: `blocks[p]` holds the weights of the layers at position `p` of the
    period, stacked along a leading axis of length `repeats` (1 for a layer run on its own).
    `scan`: whether the repeats run under `lax.scan` or a Python loop (`Config.scan_layers`)."""

    blocks: tuple[Block, ...]
    repeats: int = eqx.field(static=True)
    scan: bool = eqx.field(static=True)
    policy: Policy | None = policy_field()

    def __init__(
        self,
        config: Config,
        segment: Segment,
        layer_keys: Array,
        *,
        dtype: DTypeLike = jnp.float32,
    ):
        def make(kind, keys):
            return eqx.filter_vmap(lambda k: Block(config, *kind, key=k, dtype=dtype))(keys)

        self.blocks = tuple(
            make(kind, layer_keys[jnp.array([segment.layer(p, r) for r in range(segment.repeats)])])
            for p, kind in enumerate(segment.period)
        )
        self.repeats = segment.repeats
        self.scan = config.scan_layers
        self.policy = None

    def init_cache(
        self, batch: int, max_len: int, dtype: DTypeLike, rewind: int = 0
    ) -> tuple[LayerCache, ...]:
        """Empty caches of the stack, stacked like its blocks (`rewind`: see
        `KVCache.rewind`)."""
        return tuple(
            jax.tree.map(
                lambda a: jnp.broadcast_to(a, (self.repeats, *a.shape)),
                block.attn.init_cache(batch, max_len, dtype, rewind),
            )
            for block in self.blocks
        )

    def step(
        self,
        x: Float[Array, "batch chunk streams d_model"],
        ids: Int[Array, "batch chunk"],
        chunk: Chunk,
        caches: tuple[LayerCache, ...],
        *,
        remat: str | None = None,
        in_place: bool = False,
    ) -> tuple[
        Float[Array, "batch chunk streams d_model"], tuple[LayerCache, ...], tuple[RouterStats, ...]
    ]:
        """Applies the `repeats x period` layers in order to a chunk (see `Block.step`).

        `remat` names a rematerialisation policy (`REMAT_POLICIES`) for each period.
        `in_place=True` (decoding) keeps the compressed entries as whole stacks, each layer
        writing its new ones into them (`LayerCache.split` / `join`), so that a donated cache
        is updated in place; otherwise (a forward from position 0, where with `remat` a
        period's saved inputs would hold the whole stacked entries) they are sliced out and
        stacked anew with the rest of each layer's cache.

        **Returns:** `(streams, caches, stats)`, caches and stats stacked along `repeats`."""
        # A scanned stack's experts are slices of the stack: values, which a decode step's
        # loop over assignments would copy whole (`Policy.gather_experts`).
        policy = resolve(self.policy)
        inner = dataclasses.replace(policy, gather_experts=self.repeats > 1)
        blocks = with_policy(self.blocks, inner)

        def period(x, blocks, caches):
            new, stats = [], []
            for block, cache in zip(blocks, caches, strict=True):
                x, cache, s = block.step(x, ids, chunk, cache)
                x = constrain_batch(x)
                new.append(cache)
                stats.append(s)
            return x, tuple(new), tuple(stats)

        return run_layers(
            period,
            x,
            blocks,
            caches,
            policy,
            repeats=self.repeats,
            scan=self.scan,
            remat=remat,
            in_place=_ENTRIES if in_place else None,
        )


def _split(caches: tuple[LayerCache, ...]):
    # `LayerCache.split` of each period position: (entries, rests).
    pairs = [c.split() for c in caches]
    return tuple(p[0] for p in pairs), tuple(p[1] for p in pairs)


def _join(rests, entries, layer: Array | int | None) -> tuple[LayerCache, ...]:
    return tuple(c.join(e, layer) for c, e in zip(rests, entries, strict=True))


_ENTRIES = InPlace(_split, _join)
