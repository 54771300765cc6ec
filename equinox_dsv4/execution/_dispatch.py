"""The routed experts on one device: each (token, expert) assignment through its expert, with
the work proportional to `num_experts_per_tok`, never to the number of experts (`dispatch`).
With many assignments (a prefill, a train step) they are sorted by expert and run by the
policy's kernel: the expert loop (`expert_mlps`) or `jax.lax.ragged_dot`; with few (decoding)
each assignment runs through its own expert, and only the chosen experts' weights are read.
"""

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from ..quant import LoraWeight, QuantizedWeight, act_quant, base_of
from ._expert_loop import _expert_block, _over_experts, expert_mlps, swiglu, varying_like
from ._policy import Policy, resolve
from ._products import linear, wider_dtype


# Rows per block at most 2**7: of 64, 128 and 256 the fastest 2048-token prefill on XLA:CPU.
MAX_BLOCK_LOG2 = 7
# The expert loop pads each expert's rows to a multiple of this (its short blocks' size).
TAIL_ROWS = 16


def dispatch(
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
    *,
    at_once: int | None = None,
) -> Float[Array, "tokens d_model"]:
    """Routed experts for the (token, expert) assignments, computed only where assigned. An
    assignment to expert `experts` (out of range) is dropped. With a `layer`, the weights are
    a layer stack's, `[layers, experts, ...]`, and the experts are layer `layer`'s
    (`of_layer`).

    With more assignments than experts (prefill), the assignments are sorted by expert and run
    by `policy.experts`' kernel: `"loop"`, each expert's group padded to `TAIL_ROWS` and run
    in blocks through that expert in a loop over experts (`expert_mlps`), which reads each
    expert's weights once; `"ragged"`, `jax.lax.ragged_dot` over the sorted rows (dense
    weights only: quantised ones take the loop, which dequantises one expert at a time). With
    `at_once`, the ragged form runs at most that many assignments at a time, in rounds, each
    its own share of the sorted rows, for as many rounds as the assignments kept need
    (`_ragged_rounds`): expert parallelism's assignments are mostly other devices', dropped
    here, and a buffer for every one would be sized for the worst case. With
    at most one assignment per expert on average (decoding), each assignment runs through its
    own expert, reading only the `top_k` chosen experts per token: in a loop over
    assignments, one expert's weights at a time, or with `policy.gather_experts` the chosen
    experts' weights gathered at once and the products batched (for weights that are a value,
    not a parameter: a slice of a scanned layer stack, weights gathered across devices, which
    a loop would copy whole to pass in). Every product is laid out by `policy` (`None`: the
    target platform's). A `LoraWeight` stack runs its adapters in every form, on the rows
    its expert takes, beside the base's products (`linear`). `numerics`: under `"release"`,
    each expert's hidden activation makes the FP8 round trip before `w2` (`act_quant`); `x`
    is the caller's to quantise.

    **Returns:** float32 `sum_j weights[:, j] * expert_{indices[:, j]}(x)`; with many
    assignments each one's output is rounded to `x.dtype` before the sum.
    """
    policy = resolve(policy)
    act = (limit, numerics)
    tokens, top_k = indices.shape
    n_experts = w1.shape[-3]
    rows = tokens * top_k
    expert = indices.reshape(rows)
    if layer is not None and not (rows <= n_experts and policy.gather_experts):
        # Only the gather of the chosen experts reads a layer stack in place.
        w1, w2, w3 = (of_layer(w, layer) for w in (w1, w2, w3))
        layer = None
    if rows <= n_experts:
        run = _gathered if policy.gather_experts else _one_by_one
        x_rows = jnp.broadcast_to(x[:, None], (tokens, top_k, x.shape[-1])).reshape(rows, -1)
        chosen = jnp.minimum(expert, n_experts - 1)  # a dropped one: any, zeroed below
        if layer is not None:  # one gather from the stack at [layer, expert]
            chosen = (jnp.asarray(layer, chosen.dtype), chosen)
        ys = run(x_rows, weights.reshape(rows), chosen, w1, w2, w3, act, policy)
        ys = jnp.where((expert < n_experts)[:, None], ys, 0.0)
        return jnp.sum(ys.reshape(tokens, top_k, -1), axis=1)
    quantized = isinstance(base_of(w1), QuantizedWeight)
    if policy.experts == "ragged" and not quantized:
        if at_once is not None and at_once < rows:
            return _ragged_rounds(x, weights, expert, top_k, w1, w2, w3, act, at_once)
        ys = _ragged(x, weights, expert, top_k, w1, w2, w3, act)
        return jnp.sum(ys.reshape(tokens, top_k, -1).astype(jnp.float32), axis=1)
    # Block size: about one block per expert at this load, a power of two in [1, 128].
    block = 1 << max(0, min(MAX_BLOCK_LOG2, math.ceil(math.log2(max(1, rows // n_experts)))))
    pad = min(TAIL_ROWS, block)
    size = _padded_rows(rows, n_experts, pad)

    order = jnp.argsort(expert, stable=True)
    counts = jnp.bincount(expert, length=n_experts)  # the dropped expert is not counted
    padded = -(-counts // pad) * pad
    padded_end = jnp.cumsum(padded)
    padded_start = padded_end - padded
    sorted_start = jnp.cumsum(counts) - counts
    # Padded row p: its expert, its rank in the expert's group, and the assignment it holds.
    p = jnp.arange(size)
    e = jnp.minimum(jnp.searchsorted(padded_end, p, side="right"), n_experts - 1)
    rank = p - padded_start[e]
    held = rank < counts[e]
    assignment = order[jnp.where(held, sorted_start[e] + rank, 0)]
    xs = x[assignment // top_k]  # rows holding none: any token, with weight 0
    ws = jnp.where(held, weights.reshape(rows)[assignment], 0.0)

    ys = expert_mlps(xs, ws, w1, w2, w3, padded_start, padded, act, block, pad, policy)
    # Each assignment's padded row, read back per token: a gather, no scatter.
    position = jnp.zeros((rows,), jnp.int32).at[order].set(jnp.arange(rows, dtype=jnp.int32))
    safe = jnp.minimum(expert, n_experts - 1)
    row = padded_start[safe] + position - sorted_start[safe]
    ys = jnp.where((expert < n_experts)[:, None], ys[jnp.minimum(row, size - 1)], 0.0)
    return jnp.sum(ys.reshape(tokens, top_k, -1).astype(jnp.float32), axis=1)


# `ragged_dot_general` of rows [m, in] sorted by group and a stack [groups, out, in] as stored
# (HF `(out, in)` layout): row i through the weight of its group.
_RAGGED = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([1], [2]), ([], [])),
    lhs_ragged_dimensions=[0],
    rhs_group_dimensions=[0],
)
# Its gradients: the output's [m, out] through each row's group's weight, [m, in]; and per
# group, its rows' outputs' and inputs' products summed over the rows, [groups, out, in].
_RAGGED_ROWS_BACK = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([1], [1]), ([], [])),
    lhs_ragged_dimensions=[0],
    rhs_group_dimensions=[0],
)
_RAGGED_WEIGHTS_BACK = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([0], [0]), ([], [])),
    lhs_ragged_dimensions=[0],
    rhs_group_dimensions=[],
)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _grouped_product(a, w, counts, precision):
    # `ragged_dot_general(a, w, counts, _RAGGED)` in float32, whose gradients come out of
    # their products in `a`'s and `w`'s dtypes, the weights' as stored: through
    # `ragged_dot_general`'s own transpose both came out in float32, the weights' transposed,
    # and were converted after, whole (docs/design.md, "Grouped products' gradients").
    return _grouped_product_fwd(a, w, counts, precision)[0]


def _grouped_product_fwd(a, w, counts, precision):
    y = jax.lax.ragged_dot_general(
        a, w, counts, _RAGGED, precision=precision, preferred_element_type=jnp.float32
    )
    return y, (a, w, counts)


def _grouped_product_bwd(precision, residuals, g):
    a, w, counts = residuals
    da = jax.lax.ragged_dot_general(
        g, w, counts, _RAGGED_ROWS_BACK, precision=precision, preferred_element_type=a.dtype
    )
    dw = jax.lax.ragged_dot_general(
        g, a, counts, _RAGGED_WEIGHTS_BACK, precision=precision, preferred_element_type=w.dtype
    )
    return da, dw, None


_grouped_product.defvjp(_grouped_product_fwd, _grouped_product_bwd)


def _alike(*operands: Any) -> tuple[Any, ...]:
    # `operands`, each varying over the mesh axes of all of them (none outside `shard_map`).
    # Widened inside the products, an operand's widening would transpose to a sum across
    # devices that `ragged_dot`'s own transpose leaves out (an input's gradient under expert
    # parallelism would then miss the other devices' experts' share), and inside a round
    # that some devices run and others skip, that sum would deadlock.
    return tuple(jax.tree.map(lambda a: varying_like(a, operands), o) for o in operands)


def _ragged(x, weights, expert, top_k, w1, w2, w3, act):
    # The assignments sorted by expert (the dropped ones last, outside every group), the three
    # products as ragged dots over the groups, each assignment's output rounded to x.dtype as
    # the loop's are, then back in assignment order: [rows, d_model].
    x, weights, expert, w1, w2, w3 = _alike(x, weights, expert, w1, w2, w3)
    n_experts = w1.shape[0]
    order = jnp.argsort(expert, stable=True)
    counts = jnp.bincount(expert, length=n_experts).astype(jnp.int32)
    ys = _grouped_mlp(x[order // top_k], weights.reshape(-1)[order], counts, w1, w2, w3, act)
    position = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))
    return jnp.where((expert < n_experts)[:, None], ys[position], 0)


def _ragged_rounds(x, weights, expert, top_k, w1, w2, w3, act, size, hidden=None):
    # The assignments to kept experts (`expert` below `n_experts`) by ragged dots, `size` of
    # them at a time (`in_rounds`), each round's groups cut to their part of its window,
    # outputs added into their tokens' float32 sums. `hidden`: see `_grouped_mlp` (a
    # collective there must be over devices that run the same rounds; the caller is
    # `_stationary`, whose rows are its fsdp group's). The gradient is that of one round of
    # every row (`_rounds_one_back`), except with `hidden`: every row of the group is fsdp
    # times a device's own tokens', and one round of them all read more than the loop's
    # transpose by libtpu's count (docs/design.md).
    operands = _alike(x, weights, expert, w1, w2, w3)
    rows = functools.partial(_ragged_rows, top_k=top_k, act=act, hidden=hidden)
    if hidden is not None:
        return rows(size, *operands)
    return _rounds_one_back(rows, size, *operands)


def _ragged_rows(size, x, weights, expert, w1, w2, w3, *, top_k, act, hidden):
    counts = jnp.bincount(expert, length=w1.shape[0]).astype(jnp.int32)
    ends = jnp.cumsum(counts)
    flat_weights = weights.reshape(-1)

    def run(y, start, picked, held):
        token = picked // top_k
        sizes = jnp.clip(ends - start, 0, size) - jnp.clip(ends - counts - start, 0, size)
        ys = _grouped_mlp(x[token], flat_weights[picked], sizes, w1, w2, w3, act, hidden)
        # The rows a round holds no assignment in are dropped by their index (out of range),
        # not zeroed first: a select over every row was written and read again.
        target = jnp.where(held, token, x.shape[0])
        return y.at[target].add(ys.astype(jnp.float32), mode="drop")

    y = varying_like(jnp.zeros((x.shape[0], w2.shape[1]), jnp.float32), x)
    return in_rounds(y, expert, w1.shape[0], size, run)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _rounds_one_back(rows, size, *operands):
    # `rows(size, *operands)`, whose gradient is that of `rows(every row, *operands)`: one
    # round, no loop. Differentiated through the rounds, a loop's transpose carried every
    # round's share of the weights' cotangents and stacked every round's residuals: by
    # libtpu's count, more bytes and temporaries than one buffer (a train step).
    return rows(size, *operands)


def _rounds_one_back_fwd(rows, size, *operands):
    return rows(size, *operands), operands


def _rounds_one_back_bwd(rows, size, operands, grad):
    every = operands[2].shape[0]  # `expert`: one key per row
    return jax.vjp(lambda *o: rows(every, *o), *operands)[1](grad)


_rounds_one_back.defvjp(_rounds_one_back_fwd, _rounds_one_back_bwd)


def in_rounds(y: Any, keys: Array, n: int, size: int, run: Any) -> Any:
    """Rows whose `keys` are below `n` (the kept ones), sorted by key, `size` at a time: round
    `r` calls `run(y, start, picked, held)` with `start = r * size`, the `size` row indices
    from `start` in that order (`picked`) and which of them are kept (`held`), and returns the
    new `y`. A loop over every round the rows could need (all of them kept) in which a round
    past the kept rows does nothing: the work follows the kept rows, `size` at a time, and
    none is dropped however many there are. Collectives inside `run` must be over devices
    that hold the same kept rows (the same rounds run)."""
    rows = keys.shape[0]
    rounds = -(-rows // size)
    order = jnp.pad(jnp.argsort(keys, stable=True), (0, rounds * size - rows))
    kept = jnp.sum(keys < n)
    if rounds == 1:
        # No loop and no skip (a round of no kept rows leaves `y` as it is): differentiated,
        # a loop of one carried zero-filled cotangents of everything `run` reads, the
        # experts' weights among them (a train step's backward, `_rounds_one_back`).
        return run(y, jnp.int32(0), order, jnp.arange(size) < kept)

    def one_round(y, start):
        def go(y):
            picked = jax.lax.dynamic_slice_in_dim(order, start, size)
            return run(y, start, picked, start + jnp.arange(size) < kept)

        return jax.lax.cond(start < kept, go, lambda y: y, y), None

    return jax.lax.scan(one_round, y, jnp.arange(rounds, dtype=jnp.int32) * size)[0]


def _grouped_mlp(xs, ws, counts, w1, w2, w3, act, hidden=None):
    # Rows sorted by expert (`counts[e]` rows of expert e in order, any rows after them
    # outside every group) through their experts by ragged dots, each row's hidden
    # activation weighted by its routing weight `ws` and its output rounded to xs.dtype.
    # `hidden` maps the weighted hidden activations to `w2`'s input (where `w1`/`w3` hold a
    # slice of the hidden units and `w2` all of them: the slices gathered).
    limit, numerics = act
    c = wider_dtype(xs, w1)
    # 16-bit operands' products are exact in the float32 accumulator at any precision; a
    # `HIGHEST` default would ask TPU's ragged-dot kernel for a float32 contraction it refuses.
    precision = jax.lax.Precision.DEFAULT if jnp.dtype(c).itemsize < 4 else None

    def product(a, w):
        if isinstance(w, LoraWeight):  # the adapter's two thin ragged products beside the base's
            delta = w.scale * product(product(a, w.a), w.b)
            return product(a, w.base) + delta
        return _grouped_product(a.astype(c), w.astype(c), counts, precision)

    g, u = product(xs, w1), product(xs, w3)
    h = (swiglu(g, u, limit) * ws[:, None]).astype(xs.dtype)
    h = act_quant(h if hidden is None else hidden(h), numerics)
    return product(h, w2).astype(xs.dtype)


def _one_by_one(xs, ws, chosen, w1, w2, w3, act, policy):
    # A loop over assignments, each copying its expert's weights out of the stack; the copies
    # share one buffer. Unrolled, every copy got its own, temporaries that malloc mapped
    # fresh, page faults included, on every token.
    def one(_, w, a):
        x, wt = a
        return None, _expert_row(x, wt, *w, act, policy)

    return _over_experts(one, None, (w1, w2, w3), chosen, (xs, ws), policy)[1]


def of_layer(w: Any, layer: Int[Array, ""] | int | None) -> Any:
    """Layer `layer`'s experts of a stack `w` (`[layers, experts, ...]`); `w` itself for
    `None` (`w` is one layer's experts)."""
    return w if layer is None else w[layer]


def _gathered(xs, ws, chosen, w1, w2, w3, act, policy):
    # The chosen experts' weights in one gather (from a layer stack in place where `chosen`
    # holds the layer too), the products batched over assignments. In a scanned layer stack,
    # XLA fuses the gather with the layer's slicing and reads only the chosen experts; a loop
    # would get the layer's slice of every expert copied in.
    one = functools.partial(_expert_row, act=act, policy=policy)
    return jax.vmap(one)(xs, ws, w1[chosen], w2[chosen], w3[chosen])


def _expert_row(x, w, w1e, w2e, w3e, act, policy):
    # One assignment (a row `x` with routing weight `w`) through one expert, float32.
    return _expert_block(x[None], w[None], w1e, w2e, w3e, act, x.dtype, policy)[0]


def _padded_rows(rows: int, n_experts: int, pad: int) -> int:
    # Room for `rows` sorted rows when each expert's group is padded to a multiple of `pad`: at
    # most min(E, rows) groups are partial.
    return -(-(rows + min(n_experts, rows) * (pad - 1)) // pad) * pad


def _assignment_rows(x_rows, ids, row_weights, w1, w2, w3, layer, up, act, policy):
    # Each row through its expert's weights (`ids`: local experts; `n_local`, another
    # device's: zeroed). Each product reads its expert's weights where they lie in the stack
    # (a layer stack's, with `layer`): a dynamic slice that XLA fuses into the product.
    # Gathered into one array for batched products, the chosen experts' weights were
    # written, copied and read again (the TPU compiler's count, one sequence decoding).
    # `up`: the weights hold this device's slice of the hidden units (True: gathered over
    # fsdp before `w2`) or of `d_model` (False: partial products summed over fsdp), or are
    # whole (None).
    n_local = w2.shape[-3]
    rows = ids.shape[0]
    chosen = jnp.minimum(ids, n_local - 1)

    def products(a, w):  # row r of a [rows, in] by its expert's w -> [rows, out]
        def one(r):
            expert = w[chosen[r]] if layer is None else w[layer, chosen[r]]
            return linear(a[r][None], expert, policy, dtype=jnp.float32)[0]

        return jnp.stack([one(r) for r in range(rows)])

    g, u = products(x_rows, w1), products(x_rows, w3)
    if up is False:
        g, u = jax.lax.psum((g, u), "fsdp")
    h = swiglu(g, u, act[0]) * row_weights[:, None]
    h = h.astype(x_rows.dtype)
    if up:  # this device's hidden units, then all of its tensor slice's
        h = jax.lax.all_gather(h, "fsdp", axis=1, tiled=True)
    y = products(act_quant(h, act[1]), w2)
    return jnp.where((ids < n_local)[:, None], y, 0.0)


def _own_rounds(x, local_ids, mine_weights, w1, w2, w3, layer, up, act, policy, size):
    # This device's own assignments only, `size` at a time (`in_rounds`), through
    # `_assignment_rows`, their outputs added into their tokens' float32 rows: each round
    # reads `size` experts (or their slices), not one per assignment of the group's tokens.
    # With `up` (`_stationary`'s hidden units split over fsdp) every device of an fsdp group
    # holds the same tokens and experts and runs the same rounds, which meet in their fsdp
    # collectives; without (`_exchange._owned`'s whole experts) a round holds none. Every
    # operand varies over the same mesh axes first (`_alike`), so no other collective lands
    # in a round, which some devices skip.
    n_local, width = w2.shape[-3], w2.shape[-2]
    tokens, top_k = local_ids.shape
    ids = local_ids.reshape(-1)
    x, ids, mine_weights, w1, w2, w3 = _alike(x, ids, mine_weights, w1, w2, w3)
    flat_weights = mine_weights.reshape(-1)

    def run(y, start, picked, held):
        token, chosen = picked // top_k, jnp.where(held, ids[picked], n_local)
        rows = (x[token], chosen, flat_weights[picked])
        return y.at[token].add(_assignment_rows(*rows, w1, w2, w3, layer, up, act, policy))

    y = varying_like(jnp.zeros((tokens, width), jnp.float32), x)
    return in_rounds(y, ids, n_local, size, run)
