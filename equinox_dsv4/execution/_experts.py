"""The routed experts' entry point (`routed_experts`): on one device `dispatch`, and on a mesh
with an `expert` axis expert parallelism (`expert_parallel`), a `shard_map` in which each
device computes its own experts' share of the assignments (the official inference code's
expert parallelism), gathering the weights over `fsdp` for many tokens and moving the tokens
to the weights for few."""

import functools
import math
from dataclasses import replace
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float, Int

from ..quant import (
    ACT_BLOCK,
    RELEASE,
    LoraWeight,
    QuantizedWeight,
    act_quant,
    base_of,
    factor_specs,
    whole_blocks,
)
from ._dispatch import _assignment_rows, _own_rounds, _ragged_rounds, dispatch, of_layer
from ._exchange import by_owners
from ._expert_loop import swiglu, varying_like
from ._mesh import batch_axes, mesh_axis
from ._policy import Policy, resolve
from ._products import linear


def routed_experts(
    x: Float[Array, "tokens d_model"],
    indices: Int[Array, "tokens topk"],
    weights: Float[Array, "tokens topk"],
    w1: Float[Array, "*layers experts inter d_model"] | QuantizedWeight | LoraWeight,
    w2: Float[Array, "*layers experts d_model inter"] | QuantizedWeight | LoraWeight,
    w3: Float[Array, "*layers experts inter d_model"] | QuantizedWeight | LoraWeight,
    limit: float,
    numerics: str,
    policy: Policy | None,
    layer: Int[Array, ""] | int | None = None,
) -> Float[Array, "tokens d_model"]:
    """`sum_j weights[:, j] * expert_{indices[:, j]}(x)` in float32, expert `e` being
    `w2[e] swiglu(w1[e] x, w3[e] x)` (`limit`: the SwiGLU clamp; `numerics`: see `dispatch`):
    under a mesh with an `expert` axis by `expert_parallel`, else by `dispatch`, in the forms
    `policy` chooses. With a `layer`, the weights are a layer stack's, `[layers, experts, ...]`,
    and the experts layer `layer`'s: the forms that read a few chosen experts gather them from
    the stack in place, the others take the layer's slice first."""
    args = (x, indices, weights, w1, w2, w3, limit, numerics, policy, layer)
    if mesh_axis("expert") > 1:
        return expert_parallel(*args)
    return dispatch(*args)


def expert_parallel(
    x: Float[Array, "tokens d_model"],
    indices: Int[Array, "tokens topk"],
    weights: Float[Array, "tokens topk"],
    w1: Float[Array, "*layers experts inter d_model"] | QuantizedWeight | LoraWeight,
    w2: Float[Array, "*layers experts d_model inter"] | QuantizedWeight | LoraWeight,
    w3: Float[Array, "*layers experts inter d_model"] | QuantizedWeight | LoraWeight,
    limit: float,
    numerics: str,
    policy: Policy | None,
    layer: Int[Array, ""] | int | None = None,
) -> Float[Array, "tokens d_model"]:
    """The routed experts on a mesh with an `expert` axis: each device holds
    `experts / mesh["expert"]` of them and computes the assignments of its tokens (split over
    the batch axes, replicated over `expert` and `tensor`) to those, with hidden units split
    over `tensor` when it divides them; the partial outputs are summed over both axes. This is
    the official inference code's expert parallelism, as a `shard_map`.

    Over `fsdp`, `w2` is split along `d_model` and `w1`/`w3` along their hidden units (or, where
    those do not split into whole blocks, along `d_model`; see `ShardingRules`). With many
    tokens each device gathers its experts' weights over `fsdp`, one layer at a time, and
    computes its own tokens' assignments to them (with `policy.expert_buffer`, in rounds of
    that many times its even share: `dispatch`'s `at_once`). With few (at most
    `policy.stationary_rows` assignments in all, a decode step) the weights stay where they
    are and the tokens travel instead: each device takes its
    `fsdp` group's tokens through its slice of the chosen experts' `w1`/`w3` (of every local
    expert, once, where the assignments are at least as many as the local experts; gathering
    the hidden activations, or summing partial products over `fsdp` when `d_model` is what is
    split) and then its slice of `w2`, whose outputs go back to the tokens' devices, so a
    decode step moves activations, not every expert's weights.

    A `LoraWeight` stack's `A` is split like its base's input dim and `B` like its output dim
    (`ShardingRules` places them so): each device's products with its slices sum to the
    adapted weight's as the base's do. A layer stack's weights (with a `layer`) are split
    alike, their `layers` axis whole."""
    mesh = jax.sharding.get_abstract_mesh()
    policy = resolve(policy)
    # A split of a quantised weight must keep its blocks whole (as `ShardingRules` places it);
    # under the release's numerics each device's share of the hidden units must also hold
    # whole 128-wide activation blocks, or its round trips would differ from one device's.
    parts = mesh_axis("tensor")
    tensor_ok = whole_blocks(base_of(w1), -2, parts) and whole_blocks(base_of(w2), -1, parts)
    if numerics == RELEASE:
        tensor_ok = tensor_ok and w1.shape[-2] % (parts * ACT_BLOCK) == 0
    tensor = "tensor" if mesh_axis("tensor") > 1 and tensor_ok else None
    # The weights enter in their stored layout and are gathered here, one layer at a time: a
    # layout change demanded at the boundary would be applied to a scanned stack's whole
    # weight, before the loop.
    fsdp = "fsdp" if mesh_axis("fsdp") > 1 else None
    b1, b2 = base_of(w1), base_of(w2)
    up = bool(fsdp) and whole_blocks(b1, -2, (parts if tensor else 1) * mesh_axis("fsdp"))
    split = {
        "w1": 1 if up else 2 if fsdp and whole_blocks(b1, -1, mesh_axis("fsdp")) else None,
        "w2": 1 if fsdp and whole_blocks(b2, -2, mesh_axis("fsdp")) else None,
    }
    if split["w1"] is None and split["w2"] is None:
        fsdp = None
    tokens = batch_axes(x.shape[0])
    # Tokens not split over fsdp (a batch it does not divide, e.g. one sequence decoding): each
    # fsdp device computes the same outputs from the gathered weights, which JAX types as
    # varying over fsdp. One of them keeps its outputs and the sum runs over fsdp too, which
    # returns them exactly and lets the gradients of the gathered weights reduce correctly.
    spread = fsdp is not None and "fsdp" not in (tokens or ())
    reduce = ("expert",) + ((tensor,) if tensor else ())

    few = x.shape[0] * indices.shape[1] <= policy.stationary_rows
    # The experts split whole over expert x fsdp (`Policy.expert_exchange`): their own forms.
    owners = (x, indices, weights, w1, w2, w3, limit, numerics, policy, layer)
    if parts == 1 and (owned := by_owners(*owners, few=few)) is not None:
        return owned
    stay = up and _weights_stay(x, indices, b1, tokens, policy)
    outputs = tokens
    if (few or stay) and None not in split.values():
        # Many tokens split over fsdp (a prefill's, a train step's): over `expert` too, on
        # the way in and out. In, each device gathers its fsdp x expert group's tokens (as the
        # boundary's gather over `expert` and its own over fsdp did); out, the partial sums
        # are reduce-scattered over `expert` to the devices that own their tokens, where
        # summing them on every device of `expert` moved them all there and back.
        scatter = not few and not spread and _splits(x.shape[0], tokens, "expert")
        if scatter:
            outputs = (*tokens, "expert")
        local = functools.partial(
            _stationary,
            act=(limit, numerics),
            up=up,
            split=not spread,
            reduce=reduce,
            policy=policy,
            many=not few,
            scatter=scatter,
        )
    else:
        local = functools.partial(
            _gathering,
            act=(limit, numerics),
            axes=split,
            spread=spread,
            reduce=reduce,
            policy=policy,
        )
    row = P(outputs, None)
    hidden = tuple(a for a in (tensor, fsdp if up else None) if a) or None
    if hidden is not None and len(hidden) == 1:
        hidden = hidden[0]
    lead = () if layer is None else (None,)
    w13 = P(*lead, "expert", hidden, fsdp if split["w1"] == 2 else None)
    w2_spec = P(*lead, "expert", fsdp if split["w2"] else None, tensor)
    args = (x, indices, weights, w1, w2, w3)
    specs = (row, row, row, weight_spec(w1, w13), weight_spec(w2, w2_spec), weight_spec(w3, w13))
    if layer is not None:
        args, specs = args + (jnp.asarray(layer, jnp.int32),), specs + (P(),)
    return jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=row)(*args)


def _splits(n: int, axes: tuple[str, ...] | None, axis: str) -> bool:
    # Whether `n` rows split over `axes` split over `axis` as well.
    split = math.prod(map(mesh_axis, axes or ()))
    return mesh_axis(axis) > 1 and n % (mesh_axis(axis) * split) == 0


def _weights_stay(x, indices, w1, tokens, policy: Policy) -> bool:
    # `policy.experts_stay`, for many assignments in rounds (ragged, dense weights; hidden
    # units split over fsdp, the caller's `up`): whether fewer `d_model`-wide rows would
    # travel to the weights (the fsdp group's tokens, gathered, and a round's rows, gathered
    # from them) than the weights would bring (the local experts' `w1`, `w2`, `w3`).
    if not (policy.experts_stay and policy.expert_buffer and policy.experts == "ragged"):
        return False
    if isinstance(w1, QuantizedWeight):
        return False
    devices = math.prod(mesh_axis(a) for a in (tokens or ()))
    group = x.shape[0] // devices * mesh_axis("fsdp")
    round_rows = policy.expert_buffer * group * indices.shape[1] // mesh_axis("expert")
    n_local, inter = w1.shape[-3] // mesh_axis("expert"), w1.shape[-2]
    return group + round_rows < 3 * n_local * inter


def weight_spec(weight: Any, spec: P) -> Any:
    """The `shard_map` spec of a weight whose base takes `spec` (`[*lead, out, in]`): a
    quantised one's values and scales alike; a `LoraWeight`'s `A` split like the base's input
    dim, its `B` like the base's output dim (their rank dims whole)."""
    if not isinstance(weight, LoraWeight):
        return spec
    return LoraWeight(
        weight_spec(weight.base, spec), *factor_specs(spec, weight.ndim), weight.scale
    )


def _mine(indices, weights, n_local):
    # This device's experts among the assignments: local ids (others: `n_local`, dropped) and
    # the routing weights with the others' zeroed.
    first = jax.lax.axis_index("expert") * n_local
    mine = (indices >= first) & (indices < first + n_local)
    return jnp.where(mine, indices - first, n_local), jnp.where(mine, weights, 0.0)


def _gathering(x, indices, weights, w1, w2, w3, layer=None, *, act, axes, spread, reduce, policy):
    # Many tokens: this device's experts' weights gathered over fsdp, its own tokens computed.
    def gather(w, axis):
        # A quantised weight's values and scales are gathered alike (same rank, same axes); of
        # a `LoraWeight`, the base and the factor split along that dim (`weight_spec`).
        if axis is None:
            return w
        if isinstance(w, LoraWeight):
            a = gather(w.a, axis) if axis == w.ndim - 1 else w.a
            b = gather(w.b, axis) if axis == w.ndim - 2 else w.b
            return LoraWeight(gather(w.base, axis), a, b, w.scale)
        return jax.tree.map(lambda a: jax.lax.all_gather(a, "fsdp", axis=axis, tiled=True), w)

    w1, w2, w3 = (of_layer(w, layer) for w in (w1, w2, w3))
    w1, w2, w3 = gather(w1, axes["w1"]), gather(w2, axes["w2"]), gather(w3, axes["w1"])
    local_ids, mine_weights = _mine(indices, weights, w1.shape[0])
    at_once = _round_rows(indices.size, policy, multiple=8) or None
    # The gathered weights are a value, not a parameter (see `dispatch`).
    policy = replace(policy, gather_experts=True)
    y = dispatch(x, local_ids, mine_weights, w1, w2, w3, *act, policy, at_once=at_once)
    if spread:
        y = jnp.where(jax.lax.axis_index("fsdp") == 0, y, jnp.zeros_like(y))
        reduce += ("fsdp",)
    return jax.lax.psum(y, reduce)


def _stationary(
    x, indices, weights, w1, w2, w3, layer=None, *, act, up, split, reduce, policy, many, scatter
):
    # Few tokens: the tokens of this fsdp group (gathered when `split` over fsdp) through this
    # device's slice of its experts' weights: of `w1`/`w3`'s hidden units (`up`) or of their
    # `d_model`, and of `w2`'s `d_model`; the chosen experts only where the assignments are
    # fewer than the local experts, else every local expert, once. `many` (a prefill's, with
    # `up`): the assignments to this device's experts sorted by expert and run by ragged dots
    # in rounds (`_ragged_rounds`), each round's hidden units gathered over fsdp. Every
    # device of an fsdp group holds the same tokens and experts, so all of them run the
    # same rounds and meet in each round's gather. `scatter`: the tokens split over
    # `expert` as well, gathered over it first (one axis at a time: over both at once, the
    # TPU compiler gathers into a zero-filled buffer summed across the group), and their
    # outputs returned so.
    if split:
        for axis in ("expert", "fsdp") if scatter else ("fsdp",):
            x, indices, weights = (
                jax.lax.all_gather(a, axis, tiled=True) for a in (x, indices, weights)
            )
    n_local, width = w2.shape[-3], w2.shape[-2]
    local_ids, mine_weights = _mine(indices, weights, n_local)
    tokens, top_k = indices.shape
    rows = tokens * top_k
    if not up:
        x = jax.lax.dynamic_slice_in_dim(x, jax.lax.axis_index("fsdp") * width, width, axis=1)
    limit, numerics = act
    if many:
        w1, w2, w3 = (of_layer(w, layer) for w in (w1, w2, w3))
        at_once = _round_rows(rows, policy, multiple=8)
        expert = local_ids.reshape(rows)

        def hidden(h):
            return jax.lax.all_gather(h, "fsdp", axis=1, tiled=True)

        y = _ragged_rounds(
            x, mine_weights, expert, top_k, w1, w2, w3, act, min(at_once, rows), hidden
        )
    elif 0 < (own := _round_rows(rows, policy)) < min(n_local, rows):
        # A round of this device's own assignments reads fewer expert slices than either
        # form below: every local expert, or one expert per assignment of the group.
        y = _own_rounds(x, local_ids, mine_weights, w1, w2, w3, layer, up, act, policy, own)
    elif n_local <= rows:
        # At least as many assignments as local experts: every local expert on every token,
        # weighted by the token's routing weight for it (zero where not chosen), reads each
        # local expert once, where copying each assignment's expert out of the stack would
        # write (and read back) more than the whole stack.
        w1, w2, w3 = (of_layer(w, layer) for w in (w1, w2, w3))

        def products(a, w):  # a [tokens, ..., in] by each expert of w -> [tokens, experts, out]
            def each(a, w):
                return linear(a, w, policy, dtype=jnp.float32)

            return jax.vmap(each, in_axes=(1 if a.ndim == 3 else None, 0), out_axes=1)(a, w)

        g, u = products(x, w1), products(x, w3)
        if not up:
            g, u = jax.lax.psum((g, u), "fsdp")
        one_hot = local_ids[..., None] == jnp.arange(n_local)[None, None]
        per_expert = jnp.sum(jnp.where(one_hot, mine_weights[..., None], 0.0), axis=1)
        # Masked, not only weighted by zero: an expert no token chose adds exact zeros.
        chosen = jnp.any(one_hot, axis=1)[..., None]
        h = jnp.where(chosen, swiglu(g, u, limit) * per_expert[..., None], 0.0).astype(x.dtype)
        if up:
            h = jax.lax.all_gather(h, "fsdp", axis=2, tiled=True)
        y = jnp.sum(products(act_quant(h, numerics), w2), axis=1)
    else:
        y = _assignments(x, local_ids, mine_weights, w1, w2, w3, layer, up, act, policy)
    if scatter:  # each device's tokens back to it, whole `d_model`, summed on the way
        parts = mesh_axis("fsdp"), mesh_axis("expert")
        others = tuple(a for a in reduce if a != "expert")  # `tensor`, where it splits
        y = jax.lax.psum(y, others) if others else y
        y = y.reshape(parts[0], parts[1], -1, width)  # [fsdp, expert, tokens, width]
        y = jax.lax.psum_scatter(y, "expert", scatter_dimension=1, tiled=True)[:, 0]
        return jax.lax.all_to_all(y, "fsdp", 0, 2, tiled=True).reshape(-1, width * parts[0])
    if split:  # each device's tokens back to it, whole `d_model`
        return jax.lax.all_to_all(jax.lax.psum(y, reduce), "fsdp", 0, 1, tiled=True)
    # Every fsdp device holds the same tokens: its slice of `d_model` in place, summed over
    # fsdp with the rest (an all-gather would leave the result typed as varying over fsdp).
    whole = varying_like(jnp.zeros((tokens, width * mesh_axis("fsdp")), y.dtype), y)
    whole = jax.lax.dynamic_update_slice_in_dim(whole, y, jax.lax.axis_index("fsdp") * width, 1)
    return jax.lax.psum(whole, reduce + ("fsdp",))


def _round_rows(rows: int, policy: Policy, multiple: int = 1) -> int:
    # A round's rows under `policy.expert_buffer` (0: no rounds): that many times a device's
    # even share of `rows` assignments (its tokens', or its fsdp group's), rounded up to a
    # `multiple`.
    return multiple * math.ceil(policy.expert_buffer * rows / mesh_axis("expert") / multiple)


def _assignments(x, local_ids, mine_weights, w1, w2, w3, layer, up, act, policy):
    # Fewer assignments than local experts: each assignment through its expert's weights,
    # others' assignments zeroed (`_assignment_rows`), summed over each token's top-k.
    tokens, top_k = local_ids.shape
    rows = tokens * top_k
    x_rows = jnp.broadcast_to(x[:, None], (tokens, top_k, x.shape[1])).reshape(rows, -1)
    y = _assignment_rows(
        x_rows,
        local_ids.reshape(rows),
        mine_weights.reshape(rows),
        w1,
        w2,
        w3,
        layer,
        up,
        act,
        policy,
    )
    return jnp.sum(y.reshape(tokens, top_k, -1), axis=1)
