"""A segment of the layer plan: the layers of a repeating period, their weights stacked along a
leading `repeats` axis (a layer that does not repeat is a stack of one), run by one period body
under one of two drivers (`lax.scan`, or a Python loop over the same stacked weights), with
rematerialisation policies for training."""

import dataclasses
import typing

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.typing import DTypeLike
from jaxtyping import Array, Float, Int

from ._block import Block
from ._cache import LayerCache
from ._config import Config
from ._forms import index_after, take_layer
from ._moe import RouterStats
from ._parallel import constrain_batch
from ._plan import Segment
from ._policy import Policy


# `remat` policies for training: what a layer keeps for the backward pass (the rest is
# recomputed). "nothing": only the residual streams between layers; "dots": also the outputs of
# the weight matmuls (those without a batch dimension in the contraction).
REMAT_POLICIES = {
    "nothing": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def with_remat(fn, remat: str | None):
    if remat is None:
        return fn
    if remat not in REMAT_POLICIES:
        raise ValueError(f"remat must be None or one of {sorted(REMAT_POLICIES)}, got {remat!r}")
    # prevent_cse=False: inside a scan the loop already keeps XLA from merging recomputation
    # with the forward pass, and CSE barriers would only slow the unrolled case.
    return jax.checkpoint(fn, policy=REMAT_POLICIES[remat], prevent_cse=False)


class LayerStack(eqx.Module):
    """A segment of the plan: `blocks[p]` holds the weights of the layers at position `p` of the
    period, stacked along a leading axis of length `repeats` (1 for a layer run on its own)."""

    blocks: tuple[Block, ...]
    repeats: int = eqx.field(static=True)

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
        start: Int[Array, " batch"],
        count: Int[Array, " batch"],
        caches: tuple[LayerCache, ...],
        *,
        policy: Policy,
        scan: bool = True,
        remat: str | None = None,
        in_place: bool = False,
    ) -> tuple[
        Float[Array, "batch chunk streams d_model"], tuple[LayerCache, ...], tuple[RouterStats, ...]
    ]:
        """Applies the `repeats x period` layers in order to a chunk (see `Block.step`).

        One period body runs under one of two drivers: `lax.scan` over the repeats, or with
        `scan=False` (and for a stack of one) a Python loop over the same stacked weights (more
        to compile, same numbers). `Route` says where the weights and caches travel. `remat`
        names a rematerialisation policy (`REMAT_POLICIES`) for each period. `in_place=True`
        (what `decode` uses) keeps the compressed entries as whole stacks, each layer writing
        its new ones into them (`LayerCache.split` / `join`), so that a donated cache is
        updated in place; otherwise (`forward`, where with `remat` a period's saved inputs
        would hold the whole stacked entries) they are sliced out and stacked anew with the
        rest of each layer's cache.

        **Returns:** `(streams, caches, stats)`, caches and stats stacked along `repeats`."""
        scan = scan and self.repeats > 1
        route = Route.decide(policy, self.blocks, scan=scan, in_place=in_place)
        inner = dataclasses.replace(policy, gather_experts=self.repeats > 1)

        def period(x, blocks, caches):
            # This layer's slice of the stacked weights, fixed here: otherwise XLA may move a
            # conversion in front of the slicing and out of the loop, materialising a
            # converted copy of the whole stack (`Route.carry_weights` for XLA:CPU, which
            # converts in front of the slicing itself). A stack of one is its parameters.
            if self.repeats > 1:
                blocks = jax.lax.optimization_barrier(blocks)
            new, stats = [], []
            for block, cache in zip(blocks, caches, strict=True):
                x, cache, s = block.step(x, ids, start, count, cache, policy=inner)
                x = constrain_batch(x)
                new.append(cache)
                stats.append(s)
            return x, tuple(new), tuple(stats)

        period = with_remat(period, remat)
        entries, rest = _split(caches) if in_place else (None, caches)
        held = {"entries": entries} if in_place else {}
        swept = {}
        (held if route.carry_weights else swept)["weights"] = self.blocks
        (held if route.carry_cache else swept)["cache"] = rest

        def body(carry, xs):
            # One period: layer r's weights and cache, from the carry (indexed) or swept.
            x, held = carry
            r, swept = xs
            if route.carry_weights:
                held = jax.lax.optimization_barrier(held)
            layer = {k: jax.tree.map(lambda a: a[r], v) for k, v in held.items() if k != "entries"}
            layer.update(swept)
            cache = layer["cache"]
            if in_place:
                cache = _join(cache, held["entries"], r)
            x, new, stats = period(x, layer["weights"], cache)
            held = dict(held)
            if in_place:
                held["entries"], new = _split(new)
            out = {"stats": stats}
            if route.carry_cache:
                held["cache"] = jax.tree.map(lambda a, n: a.at[r].set(n), held["cache"], new)
            else:
                out["cache"] = new
            return (x, held), out

        if scan:
            (x, held), out = jax.lax.scan(body, (x, held), (jnp.arange(self.repeats), swept))
        else:
            (x, held), out = _python_loop(body, (x, held), swept, self.repeats, policy)
        rest = held["cache"] if route.carry_cache else out["cache"]
        return x, _join(rest, held["entries"]) if in_place else rest, out["stats"]


class Route(typing.NamedTuple):
    """Where a layer stack's weights and caches travel through the layer loop: in the loop's
    carry (each period indexes its layer out of the whole stack), or swept (the scan's `xs`,
    or sliced per layer by the Python loop). Compressed entries updated in place always ride
    in the carry."""

    carry_weights: bool
    carry_cache: bool

    @classmethod
    def decide(cls, policy: Policy, blocks, *, scan: bool, in_place: bool) -> "Route":
        # Swept, a 16-bit stack is a loop-invariant operand of the scan, and XLA:CPU hoists its
        # conversion to float32 out of the loop: the whole stack converted on every call. In
        # the carry, through a barrier, XLA sees it change. The caches ride along with the
        # weights, except in place (then only their fixed-size rest is swept, stacked anew).
        widen = scan and policy.carries(*jax.tree.leaves(blocks))
        return cls(carry_weights=widen, carry_cache=widen and not in_place)


def _python_loop(body, carry, swept, n: int, policy: Policy):
    # The second driver: `lax.scan`'s contract, unrolled. Layer r's slices are taken when the
    # loop reaches it (`index_after` where the policy asks for late slices); a stack of one
    # is its only layer.
    outs = []
    for r in range(n):
        i = r if n == 1 or not policy.late_slices else index_after(r, carry[0])
        layer = jax.tree.map(lambda a, i=i, r=r: take_layer(a, i, r), swept)
        carry, out = body(carry, (i, layer))
        outs.append(out)
    if n == 1:
        return carry, jax.tree.map(lambda a: a[None], outs[0])
    return carry, jax.tree.map(lambda *a: jnp.stack(a), *outs)


def _split(caches: tuple[LayerCache, ...]):
    # `LayerCache.split` of each period position: (entries, rests).
    pairs = [c.split() for c in caches]
    return tuple(p[0] for p in pairs), tuple(p[1] for p in pairs)


def _join(rests, entries, layer: Array | int | None = None) -> tuple[LayerCache, ...]:
    return tuple(c.join(e, layer) for c, e in zip(rests, entries, strict=True))
