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
    start: int = eqx.field(static=True)
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
        self.start = segment.start
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
        taps: tuple[int, ...] = (),
    ) -> tuple[
        Float[Array, "batch chunk streams d_model"],
        tuple[LayerCache, ...],
        tuple[RouterStats, ...],
        dict[int, Float[Array, "batch chunk d_model"]],
    ]:
        """Applies the `repeats x period` layers in order to a chunk (see `Block.step`).

        `remat` names a rematerialisation policy (`REMAT_POLICIES`) for each period.
        `in_place=True` (decoding) keeps the compressed entries as whole stacks, each layer
        writing its new ones into them (`LayerCache.split` / `join`), so that a donated cache
        is updated in place; otherwise (a forward from position 0, where with `remat` a
        period's saved inputs would hold the whole stacked entries) they are sliced out and
        stacked anew with the rest of each layer's cache. With `in_place`, where
        `Policy.experts_in_place` says so, each layer's routed experts are also a view of the
        whole stacked weights (see `Experts`).

        `taps`: decoder layers (of the whole model) after which to average the streams (the
        DSpark drafter's context); those of this stack are returned.

        **Returns:** `(streams, caches, stats, tapped)`, caches and stats stacked along
        `repeats`, `tapped` the stream averages by layer."""
        # A scanned stack's experts are slices of the stack: values, which a decode step's
        # loop over assignments would copy whole (`Policy.gather_experts`).
        policy = resolve(self.policy)
        inner = dataclasses.replace(policy, gather_experts=self.repeats > 1)
        blocks = with_policy(self.blocks, inner)

        # Tapped layers here, as (period position, repeat); their averages ride in the carry.
        width = len(self.blocks)
        mine = [t for t in taps if 0 <= t - self.start < width * self.repeats]
        where = [divmod(t - self.start, width)[::-1] for t in mine]

        def period(carry, blocks, caches):
            x, tapped, r = carry
            tapped = list(tapped)
            new, stats = [], []
            for p, (block, cache) in enumerate(zip(blocks, caches, strict=True)):
                x, cache, s = block.step(x, ids, chunk, cache)
                x = constrain_batch(x, policy)
                for i, (tp, tr) in enumerate(where):
                    if tp == p:
                        mean = jnp.mean(x.astype(jnp.float32), axis=-2).astype(x.dtype)
                        tapped[i] = jnp.where(r == tr, mean, tapped[i])
                new.append(cache)
                stats.append(s)
            return (x, tuple(tapped), r + 1), tuple(new), tuple(stats)

        zeros = jnp.zeros((*x.shape[:2], x.shape[-1]), x.dtype)
        (x, tapped, _), caches, stats = run_layers(
            period,
            (x, (zeros,) * len(mine), jnp.zeros((), jnp.int32)),
            blocks,
            caches,
            policy,
            repeats=self.repeats,
            scan=self.scan,
            remat=remat,
            in_place=_ENTRIES if in_place else None,
            views=_EXPERTS if in_place and policy.experts_in_place else None,
        )
        return x, caches, stats, dict(zip(mine, tapped, strict=True))


def _split(caches: tuple[LayerCache, ...]):
    # `LayerCache.split` of each period position: (entries, rests).
    pairs = [c.split() for c in caches]
    return tuple(p[0] for p in pairs), tuple(p[1] for p in pairs)


def _join(rests, entries, layer: Array | int | None) -> tuple[LayerCache, ...]:
    return tuple(c.join(e, layer) for c, e in zip(rests, entries, strict=True))


_ENTRIES = InPlace(_split, _join)


def _expert_weights(block: Block):
    experts = block.ffn.experts
    return experts.w1, experts.w2, experts.w3


def _split_experts(blocks: tuple[Block, ...]):
    # Each period position's routed expert stacks, and the blocks without them.
    whole = tuple(_expert_weights(b) for b in blocks)
    rest = tuple(eqx.tree_at(_expert_weights, b, (None,) * 3) for b in blocks)
    return whole, rest


def _join_experts(rest, whole, layer: Array | int | None) -> tuple[Block, ...]:
    def where(b: Block):
        return (*_expert_weights(b), b.ffn.experts.layer)

    return tuple(
        eqx.tree_at(where, b, (*w, layer), is_leaf=_none) for b, w in zip(rest, whole, strict=True)
    )


def _none(x) -> bool:
    return x is None


_EXPERTS = InPlace(_split_experts, _join_experts)
