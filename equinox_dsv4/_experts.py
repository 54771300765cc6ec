"""The routed experts as a module: their stacked weights, and under a mesh with an `expert`
axis the expert parallelism that has each device compute its own experts' share
(`expert_parallel`). The computation itself is `_dispatch.dispatch`.
"""

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
from jax.sharding import PartitionSpec as P
from jax.typing import DTypeLike
from jaxtyping import Array, Float, Int, PRNGKeyArray

from ._config import Config
from ._dispatch import dispatch, swiglu, varying_like
from ._layers import init_normal, linear
from ._numerics import ACT_BLOCK, RELEASE, act_quant
from ._parallel import batch_axes, mesh_axis
from ._policy import Policy, resolve
from ._quant import QuantizedWeight, whole_blocks


# Assignments (tokens x top-k, all devices) up to which `expert_parallel` moves tokens to the
# weights instead of gathering the weights (a decode step; see there).
STATIONARY_ROWS = 64


class Experts(eqx.Module):
    """The routed experts, stacked: `w1`, `w3` `[experts, inter, d_model]`, `w2`
    `[experts, d_model, inter]`. Expert `e` maps `x` to `w2[e] (swiglu(w1[e] x, w3[e] x))`."""

    w1: Float[Array, "experts inter d_model"] | QuantizedWeight
    w2: Float[Array, "experts d_model inter"] | QuantizedWeight
    w3: Float[Array, "experts inter d_model"] | QuantizedWeight
    limit: float = eqx.field(static=True)
    numerics: str = eqx.field(static=True)

    def __init__(self, config: Config, *, key: PRNGKeyArray, dtype: DTypeLike = jnp.float32):
        k1, k2, k3 = jr.split(key, 3)
        e, d, i = config.n_routed_experts, config.hidden_size, config.moe_intermediate_size
        self.w1 = init_normal(k1, (e, i, d), dtype)
        self.w2 = init_normal(k2, (e, d, i), dtype)
        self.w3 = init_normal(k3, (e, i, d), dtype)
        self.limit = config.swiglu_limit
        self.numerics = config.numerics

    def param_axes(self, name: str) -> tuple[str | None, ...]:
        if name == "w2":
            return ("experts", "embed", "expert_mlp")
        return ("experts", "expert_up", "expert_in")

    def __call__(
        self,
        x: Float[Array, "tokens d_model"],
        indices: Int[Array, "tokens topk"],
        weights: Float[Array, "tokens topk"],
        *,
        policy: Policy | None = None,
    ) -> Float[Array, "tokens d_model"]:
        """**Arguments:** the normed tokens, their chosen experts and float32 routing weights;
        `policy`, the execution `Policy` (its `gather_experts`: see `dispatch`).

        **Returns:** `sum_j weights[:, j] * expert_{indices[:, j]}(x)`, accumulated in float32
        and returned in float32; where `dispatch` runs its expert loop (more assignments than
        experts, or than a device's experts when it gathers their weights: a prefill) each
        assignment's output is rounded to `x.dtype` before the sum. Under a mesh with an
        `expert` axis each device computes its own experts' share (see `expert_parallel`).
        """
        policy = resolve(policy, x)
        x = act_quant(x, self.numerics)  # once per token, for all of its experts
        if mesh_axis("expert") > 1:
            return expert_parallel(self, x, indices, weights, policy=policy)
        w = (self.w1, self.w2, self.w3)
        return dispatch(
            x,
            indices,
            weights,
            *w,
            self.limit,
            policy.gather_experts,
            policy=policy,
            numerics=self.numerics,
        )


def expert_parallel(
    experts: Experts,
    x: Float[Array, "tokens d_model"],
    indices: Int[Array, "tokens topk"],
    weights: Float[Array, "tokens topk"],
    *,
    policy: Policy | None = None,
) -> Float[Array, "tokens d_model"]:
    """The routed experts on a mesh with an `expert` axis: each device holds
    `experts / mesh["expert"]` of them and computes the assignments of its tokens (split over
    the batch axes, replicated over `expert` and `tensor`) to those, with hidden units split
    over `tensor` when it divides them; the partial outputs are summed over both axes. This is
    the official inference code's expert parallelism, as a `shard_map`.

    Over `fsdp`, `w2` is split along `d_model` and `w1`/`w3` along their hidden units (or, where
    those do not split into whole blocks, along `d_model`; see `ShardingRules`). With many
    tokens each device gathers its experts' weights over `fsdp`, one layer at a time, and
    computes its own tokens. With few (at most `STATIONARY_ROWS` assignments in all, a decode
    step) the weights stay where they are and the tokens travel instead: each device takes its
    `fsdp` group's tokens through its slice of the chosen experts' `w1`/`w3` (of every local
    expert, once, where the assignments are at least as many as the local experts; gathering
    the hidden activations, or summing partial products over `fsdp` when `d_model` is what is
    split) and then its slice of `w2`, whose outputs go back to the tokens' devices, so a
    decode step moves activations, not every expert's weights."""
    mesh = jax.sharding.get_abstract_mesh()
    w1, w2 = experts.w1, experts.w2
    # A split of a quantised weight must keep its blocks whole (as `ShardingRules` places it);
    # under the release's numerics each device's share of the hidden units must also hold
    # whole 128-wide activation blocks, or its round trips would differ from one device's.
    parts = mesh_axis("tensor")
    tensor_ok = whole_blocks(w1, -2, parts) and whole_blocks(w2, -1, parts)
    if experts.numerics == RELEASE:
        tensor_ok = tensor_ok and w1.shape[-2] % (parts * ACT_BLOCK) == 0
    tensor = "tensor" if mesh_axis("tensor") > 1 and tensor_ok else None
    # The weights enter in their stored layout and are gathered here, one layer at a time: a
    # layout change demanded at the boundary would be applied to a scanned stack's whole
    # weight, before the loop.
    fsdp = "fsdp" if mesh_axis("fsdp") > 1 else None
    up = bool(fsdp) and whole_blocks(w1, -2, (parts if tensor else 1) * mesh_axis("fsdp"))
    split = {
        "w1": 1 if up else 2 if fsdp and whole_blocks(w1, -1, mesh_axis("fsdp")) else None,
        "w2": 1 if fsdp and whole_blocks(w2, -2, mesh_axis("fsdp")) else None,
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

    few = x.shape[0] * indices.shape[1] <= STATIONARY_ROWS
    if few and None not in split.values():
        local = functools.partial(
            _stationary, experts=experts, up=up, split=not spread, reduce=reduce, policy=policy
        )
    else:
        local = functools.partial(
            _gathering, experts=experts, axes=split, spread=spread, reduce=reduce, policy=policy
        )
    row = P(tokens, None)
    hidden = tuple(a for a in (tensor, fsdp if up else None) if a) or None
    if hidden is not None and len(hidden) == 1:
        hidden = hidden[0]
    w13 = P("expert", hidden, fsdp if split["w1"] == 2 else None)
    return jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(row, row, row, w13, P("expert", fsdp if split["w2"] else None, tensor), w13),
        out_specs=row,
    )(x, indices, weights, experts.w1, experts.w2, experts.w3)


def _mine(indices, weights, n_local):
    # This device's experts among the assignments: local ids (others: `n_local`, dropped) and
    # the routing weights with the others' zeroed.
    first = jax.lax.axis_index("expert") * n_local
    mine = (indices >= first) & (indices < first + n_local)
    return jnp.where(mine, indices - first, n_local), jnp.where(mine, weights, 0.0)


def _gathering(x, indices, weights, w1, w2, w3, *, experts, axes, spread, reduce, policy):
    # Many tokens: this device's experts' weights gathered over fsdp, its own tokens computed.
    def gather(w, axis):
        # A quantised weight's values and scales are gathered alike (same rank, same axes).
        if axis is None:
            return w
        return jax.tree.map(lambda a: jax.lax.all_gather(a, "fsdp", axis=axis, tiled=True), w)

    w1, w2, w3 = gather(w1, axes["w1"]), gather(w2, axes["w2"]), gather(w3, axes["w1"])
    local_ids, mine_weights = _mine(indices, weights, w1.shape[0])
    # The gathered weights are a value, not a parameter (see `dispatch`).
    y = dispatch(
        x,
        local_ids,
        mine_weights,
        w1,
        w2,
        w3,
        experts.limit,
        True,
        policy=policy,
        numerics=experts.numerics,
    )
    if spread:
        y = jnp.where(jax.lax.axis_index("fsdp") == 0, y, jnp.zeros_like(y))
        reduce += ("fsdp",)
    return jax.lax.psum(y, reduce)


def _stationary(x, indices, weights, w1, w2, w3, *, experts, up, split, reduce, policy):
    # Few tokens: the tokens of this fsdp group (gathered when `split` over fsdp) through this
    # device's slice of its experts' weights: of `w1`/`w3`'s hidden units (`up`) or of their
    # `d_model`, and of `w2`'s `d_model`; the chosen experts only where the assignments are
    # fewer than the local experts, else every local expert, once.
    if split:
        x, indices, weights = (
            jax.lax.all_gather(a, "fsdp", tiled=True) for a in (x, indices, weights)
        )
    n_local, width = w2.shape[0], w2.shape[1]
    local_ids, mine_weights = _mine(indices, weights, n_local)
    tokens, top_k = indices.shape
    rows = tokens * top_k
    if not up:
        x = jax.lax.dynamic_slice_in_dim(x, jax.lax.axis_index("fsdp") * width, width, axis=1)
    limit, numerics = experts.limit, experts.numerics
    if n_local <= rows:
        # At least as many assignments as local experts: every local expert on every token,
        # weighted by the token's routing weight for it (zero where not chosen), reads each
        # local expert once, where copying each assignment's expert out of the stack would
        # write (and read back) more than the whole stack.
        def products(a, w):  # a [tokens, ..., in] by each expert of w -> [tokens, experts, out]
            each = functools.partial(linear, dtype=jnp.float32, policy=policy)
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
        y = _assignments(x, local_ids, mine_weights, w1, w2, w3, up, experts, policy)
    if split:  # each device's tokens back to it, whole `d_model`
        return jax.lax.all_to_all(jax.lax.psum(y, reduce), "fsdp", 0, 1, tiled=True)
    # Every fsdp device holds the same tokens: its slice of `d_model` in place, summed over
    # fsdp with the rest (an all-gather would leave the result typed as varying over fsdp).
    whole = varying_like(jnp.zeros((tokens, width * mesh_axis("fsdp")), y.dtype), y)
    whole = jax.lax.dynamic_update_slice_in_dim(whole, y, jax.lax.axis_index("fsdp") * width, 1)
    return jax.lax.psum(whole, reduce + ("fsdp",))


def _assignments(x, local_ids, mine_weights, w1, w2, w3, up, experts, policy):
    # Fewer assignments than local experts: each assignment through a copy of its expert's
    # weights (the chosen experts' rows of the stack, gathered), others' assignments zeroed.
    n_local, width = w2.shape[0], w2.shape[1]
    tokens, top_k = local_ids.shape
    rows = tokens * top_k
    chosen = jnp.minimum(local_ids.reshape(rows), n_local - 1)
    x_rows = jnp.broadcast_to(x[:, None], (tokens, top_k, x.shape[1])).reshape(rows, -1)

    def product(a, w):
        return linear(a[None], w, dtype=jnp.float32, policy=policy)[0]

    g = jax.vmap(product)(x_rows, w1[chosen])
    u = jax.vmap(product)(x_rows, w3[chosen])
    if not up:
        g, u = jax.lax.psum((g, u), "fsdp")
    h = swiglu(g, u, experts.limit) * mine_weights.reshape(rows)[:, None]
    h = h.astype(x.dtype)
    if up:  # this device's hidden units, then all of its tensor slice's
        h = jax.lax.all_gather(h, "fsdp", axis=1, tiled=True)
    y = jax.vmap(product)(act_quant(h, experts.numerics), w2[chosen])
    y = jnp.where((local_ids.reshape(rows) < n_local)[:, None], y, 0.0)
    return jnp.sum(y.reshape(tokens, top_k, width), axis=1)
