"""The second forms of a few computations, for XLA:CPU's 16-bit floats and its scheduler.

Each computes exactly what its plain form computes; `Policy` (`_policy.py`) says which form a
program takes. Why each exists is said at the form; the measurements are in
benchmarks/NOTES.md.
"""

import functools

import jax
import jax.numpy as jnp
from jax.typing import DTypeLike
from jaxtyping import Array, Float, Int


def zeros_after(shape: tuple[int, ...], dtype: DTypeLike, after: Array) -> Array:
    """Zeros of `shape` that XLA cannot create before `after` exists: a loop's initial carry.

    A constant is ready when the program starts, and XLA:CPU's default scheduler (breadth
    first) creates it there, so every layer's zero-initialised loop carry lived from the start
    of the call to its loop. An `optimization_barrier` does not prevent that (XLA removes it
    before scheduling); a value computed from `after` does. It is `min(|a|, 0)` of one element
    `a`, which is 0 unless `a` is NaN (then every entry is NaN). Elsewhere it costs one scalar.
    No gradient flows to `after`: its cotangent would be a zero array of `after`'s size (XLA
    does not know the derivative is zero), seen at 8 GiB per attention layer in a train step.
    """
    a = jax.lax.stop_gradient(after.reshape(-1)[0])
    return jnp.broadcast_to(jnp.minimum(jnp.abs(a), 0).astype(dtype), shape)


def index_after(r: int, after: Array) -> Array:
    """`r`, as a value computed from `after`: an unrolled loop's layer index. With static
    slices XLA:CPU's scheduler took every layer's at the start of the program (the stacked
    weights once more). A NaN in `after`, in one sequence, must not pick another layer for the
    others."""
    zero = zeros_after((), jnp.float32, after)
    return r + jnp.where(jnp.isnan(zero), 0.0, zero).astype(jnp.int32)


def take_layer(a: Array, i: Array | int, r: int) -> Array:
    """Layer `i` of a stack `a` (a copy), where `i` is `r` (static) as a value
    (`index_after`); the gradient is that of the static slice."""
    if isinstance(i, int):
        return a[i]
    if not jnp.issubdtype(a.dtype, jnp.inexact):
        return jax.lax.dynamic_index_in_dim(a, i, keepdims=False)
    return _index(a, i, r)


@functools.partial(jax.custom_jvp, nondiff_argnums=(2,))
def _index(a: Array, i: Array, r: int) -> Array:
    return jax.lax.dynamic_index_in_dim(a, i, keepdims=False)


@_index.defjvp
def _index_jvp(r, primals, tangents):
    # The tangent is the static slice, so the gradient is its transpose, a pad. A dynamic
    # index's transpose would write each layer's gradient into a zero stack of its own.
    a, i = primals
    return _index(a, i, r), tangents[0][r]


def set_rows_by_updates(
    a: Float[Array, "..."],
    lead: tuple[Int[Array, ""] | int, ...],
    rows: Int[Array, "..."],
    cols: Int[Array, "..."],
    values: Float[Array, "..."],
) -> Float[Array, "..."]:
    """`a.at[(*lead, rows, cols)].set(values, mode="drop")` as one conditional dynamic update
    per row, in place. XLA:CPU runs a 16-bit array's scatter in float32, converting the whole
    array there and back: a decode step's cache writes read and wrote each cache twice."""
    batch, length = a.shape[len(lead) : len(lead) + 2]
    zeros = (0,) * (a.ndim - len(lead) - 2)
    values = values.reshape(-1, *(1,) * (len(lead) + 2), *a.shape[len(lead) + 2 :])

    def write(a, v, r, c):
        return jax.lax.dynamic_update_slice(a, v, (*lead, r, c, *zeros))

    def keep(a, v, r, c):
        return a

    for r, c, v in zip(rows.reshape(-1), cols.reshape(-1), values, strict=True):
        # Conditional: writing back the old row instead (a select of the update against a
        # dynamic slice of `a`) XLA:CPU computed in float32, and inside a loop (a scanned
        # stack's cache) it then updated a copy of the whole array.
        a = jax.lax.cond((r < batch) & (c < length), write, keep, a, v, r, c)
    return a


def linear_widened(x: Array, weight: Array, out_dtype: DTypeLike) -> Array:
    """`x @ weight.T` of 16-bit operands with a float32 result, cast to `out_dtype`.

    XLA:CPU's 16-bit matmul kernel takes 16-bit operands with a float32 result only; any other
    16-bit product it computes in float32 after converting both operands, the weight included,
    on every call. A single row is a matrix-vector product, which has no 16-bit kernel at all:
    it gets a second, zero row. The sum is rounded once all the same.
    """
    rows = 1
    for n in x.shape[:-1]:
        rows *= n
    if rows == 1:
        two = jnp.concatenate([x.reshape(1, -1), jnp.zeros((1, x.shape[-1]), x.dtype)])
        y = jnp.einsum("ri,oi->ro", two, weight, preferred_element_type=jnp.float32)
        y = y[0].reshape(*x.shape[:-1], -1)
    else:
        y = jnp.einsum("...i,oi->...o", x, weight, preferred_element_type=jnp.float32)
    return y.astype(out_dtype)


def blocked_argmax(logits: Float[Array, "batch vocab"]) -> Int[Array, " batch"]:
    """`jnp.argmax(logits, axis=-1)` (the first largest; NaN counts as largest), as block
    maxima and then an argmax inside the winning block. XLA:CPU runs `argmax` as a scalar
    (value, index) reduction; `max` over integers vectorizes, so each logit is mapped to an
    `int32` with the same order (`order_key`) and only the winning block gets an argmax."""
    b, v = logits.shape
    # The largest divisor of v up to sqrt(v): no padding (which XLA:CPU would copy).
    c = max(d for d in range(1, int(v**0.5) + 1) if v % d == 0)
    blocks = order_key(logits).reshape(b, v // c, c)
    best = jnp.argmax(jnp.max(blocks, axis=-1), axis=-1)
    row = jnp.take_along_axis(blocks, best[:, None, None], axis=1)[:, 0]
    return (best * c + jnp.argmax(row, axis=-1)).astype(jnp.int32)


def order_key(x: Float[Array, "*shape"]) -> Int[Array, "*shape"]:
    """An `int32` per float with `argmax`'s order: the float order, `-0.0 == 0.0`, NaN above
    `inf`."""
    x = x.astype(jnp.float32)
    bits = jax.lax.bitcast_convert_type(jnp.where(x == 0, 0.0, x), jnp.int32)
    # A negative float's magnitude grows with its low 31 bits: flip them to reverse its order.
    key = jnp.where(bits < 0, bits ^ jnp.int32(0x7FFFFFFF), bits)
    return jnp.where(jnp.isnan(x), jnp.iinfo(jnp.int32).max, key)
