"""A scanned segment of the layer plan: the layers of a repeating period, their weights stacked
along a leading `repeats` axis, run by one `lax.scan` (or a Python loop over the same stacked
weights), with rematerialisation policies for training."""

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.typing import DTypeLike
from jaxtyping import Array, Float, Int

from ._block import Block
from ._cache import LayerCache
from ._config import Config
from ._experts import in_layer_stack
from ._layers import zeros_after
from ._moe import RouterStats
from ._parallel import constrain_batch
from ._plan import Segment
from ._policy import narrow_on_cpu


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


def _loop_widens(stacks) -> bool:
    # XLA:CPU computes 16-bit floats in float32 and hoists the conversion of a loop-invariant
    # operand out of the loop: scanned over as they are, bf16 stacks are converted to float32
    # whole in front of the layer loop, on every call (the small config's 43-layer bf16 decode
    # step: 2.3 GiB of temporaries; benchmarks/NOTES.md, item 17).
    return narrow_on_cpu(*jax.tree.leaves(stacks))


def _index_after(r: int, after: Array) -> Array:
    # `r`, as a value computed from `after`: with static slices XLA:CPU's scheduler took every
    # layer's at the start of the program (the small config's 43-layer prefill: 2.3 GiB of
    # temporaries, the stacked weights once more; benchmarks/NOTES.md, item 21). A NaN in
    # `after`, in one sequence, must not pick another layer for the others.
    zero = zeros_after((), jnp.float32, after)
    return r + jnp.where(jnp.isnan(zero), 0.0, zero).astype(jnp.int32)


def _layer_after(r: int, stacks, after: Array):
    # Layer r's slices of `stacks` (copies), taken once `after` exists (`_index_after`).
    i = _index_after(r, after)

    def take(a):
        if not jnp.issubdtype(a.dtype, jnp.inexact):
            return jax.lax.dynamic_index_in_dim(a, i, keepdims=False)
        return _index(a, i, r)

    return jax.tree.map(take, stacks)


@functools.partial(jax.custom_jvp, nondiff_argnums=(2,))
def _index(a: Array, i: Array, r: int) -> Array:
    return jax.lax.dynamic_index_in_dim(a, i, keepdims=False)


@_index.defjvp
def _index_jvp(r, primals, tangents):
    # The tangent is the static slice (`i` is always `r`), so the gradient is its transpose, a
    # pad, as with the static slices before. A dynamic index's transpose writes each
    # layer's gradient into a zero stack: the 12-layer unrolled train step's temporaries went
    # from 1,617 to 1,768 MiB that way.
    a, i = primals
    return _index(a, i, r), tangents[0][r]


class LayerStack(eqx.Module):
    """A scanned segment of the plan: `blocks[p]` holds the weights of the layers at position `p`
    of the period, stacked along a leading axis of length `repeats`."""

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

    def init_cache(self, batch: int, max_len: int, dtype: DTypeLike) -> tuple[LayerCache, ...]:
        """Empty caches of the stack, stacked like its blocks."""
        return tuple(
            jax.tree.map(
                lambda a: jnp.broadcast_to(a, (self.repeats, *a.shape)),
                block.attn.init_cache(batch, max_len, dtype),
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
        scan: bool = True,
        remat: str | None = None,
        in_place: bool = False,
    ) -> tuple[
        Float[Array, "batch chunk streams d_model"], tuple[LayerCache, ...], tuple[RouterStats, ...]
    ]:
        """Applies the `repeats x period` layers in order to a chunk (see `Block.step`);
        `scan=False` unrolls the same stacked weights into a Python loop (more to compile, same
        numbers); `remat` names a rematerialisation policy (`REMAT_POLICIES`) for each period.
        `in_place=True` (what `decode` uses) keeps the compressed entries as whole stacks,
        each layer writing its new ones into them (`LayerCache.split` / `join`), so that a
        donated cache is updated in place; otherwise (`forward`, where with `remat` a period's
        saved inputs would hold the whole stacked entries) they are sliced out and stacked anew
        with the rest of each layer's cache.

        **Returns:** `(streams, caches, stats)`, caches and stats stacked along `repeats`."""

        def period(x, layer):
            blocks, caches = layer
            # This layer's slice of the stacked weights, fixed here: otherwise XLA may move a
            # conversion (e.g. XLA:CPU's bf16 -> f32 before a dot) in front of the slicing and
            # out of the loop, materialising a converted copy of the whole stack. (Not enough
            # on XLA:CPU, which converts in front of the slicing itself: see `_loop_widens`.)
            blocks = jax.lax.optimization_barrier(blocks)
            new, stats = [], []
            with in_layer_stack():
                for block, cache in zip(blocks, caches, strict=True):
                    x, cache, s = block.step(x, ids, start, count, cache)
                    x = constrain_batch(x)
                    new.append(cache)
                    stats.append(s)
            return x, (tuple(new), tuple(stats))

        period = with_remat(period, remat)
        widen = scan and _loop_widens(self.blocks)
        if in_place:
            # The entries ride in the carry; the fixed-size rest of each layer's cache is
            # scanned over and stacked anew like the weights (carried and written back as well,
            # it made the 43-layer decode step 10% slower at a 1k context).
            entries, rest = _split(caches)
            if scan:

                def body(carry, xs):
                    x, stacks, entries = carry
                    r, blocks, rest = xs
                    if widen:  # see below
                        stacks, entries = jax.lax.optimization_barrier((stacks, entries))
                        blocks = jax.tree.map(lambda a: a[r], stacks)
                    x, (new, stats) = period(x, (blocks, _join(rest, entries, r)))
                    entries, rest = _split(new)
                    return (x, stacks, entries), (rest, stats)

                stacks, blocks = (self.blocks, None) if widen else (None, self.blocks)
                xs = (jnp.arange(self.repeats), blocks, rest)
                (x, _, entries), (rest, stats) = jax.lax.scan(body, (x, stacks, entries), xs)
                return x, _join(rest, entries), stats
            outs = []
            for r in range(self.repeats):
                blocks, layer_rest = _layer_after(r, (self.blocks, rest), x)
                layer = _join(layer_rest, entries, _index_after(r, x))
                x, (new, s) = period(x, (blocks, layer))
                entries, new_rest = _split(new)
                outs.append((new_rest, s))
            rest, stats = jax.tree.map(lambda *a: jnp.stack(a), *outs)
            return x, _join(rest, entries), stats
        if widen:
            # The stacks ride in the carry, through a barrier, so that XLA sees them change and
            # cannot hoist their conversion out of the loop; each layer's slice is taken inside.
            def carried(carry, r):
                x, stacks, caches = carry
                stacks, caches = jax.lax.optimization_barrier((stacks, caches))
                blocks, layer = jax.tree.map(lambda a: a[r], (stacks, caches))
                x, (new, stats) = period(x, (blocks, layer))
                caches = jax.tree.map(lambda a, n: a.at[r].set(n), caches, new)
                return (x, stacks, caches), stats

            carry = (x, self.blocks, caches)
            (x, _, new), stats = jax.lax.scan(carried, carry, jnp.arange(self.repeats))
            return x, new, stats
        if scan:
            x, (new, stats) = jax.lax.scan(period, x, (self.blocks, caches))
            return x, new, stats
        outs = []
        for r in range(self.repeats):
            x, out = period(x, _layer_after(r, (self.blocks, caches), x))
            outs.append(out)
        new, stats = jax.tree.map(lambda *a: jnp.stack(a), *outs)
        return x, new, stats


def _split(caches: tuple[LayerCache, ...]):
    # `LayerCache.split` of each period position: (entries, rests).
    pairs = [c.split() for c in caches]
    return tuple(p[0] for p in pairs), tuple(p[1] for p in pairs)


def _join(rests, entries, layer: Array | None = None) -> tuple[LayerCache, ...]:
    return tuple(c.join(e, layer) for c, e in zip(rests, entries, strict=True))
