"""Expert parallelism with the routed experts split whole over `expert` and `fsdp`
(`Policy.expert_exchange`; each device holds `experts / devices` of them, every hidden unit):
`by_owners`, called by `expert_parallel`. Many tokens, split over the same axes, are exchanged:
each device sends its tokens' assignments to the devices that own their experts, which run
them and send the outputs back (`exchange`, by `all_to_all` inside a `shard_map`), so that a
row travels to one device and back, and the work and the buffers follow a device's own share
of the assignments, not its group's tokens. Few tokens (a decode step's) stay on every device,
which each run their own experts' share (`_owned`), summed over the devices.

Dropless in rounds: a device sends each expert at most `size` rows at a time (a block of slots
per expert), for as many rounds as the most loaded (device, expert) pair needs (the same count
on every device, so that every device takes part in every round's exchange). The gradient is
written out (a custom VJP) as the same rounds run backward: each round's rows, with their
outputs' cotangents, travel to their experts again, which recompute them and send the inputs'
and routing weights' cotangents back; the experts' own gradients stay where the experts are.
"""

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from ..quant import LoraWeight, QuantizedWeight, act_quant
from ._dispatch import _own_rounds, dispatch, of_layer
from ._expert_loop import _summed_like, _varying, swiglu, varying_like
from ._mesh import batch_axes, mesh_axis
from ._policy import Policy
from ._products import wider_dtype


def by_owners(x, indices, weights, w1, w2, w3, limit, numerics, policy: Policy, layer, *, few):
    """`expert_parallel`'s routed experts where `policy.expert_exchange` holds them split
    whole over `expert` and `fsdp` (as the `experts` rule `("expert", "fsdp")` places them):
    many tokens split over those axes are exchanged (`exchange`); few tokens (`few`: a decode
    step's), or a count the axes do not divide, stay on every device of the group, which
    each run the assignments to their own experts, summed over the group (`_owned`). `None`
    where the experts are not held so (no `expert_exchange`, quantised or adapted weights,
    experts that the axes do not divide)."""
    if not policy.expert_exchange or isinstance(w1, QuantizedWeight | LoraWeight):
        return None
    group = tuple(a for a in ("expert", "fsdp") if mesh_axis(a) > 1)
    n = math.prod(map(mesh_axis, group))
    if w1.shape[-3] % n:
        return None
    axes = [*(batch_axes(x.shape[0]) or ())]
    if mesh_axis("expert") > 1 and x.shape[0] % (mesh_axis("expert") * _devices(axes)) == 0:
        axes.append("expert")
    act = (limit, numerics)
    if few or not set(group) <= set(axes):
        local = functools.partial(_owned, act=act, group=group, policy=policy)
        axes = [a for a in axes if a not in group]
    else:
        # A round sends each expert at most `expert_buffer` times its even share of a
        # device's rows (8-row multiples), all of them at once without it.
        rows = x.shape[0] // _devices(axes) * indices.shape[1]
        size = -(-policy.expert_buffer * rows // w1.shape[-3]) if policy.expert_buffer else rows
        size = min(rows, 8 * -(-size // 8))
        local = functools.partial(_exchanged, act=act, group=group, size=size)
    row, lead = P(tuple(axes) or None, None), () if layer is None else (None,)
    stack = P(*lead, group)
    args, specs = (x, indices, weights, w1, w2, w3), (row, row, row, stack, stack, stack)
    if layer is not None:
        args, specs = args + (jnp.asarray(layer, jnp.int32),), specs + (P(),)
    mesh = jax.sharding.get_abstract_mesh()
    return jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=row)(*args)


def held_whole(w1: Any) -> bool:
    """Whether the routed experts' `w1` (`[..., experts, hidden, d_model]`, a placed array or
    `ShapeDtypeStruct`) is split whole over `fsdp` and `expert` (the `experts` rule
    `("expert", "fsdp")`, `parallel.EXCHANGE_RULES`): the placement `Policy.expert_exchange`
    takes, which a model so placed resolves to (`DeepseekV4.resolved_policy`). Never under
    the default rules, which split the experts over `expert` alone."""
    sharding = getattr(w1, "sharding", None)
    if not isinstance(sharding, NamedSharding) or getattr(w1, "ndim", 0) < 3:
        return False
    spec = (*sharding.spec, *(None,) * (w1.ndim - len(sharding.spec)))
    sizes = dict(sharding.mesh.shape)

    def split(entry) -> set:
        axes = entry if isinstance(entry, tuple) else (entry,)
        return {a for a in axes if a is not None and sizes.get(a, 1) > 1}

    group = {a for a in ("expert", "fsdp") if sizes.get(a, 1) > 1}
    whole = not split(spec[-2]) & group and not split(spec[-1]) & group
    return "fsdp" in group and split(spec[-3]) == group and whole


def _devices(axes) -> int:
    return math.prod(map(mesh_axis, axes))


def _exchanged(x, indices, weights, w1, w2, w3, layer=None, *, act, group, size):
    w1, w2, w3 = (of_layer(w, layer) for w in (w1, w2, w3))
    return exchange(x, indices, weights, w1, w2, w3, act=act, group=group, size=size)


def _owned(x, indices, weights, w1, w2, w3, layer=None, *, act, group, policy):
    # The tokens on every device of `group`: each runs the assignments to its own experts and
    # the partial outputs are summed over the group. With `expert_buffer`, where a round of
    # that many times a device's even share of the assignments is fewer rows than its
    # experts: its own assignments only, a round at a time, each row through its expert read
    # from the stack in place (`_own_rounds`), so a decode step reads about the experts its
    # tokens chose, not every local one. Otherwise `dispatch` over its experts.
    n_local = w2.shape[-3]
    first = jax.lax.axis_index(group) * n_local
    mine = (indices >= first) & (indices < first + n_local)
    ids, mine_weights = jnp.where(mine, indices - first, n_local), jnp.where(mine, weights, 0.0)
    rows = ids.size
    size = -(-policy.expert_buffer * rows // math.prod(map(mesh_axis, group)))
    if not 0 < size < min(n_local, rows):
        y = dispatch(x, ids, mine_weights, w1, w2, w3, *act, policy, layer)
    else:
        y = _own_rounds(x, ids, mine_weights, w1, w2, w3, layer, None, act, policy, size)
    return jax.lax.psum(y, group)


def exchange(x, indices, weights, w1, w2, w3, *, act, group, size):
    """Inside a `shard_map`: this device's tokens `x` `[tokens, d_model]`, their assignments
    (`indices`, `weights`: `[tokens, top_k]`, global expert ids) and its own experts' weights
    (`[experts / n, ...]`, the n devices of the mesh axes `group` holding the experts in the
    order of their index over `group`). Each round sends each expert at most `size` of the
    rows routed to it (a slot per row, `[devices, local experts, size]`), which its device
    runs by one product per expert over its slots from every device. `act`: (SwiGLU limit,
    numerics).

    **Returns:** float32 `[tokens, d_model]`: each token's sum over its assignments of the
    routing weight times its expert's output, each output rounded to `x.dtype` (as
    `dispatch`'s ragged form)."""
    return _exchange(act, group, size, x, indices, weights, w1, w2, w3)


def max_rounds(rows: int, size: int) -> int:
    """The rounds a device's `rows` assignments can need at `size` rows per expert: all of
    them routed to one expert."""
    return -(-rows // size)


def _plan(x, indices, weights, group, n_local, size):
    # The rows (assignments, flat) sorted by expert (so by device, then local expert), and a
    # function of the round giving, per device, local expert and slot, the row sent
    # (`[n, n_local, size]`) and whether it holds one; the rounds to run, the same count on
    # every device (the most loaded (device, expert) pair's); the routing weights, flat.
    n = math.prod(map(mesh_axis, group))
    expert = indices.reshape(-1)
    rows = expert.shape[0]
    order = jnp.argsort(expert, stable=True)
    counts = jnp.bincount(expert, length=n * n_local).astype(jnp.int32)
    starts = (jnp.cumsum(counts) - counts).reshape(n, n_local, 1)
    counts = counts.reshape(n, n_local, 1)
    slots = jnp.arange(size, dtype=jnp.int32)[None, None]

    def at(start):
        valid = start + slots < counts
        return order[jnp.minimum(starts + start + slots, rows - 1)], valid

    need = jnp.max(-(-counts // size))
    axes = tuple(sorted(_varying(x)))
    return at, jax.lax.pmax(need, axes) if axes else need, weights.reshape(-1)


def _send(a, group):
    return jax.lax.all_to_all(a, group, 0, 0, tiled=True)


def _local(xs, ws, w1, w2, w3, act):
    # The slots received, `[devices, local experts, slots, d_model]`, through their experts:
    # per expert one product over its slots from every device, no sort. An empty slot holds
    # some row of `x` and a zero routing weight; its output is never used (its sender drops
    # it), so nothing is masked.
    limit, numerics = act
    c = wider_dtype(xs, w1)
    # 16-bit operands' products are exact in the float32 accumulator at any precision.
    precision = jax.lax.Precision.DEFAULT if jnp.dtype(c).itemsize < 4 else None

    def product(spec, a, w):
        a, w = a.astype(c), w.astype(c)
        return jnp.einsum(spec, a, w, precision=precision, preferred_element_type=jnp.float32)

    g, u = product("slcd,lhd->slch", xs, w1), product("slcd,lhd->slch", xs, w3)
    h = act_quant((swiglu(g, u, limit) * ws[..., None]).astype(xs.dtype), numerics)
    return product("slch,ldh->slcd", h, w2).astype(xs.dtype)


def _over_rounds(body, carry, need, last):
    # `body(carry, start)` for rounds 0..need-1 of at most `last` (a loop that skips the rounds
    # past `need`, which is the same on every device); one round without a loop.
    if last == 1:
        return body(carry, jnp.int32(0))

    def one(carry, r):
        return jax.lax.cond(r < need, body, lambda c, _: c, carry, r), None

    return jax.lax.scan(one, carry, jnp.arange(last, dtype=jnp.int32))[0]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _exchange(act, group, size, x, indices, weights, w1, w2, w3):
    return _forward(act, group, size, x, indices, weights, w1, w2, w3)


def _forward(act, group, size, x, indices, weights, w1, w2, w3):
    tokens, top_k = indices.shape
    at, need, flat = _plan(x, indices, weights, group, w1.shape[0], size)

    def body(y, r):
        row, valid = at(r * size)
        token = row // top_k
        xs, ws = _send(x[token], group), _send(jnp.where(valid, flat[row], 0), group)
        back = _send(_local(xs, ws, w1, w2, w3, act), group)
        target = jnp.where(valid, token, tokens)
        return y.at[target].add(back.astype(jnp.float32), mode="drop")

    y = varying_like(jnp.zeros((tokens, w2.shape[1]), jnp.float32), x, w1)
    return _over_rounds(body, y, need, max_rounds(tokens * top_k, size))


def _exchange_fwd(act, group, size, x, indices, weights, w1, w2, w3):
    y = _forward(act, group, size, x, indices, weights, w1, w2, w3)
    return y, (x, indices, weights, w1, w2, w3)


def _exchange_bwd(act, group, size, residuals, grad):
    x, indices, weights, w1, w2, w3 = residuals
    tokens, top_k = indices.shape
    rows = tokens * top_k
    at, need, flat = _plan(x, indices, weights, group, w1.shape[0], size)
    # The experts' cotangents vary over the tokens' axes (`data` too, over which the experts
    # are replicated): each round's are taken as such and summed over those axes once, after
    # the rounds (`_summed_like`), not in every round.
    held = tuple(varying_like(w, x) for w in (w1, w2, w3))

    def body(carry, r):
        dx, dflat, dws = carry
        row, valid = at(r * size)
        token = row // top_k
        # The outputs were rounded to x.dtype before their float32 sum: so their cotangents.
        sent = (x[token], jnp.where(valid, flat[row], 0), grad[token].astype(x.dtype))
        xs, ws, gs = (_send(a, group) for a in sent)

        def run(xs, ws, w1, w2, w3):
            return _local(xs, ws, w1, w2, w3, act)

        d_xs, d_ws, *d_w = jax.vjp(run, xs, ws, *held)[1](gs)
        back_x, back_w = _send(d_xs, group), _send(d_ws, group)
        dx = dx.at[jnp.where(valid, token, tokens)].add(back_x.astype(jnp.float32), mode="drop")
        dflat = dflat.at[jnp.where(valid, row, rows)].add(back_w, mode="drop")
        dws = tuple(a + b.astype(a.dtype) for a, b in zip(dws, d_w, strict=True))
        return dx, dflat, dws

    operands = (x, grad, w1)
    carry = (
        varying_like(jnp.zeros(x.shape, jnp.float32), *operands),
        varying_like(jnp.zeros((rows,), flat.dtype), *operands),
        tuple(varying_like(jnp.zeros(w.shape, jnp.float32), *operands) for w in (w1, w2, w3)),
    )
    dx, dflat, dws = _over_rounds(body, carry, need, max_rounds(rows, size))
    dws = tuple(_summed_like(d, w).astype(w.dtype) for d, w in zip(dws, (w1, w2, w3), strict=True))
    return (dx.astype(x.dtype), None, dflat.reshape(weights.shape), *dws)


_exchange.defvjp(_exchange_fwd, _exchange_bwd)
