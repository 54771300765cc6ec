"""The routed experts' loop: on rows sorted by expert, a loop over the experts, each running its
rows in blocks, with the gradient written out (`expert_mlps`); and the helpers the decode forms
share with it (one block through one expert, a loop over a stack's experts)."""

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from ..quant import QuantizedWeight, act_quant, dense
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


def _over_experts(body, carry, stacks, chosen, xs, policy):
    # A scan of body(carry, (w1[e], w2[e], w3[e]), x) -> (carry, y) over the experts e in
    # `chosen` and the matching entries x of `xs`. The stacks ride in the carry; under
    # `Policy.carry_stacks` through a barrier: as a loop's operand, XLA:CPU converted 16-bit
    # stacks to float32 whole in front of the loop, on every call.
    barrier = resolve(policy).carry_stacks

    def step(carry, a):
        carry, stacks = carry
        if barrier:
            stacks = jax.lax.optimization_barrier(stacks)
        e, x = a
        carry, y = body(carry, tuple(w[e] for w in stacks), x)
        return (carry, stacks), y

    (carry, _), ys = jax.lax.scan(step, (carry, stacks), (chosen, xs))
    return carry, ys


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9, 10))
def expert_mlps(
    xs: Float[Array, "rows d_model"],
    ws: Float[Array, " rows"],
    w1: Float[Array, "experts inter d_model"] | QuantizedWeight,
    w2: Float[Array, "experts d_model inter"] | QuantizedWeight,
    w3: Float[Array, "experts inter d_model"] | QuantizedWeight,
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
    sums each expert's weight gradients over its blocks. `policy` lays out the products and
    the buffer the blocks are written to (`Policy.held_dtype`).
    """
    return _expert_mlps_fwd(xs, ws, w1, w2, w3, first, count, act, block, tail, policy)[0]


def _expert_mlps_fwd(xs, ws, w1, w2, w3, first, count, act, block, tail, policy):
    c = wider_dtype(xs, w1)
    held = resolve(policy).held_dtype(xs.dtype)

    def expert(out, w, args):
        w1e, w2e, w3e = (dense(a, c) for a in w)
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
    return out.astype(xs.dtype), (xs, ws, w1, w2, w3, first, count)


def _expert_mlps_bwd(act, block, tail, policy, residuals, dys):
    xs, ws, w1, w2, w3, first, count = residuals
    c = wider_dtype(xs, w1)
    held = resolve(policy).held_dtype(xs.dtype)

    def dot(spec, a, b):
        return jnp.einsum(spec, a.astype(c), b.astype(c), preferred_element_type=jnp.float32)

    def expert(carry, w, args):
        w1e, w2e, w3e = (dense(a, c) for a in w)
        start, n = args

        def rows(carry, offset, size):
            dxs, dws, d1, d2, d3 = carry
            xb = jax.lax.dynamic_slice_in_dim(xs, offset, size).astype(c)
            wb = jax.lax.dynamic_slice_in_dim(ws, offset, size)
            dy = jax.lax.dynamic_slice_in_dim(dys, offset, size)
            g, u, a, h = _hidden(xb, wb, w1e, w3e, act, xs.dtype, policy)
            d2 = d2 + dot("bo,bi->oi", dy, h)
            dh = dot("bo,oi->bi", dy, w2e)
            dws = jax.lax.dynamic_update_slice_in_dim(dws, jnp.sum(dh * a, axis=-1), offset, 0)
            dg, du = jax.vjp(lambda g, u: swiglu(g, u, act[0]), g, u)[1](dh * wb[:, None])
            d1 = d1 + dot("bo,bi->oi", dg, xb)
            d3 = d3 + dot("bo,bi->oi", du, xb)
            dx = dot("bo,oi->bi", dg, w1e) + dot("bo,oi->bi", du, w3e)
            dxs = jax.lax.dynamic_update_slice_in_dim(dxs, dx.astype(held), offset, 0)
            return dxs, dws, d1, d2, d3

        zeros = [varying_like(jnp.zeros(a.shape, jnp.float32), xs, dys, w1) for a in w]
        dxs, dws, d1, d2, d3 = _over_rows(start, n, block, tail, (*carry, *zeros), rows)
        # A quantised weight is frozen (see `trainable`): no cotangent.
        grads = (d1, d2, d3)
        return (dxs, dws), tuple(
            None if isinstance(w, QuantizedWeight) else _summed_like(g, w).astype(w.dtype)
            for g, w in zip(grads, (w1, w2, w3), strict=True)
        )

    init = (
        varying_like(zeros_after(xs.shape, held, dys), dys, w1),
        varying_like(zeros_after(ws.shape, jnp.float32, dys), dys, w1),
    )
    experts = jnp.arange(w1.shape[0])
    (dxs, dws), (d1, d2, d3) = _over_experts(
        expert, init, (w1, w2, w3), experts, (first, count), policy
    )
    return dxs.astype(xs.dtype), dws, d1, d2, d3, None, None


expert_mlps.defvjp(_expert_mlps_fwd, _expert_mlps_bwd)
