"""The layer loop's drivers: a period body (the layers of one repeat of a stacked segment, in
order) run over the repeats by `lax.scan` or by a Python loop over the same stacked weights,
with the weights and caches routed through the loop as the policy says, caches updated in
place on request, and rematerialisation for training."""

import typing
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array

from ._policy import Policy, resolve
from ._schedule import index_after, take_layer


# `remat` policies for training: what a layer keeps for the backward pass (the rest is
# recomputed). "nothing": only the residual streams between layers; "dots": also the outputs of
# the weight matmuls (those without a batch dimension in the contraction).
REMAT_POLICIES = {
    "nothing": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def with_remat(fn: Callable, remat: str | None) -> Callable:
    """`fn` rematerialised under `REMAT_POLICIES[remat]` (unchanged for `None`)."""
    if remat is None:
        return fn
    if remat not in REMAT_POLICIES:
        raise ValueError(f"remat must be None or one of {sorted(REMAT_POLICIES)}, got {remat!r}")
    # prevent_cse=False: inside a scan the loop already keeps XLA from merging recomputation
    # with the forward pass, and CSE barriers would only slow the unrolled case.
    return jax.checkpoint(fn, policy=REMAT_POLICIES[remat], prevent_cse=False)


class InPlace(typing.NamedTuple):
    """How a loop keeps some of its stacked arrays whole: of the caches, those that grow with
    the context (which a donated cache then updates in place); of the weights, those that a
    layer reads only a few rows of. `split(tree) -> (whole, rest)` takes them out of the
    stacked tree, and `join(rest, whole, layer)` puts them back, with `layer` (an index into
    their leading axis) a view through which one layer reads (and writes into) the whole
    stacks, or with `None` as they were."""

    split: Callable[[Any], tuple[Any, Any]]
    join: Callable[[Any, Any, Array | int | None], Any]


def run_layers(
    period: Callable[[Any, Any, Any], tuple[Any, Any, Any]],
    x: Any,
    weights: Any,
    caches: Any,
    policy: Policy | None,
    *,
    repeats: int,
    scan: bool,
    remat: str | None = None,
    in_place: InPlace | None = None,
    views: InPlace | None = None,
) -> tuple[Any, Any, Any]:
    """`for r in range(repeats): x, caches[r], stats[r] = period(x, weights[r], caches[r])`,
    `x` a pytree of carried values (the residual streams first).

    **Arguments:**

    - `period`: one repeat of the segment, `(x, weights, caches) -> (x, caches, stats)`.
    - `weights`, `caches`: pytrees stacked along a leading `repeats` axis.
    - `scan`: the driver, `lax.scan` over the repeats, or (`False`, and for one repeat) a
      Python loop over the same stacked weights (more to compile, the same numbers).
    - `policy`: where the weights and caches travel (`Route`) and when the Python loop takes
      each layer's slices (`Policy.late_slices`).
    - `remat`: a rematerialisation policy (`REMAT_POLICIES`) for each period.
    - `in_place`: keep part of the caches whole, each layer writing into them (`InPlace`);
      otherwise each layer's caches are sliced out and stacked anew.
    - `views`: keep part of the weights whole, each layer reading them through a view
      (`InPlace`; no gradient: a view's would be a whole stack per layer); otherwise each
      layer's slices are taken by the driver.

    **Returns:** `(x, caches, stats)`, the caches and stats stacked along `repeats`.
    """
    policy = resolve(policy)
    scan = scan and repeats > 1
    whole_weights, weights = views.split(weights) if views else (None, weights)
    route = Route.decide(policy, weights, scan=scan, in_place=in_place is not None)

    def body_period(x, weights, caches):
        # This layer's slice of the stacked weights, fixed here: otherwise XLA may move a
        # conversion in front of the slicing and out of the loop, materialising a converted
        # copy of the whole stack (`Route.carry_weights` for a backend that converts in
        # front of the slicing itself). A stack of one is its parameters.
        if repeats > 1 and policy.barrier_slices:
            weights = jax.lax.optimization_barrier(weights)
        return period(x, weights, caches)

    body_period = with_remat(body_period, remat)
    whole, rest = in_place.split(caches) if in_place else (None, caches)
    held = {"whole": whole} if in_place else {}
    swept = {}
    (held if route.carry_weights else swept)["weights"] = weights
    (held if route.carry_cache else swept)["cache"] = rest

    def body(carry, xs):
        # One period: layer r's weights and cache, from the carry (indexed) or swept.
        x, held = carry
        r, swept = xs
        if route.carry_weights:
            held = jax.lax.optimization_barrier(held)
        layer = {k: jax.tree.map(lambda a: a[r], v) for k, v in held.items() if k != "whole"}
        layer.update(swept)
        cache = layer["cache"]
        if in_place:
            cache = in_place.join(cache, held["whole"], r)
        weights = layer["weights"]
        if views:  # the whole stacks as constants of the loop
            weights = views.join(weights, whole_weights, r)
        x, new, stats = body_period(x, weights, cache)
        held = dict(held)
        if in_place:
            held["whole"], new = in_place.split(new)
        out = {"stats": stats}
        if route.carry_cache:
            held["cache"] = jax.tree.map(lambda a, n: a.at[r].set(n), held["cache"], new)
        else:
            out["cache"] = new
        return (x, held), out

    if scan:
        (x, held), out = jax.lax.scan(body, (x, held), (jnp.arange(repeats), swept))
    else:
        (x, held), out = _python_loop(body, (x, held), swept, repeats, policy)
    rest = held["cache"] if route.carry_cache else out["cache"]
    caches = in_place.join(rest, held["whole"], None) if in_place else rest
    return x, caches, out["stats"]


class Route(typing.NamedTuple):
    """Where a layer stack's weights and caches travel through the layer loop: in the loop's
    carry (each period indexes its layer out of the whole stack), or swept (the scan's `xs`,
    or sliced per layer by the Python loop). Caches' arrays kept whole always ride in the
    carry."""

    carry_weights: bool
    carry_cache: bool

    @classmethod
    def decide(cls, policy: Policy, weights: Any, *, scan: bool, in_place: bool) -> "Route":
        # Swept, a 16-bit stack is a loop-invariant operand of the scan, and a backend that
        # widens 16-bit floats hoists its conversion out of the loop: the whole stack
        # converted on every call. In the carry, through a barrier, XLA sees it change. The
        # caches ride along with the weights, except in place (then only their fixed-size
        # rest is swept, stacked anew).
        widen = scan and policy.carries(*jax.tree.leaves(weights))
        return cls(carry_weights=widen, carry_cache=widen and not in_place)


def _python_loop(body, carry, swept, n: int, policy: Policy):
    # The second driver: `lax.scan`'s contract, unrolled. Layer r's slices are taken when the
    # loop reaches it (`index_after` where the policy asks for late slices); a stack of one
    # is its only layer.
    outs = []
    for r in range(n):
        after = jax.tree.leaves(carry[0])[0]
        i = r if n == 1 or not policy.late_slices else index_after(r, after)
        layer = jax.tree.map(lambda a, i=i, r=r: take_layer(a, i, r), swept)
        carry, out = body(carry, (i, layer))
        outs.append(out)
    if n == 1:
        return carry, jax.tree.map(lambda a: a[None], outs[0])
    return carry, jax.tree.map(lambda *a: jnp.stack(a), *outs)
