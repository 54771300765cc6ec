"""The routed experts' loop: on rows sorted by expert, a loop over the experts, each running its
rows in blocks, with the gradient written out (`expert_mlps`); and the helpers the decode forms
share with it (one block through one expert, a loop over a stack's experts)."""

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from ..quant import LoraWeight, QuantizedWeight, act_quant, base_dense
from ._policy import Policy, resolve
from ._products import linear, wider_dtype
from ._schedule import zeros_after


def swiglu(
    gate: Float[Array, "*batch inter"], up: Float[Array, "*batch inter"], limit: float
) -> Float[Array, "*batch inter"]:
    """`silu(min(gate, L)) * clip(up, -L, L)`; no clamp when `limit` is 0."""
    if limit > 0:
        gate = jnp.minimum(gate, limit)
        up = jnp.clip(up, -limit, limit)
    return jax.nn.silu(gate) * up


def _varying(a: Array) -> frozenset:
    # The mesh axes `a` varies over inside a shard_map.
    return jax.typeof(a).manual_axis_type.varying


def varying_like(init: Array, *operands: Any) -> Array:
    # Under shard_map a loop's carry must vary over the same mesh axes as what the body adds to
    # it; a fresh zeros array varies over none.
    axes = frozenset().union(*(_varying(a) for a in jax.tree.leaves(operands))) - _varying(init)
    return jax.lax.pcast(init, tuple(sorted(axes)), to="varying") if axes else init


def _summed_like(grad: Array, weight: Array) -> Array:
    # A weight's cotangent varies over the mesh axes its weight does: the tokens may vary over
    # more (`data`, over which the weights are replicated), and the contributions of those
    # axes' devices add up.
    extra = tuple(sorted(_varying(grad) - _varying(weight)))
    return jax.lax.psum(grad, extra) if extra else grad


def _hidden(xb, wb, w1e, w3e, act, dtype, policy):
    # One block's SwiGLU: (gate, up, swiglu, routing-weighted hidden in the activation dtype,
    # as w2 takes it). `act`: (swiglu limit, numerics).
    limit, numerics = act
    g = linear(xb, w1e, policy, dtype=jnp.float32)
    u = linear(xb, w3e, policy, dtype=jnp.float32)
    a = swiglu(g, u, limit)
    # The routing weight is applied before w2, in float32, as in the official code.
    return g, u, a, act_quant((a * wb[:, None]).astype(dtype), numerics)


def _expert_block(xb, wb, w1e, w2e, w3e, act, dtype, policy):
    # One block of one expert's rows through that expert, float32.
    h = _hidden(xb, wb, w1e, w3e, act, dtype, policy)[3]
    return linear(h, w2e, policy, dtype=jnp.float32)


def _over_rows(start, n, block, tail, carry, body):
    # body(carry, offset, size) over rows [start, start + n), n a multiple of `tail`: whole
    # blocks of `block` rows, then the rest in blocks of `tail` rows.
    whole = n // block
    carry = jax.lax.fori_loop(0, whole, lambda i, c: body(c, start + i * block, block), carry)
    rest = start + whole * block
    short = (n - whole * block) // tail
    return jax.lax.fori_loop(0, short, lambda i, c: body(c, rest + i * tail, tail), carry)


def _barrier(tree: Any) -> Any:
    # One optimization barrier per set of mesh axes the leaves vary over: a barrier's outputs
    # vary over the union of its operands' axes, and a loop carry must keep its type (a
    # `LoraWeight`'s factors need not vary like its base under a `shard_map`).
    leaves, treedef = jax.tree.flatten(tree)
    groups: dict[frozenset, list[int]] = {}
    for i, leaf in enumerate(leaves):
        groups.setdefault(_varying(leaf), []).append(i)
    for members in groups.values():
        held = jax.lax.optimization_barrier([leaves[i] for i in members])
        for i, leaf in zip(members, held, strict=True):
            leaves[i] = leaf
    return jax.tree.unflatten(treedef, leaves)


def _over_experts(body, carry, stacks, chosen, xs, policy):
    # A scan of body(carry, (w1[e], w2[e], w3[e]), x) -> (carry, y) over the experts e in
    # `chosen` and the matching entries x of `xs`. The stacks ride in the carry; under
    # `Policy.carry_stacks` through a barrier: as a loop's operand, XLA:CPU converted 16-bit
    # stacks to float32 whole in front of the loop, on every call.
    barrier = resolve(policy).carry_stacks

    def step(carry, a):
        carry, stacks = carry
        if barrier:
            stacks = _barrier(stacks)
        e, x = a
        carry, y = body(carry, tuple(w[e] for w in stacks), x)
        return (carry, stacks), y

    (carry, _), ys = jax.lax.scan(step, (carry, stacks), (chosen, xs))
    return carry, ys


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9, 10))
def expert_mlps(
    xs: Float[Array, "rows d_model"],
    ws: Float[Array, " rows"],
    w1: Float[Array, "experts inter d_model"] | QuantizedWeight | LoraWeight,
    w2: Float[Array, "experts d_model inter"] | QuantizedWeight | LoraWeight,
    w3: Float[Array, "experts inter d_model"] | QuantizedWeight | LoraWeight,
    first: Int[Array, " experts"],
    count: Int[Array, " experts"],
    act: tuple[float, str],
    block: int,
    tail: int,
    policy: Policy | None,
) -> Float[Array, "rows d_model"]:
    """The routed experts on rows sorted by expert: rows `first[e] .. first[e] + count[e] - 1`
    (`count[e]` a multiple of `tail`) become `w2[e] (ws * swiglu(w1[e] x, w3[e] x))`,
    computed in float32 and returned in `xs.dtype` (the rows, and the caller's read-back of
    them, are the largest buffers of a prefill's MoE); rows of no expert are zero. `act`: the
    SwiGLU limit and the numerics (see `dispatch`).

    A loop over experts, each running its rows in an inner loop of `block`-row matmuls (then
    `tail`-row ones for the rest), so each expert's weights are read once per call, little is
    computed for padding, and a block's gate, up and hidden values never leave the loop body.
    The trip counts depend on the routing, which reverse-mode autodiff cannot go through, so
    the gradient is written out: the backward pass recomputes each block's hidden values and
    sums each expert's weight gradients over its blocks, for the weights being differentiated
    only (a frozen stack, a `QuantizedWeight`, the base of a `LoraWeight` gets none computed).
    A `LoraWeight` stack's adapters run on each block's rows beside its expert's base
    (`linear`). `policy` lays out the products and the buffer the blocks are written to
    (`Policy.held_dtype`).
    """
    return _forward(xs, ws, w1, w2, w3, first, count, act, block, tail, policy)


def _forward(xs, ws, w1, w2, w3, first, count, act, block, tail, policy):
    c = wider_dtype(xs, w1)
    held = resolve(policy).held_dtype(xs.dtype)

    def expert(out, w, args):
        w1e, w2e, w3e = (base_dense(a, c) for a in w)
        start, n = args

        def rows(out, offset, size):
            xb = jax.lax.dynamic_slice_in_dim(xs, offset, size)
            wb = jax.lax.dynamic_slice_in_dim(ws, offset, size)
            y = _expert_block(xb, wb, w1e, w2e, w3e, act, xs.dtype, policy)
            return jax.lax.dynamic_update_slice_in_dim(out, y.astype(held), offset, 0)

        return _over_rows(start, n, block, tail, out, rows), None

    out = varying_like(zeros_after((xs.shape[0], w2.shape[1]), held, xs), xs, w1)
    experts = jnp.arange(w1.shape[0])
    out = _over_experts(expert, out, (w1, w2, w3), experts, (first, count), policy)[0]
    return out.astype(xs.dtype)


def _wanted(weight: Any) -> Any:
    # From a weight's `CustomVJPPrimal` leaves: which parts the caller differentiates, as a
    # tree of empty arrays (wanted) and `None`s (not), which rides in the residuals as their
    # structure. A `QuantizedWeight` never gets a cotangent.
    def flag(p):
        return jnp.zeros((0,), jnp.float32) if p.perturbed else None

    if isinstance(weight, QuantizedWeight):
        return None
    if isinstance(weight, LoraWeight):
        return (_wanted(weight.base), flag(weight.a), flag(weight.b))
    return flag(weight)


def _fwd_rule(xs, ws, w1, w2, w3, first, count, act, block, tail, policy):
    wanted = tuple(_wanted(w) for w in (w1, w2, w3))
    xs, ws, w1, w2, w3, first, count = jax.tree.map(
        lambda p: p.value,
        (xs, ws, w1, w2, w3, first, count),
        is_leaf=lambda p: isinstance(p, jax.custom_derivatives.CustomVJPPrimal),
    )
    out = _forward(xs, ws, w1, w2, w3, first, count, act, block, tail, policy)
    return out, (xs, ws, w1, w2, w3, first, count, wanted)


def _product_vjp(x, w, dy, wanted, dot):
    # The cotangents of `y = linear(x, w)` (a dense expert weight, or a `LoraWeight` with a
    # dense base): of `x`, and of the wanted parts of `w` (float32; `None` elsewhere).
    if isinstance(w, LoraWeight):
        base_wanted, a_wanted, b_wanted = wanted
        dx, dbase = _product_vjp(x, w.base, dy, base_wanted, dot)
        dyb = w.scale * dot("bo,or->br", dy, w.b)  # the cotangent of A x
        dx = dx + dot("br,ri->bi", dyb, w.a)
        da = dot("br,bi->ri", dyb, x) if a_wanted is not None else None
        db = (
            w.scale * dot("bo,br->or", dy, dot("bi,ri->br", x, w.a))
            if b_wanted is not None
            else None
        )
        return dx, (dbase, da, db)
    dw = dot("bo,bi->oi", dy, x) if wanted is not None else None
    return dot("bo,oi->bi", dy, w), dw


def _as_cotangent(grad: Any, weight: Any) -> Any:
    # A summed float32 gradient tree (from `_product_vjp`) as the cotangent of `weight`.
    if grad is None or isinstance(weight, QuantizedWeight):
        return None
    if isinstance(weight, LoraWeight):
        dbase, da, db = grad
        return LoraWeight(
            _as_cotangent(dbase, weight.base),
            _as_cotangent(da, weight.a),
            _as_cotangent(db, weight.b),
            weight.scale,
        )
    return _summed_like(grad, weight).astype(weight.dtype)


def _bwd_rule(act, block, tail, policy, residuals, dys):
    xs, ws, w1, w2, w3, first, count, wanted = residuals
    if isinstance(dys, jax.custom_derivatives.SymbolicZero):  # an output no loss reads
        dys = varying_like(jnp.zeros(dys.aval.shape, dys.aval.dtype), xs, w1)
    c = wider_dtype(xs, w1)
    held = resolve(policy).held_dtype(xs.dtype)

    def dot(spec, a, b):
        return jnp.einsum(spec, a.astype(c), b.astype(c), preferred_element_type=jnp.float32)

    def zeros_for(wanted_part, like):
        # A float32 accumulator per wanted part of one expert's weight.
        if isinstance(like, LoraWeight):
            return tuple(
                zeros_for(w, p)
                for w, p in zip(wanted_part, (like.base, like.a, like.b), strict=True)
            )
        if wanted_part is None:
            return None
        return varying_like(jnp.zeros(like.shape, jnp.float32), xs, dys, w1)

    def expert(carry, w, args):
        w1e, w2e, w3e = (base_dense(a, c) for a in w)
        start, n = args

        def rows(carry, offset, size):
            dxs, dws, grads = carry
            xb = jax.lax.dynamic_slice_in_dim(xs, offset, size).astype(c)
            wb = jax.lax.dynamic_slice_in_dim(ws, offset, size)
            dy = jax.lax.dynamic_slice_in_dim(dys, offset, size)
            g, u, a, h = _hidden(xb, wb, w1e, w3e, act, xs.dtype, policy)
            dh, d2 = _product_vjp(h, w2e, dy, wanted[1], dot)
            dws = jax.lax.dynamic_update_slice_in_dim(dws, jnp.sum(dh * a, axis=-1), offset, 0)
            dg, du = jax.vjp(lambda g, u: swiglu(g, u, act[0]), g, u)[1](dh * wb[:, None])
            dx1, d1 = _product_vjp(xb, w1e, dg, wanted[0], dot)
            dx3, d3 = _product_vjp(xb, w3e, du, wanted[2], dot)
            dxs = jax.lax.dynamic_update_slice_in_dim(dxs, (dx1 + dx3).astype(held), offset, 0)
            return dxs, dws, jax.tree.map(jnp.add, grads, (d1, d2, d3))

        zeros = tuple(zeros_for(m, e) for m, e in zip(wanted, (w1e, w2e, w3e), strict=True))
        dxs, dws, grads = _over_rows(start, n, block, tail, (*carry, zeros), rows)
        cotangents = tuple(_as_cotangent(g, wt) for g, wt in zip(grads, (w1, w2, w3), strict=True))
        return (dxs, dws), cotangents

    init = (
        varying_like(zeros_after(xs.shape, held, dys), dys, w1),
        varying_like(zeros_after(ws.shape, jnp.float32, dys), dys, w1),
    )
    experts = jnp.arange(w1.shape[0])
    (dxs, dws), (d1, d2, d3) = _over_experts(
        expert, init, (w1, w2, w3), experts, (first, count), policy
    )
    return dxs.astype(xs.dtype), dws, d1, d2, d3, None, None


expert_mlps.defvjp(_fwd_rule, _bwd_rule, symbolic_zeros=True)
