"""Forms for a scheduler that creates values as early as it can (XLA:CPU's breadth-first
default): values computed from a loop's input instead of constants, so that they come into
being where the loop needs them, and chunked maps that write in place."""

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.typing import DTypeLike
from jaxtyping import Array


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


def map_chunks(fn: Callable[..., Any], arrays: tuple[Array, ...], size: int, parts: int = 1) -> Any:
    """`fn(*arrays)` computed in chunks of `size` along axis 1 (one loop step each), for arrays
    `[batch, n, ...]`; `fn` must treat the entries along axis 1 independently and return arrays
    `[batch, size, ...]`. Bounds the memory of per-query intermediates (attention logits, index
    scores) on long chunks.

    With `parts > 1` (dividing `n`), axis 1 is split over devices in `parts` contiguous parts
    (`sequence_parts`): each step takes `size` entries of every part, so that each device
    works on its own entries, and `size` bounds a device's share. Chunks of axis 1 as a whole
    would be sliced out of a split axis: each device would gather every step's inputs and
    outputs, and compute on entries that are not its own.

    Each step slices its chunk and writes its results in place, so nothing is transposed and
    the outputs are created once the inputs exist (`zeros_after`; `lax.map` starts from
    constants, which XLA:CPU creates at the start of the program).
    """
    n = arrays[0].shape[1]
    if parts > 1:
        if n % parts:
            raise ValueError(f"map_chunks: {parts} parts do not divide axis 1 of size {n}")
        split = tuple(a.reshape(a.shape[0], parts, n // parts, *a.shape[2:]) for a in arrays)

        def joined(*xs):  # [b, parts, m, ...] -> fn on [b, parts * m, ...], split back
            out = fn(*(x.reshape(x.shape[0], x.shape[1] * x.shape[2], *x.shape[3:]) for x in xs))
            return jax.tree.map(
                lambda o: o.reshape(o.shape[0], parts, o.shape[1] // parts, *o.shape[2:]), out
            )

        out = _chunked(joined, split, size, axis=2)
        return jax.tree.map(lambda o: o.reshape(o.shape[0], n, *o.shape[3:]), out)
    return _chunked(fn, arrays, size, axis=1)


def _chunked(fn: Callable[..., Any], arrays: tuple[Array, ...], size: int, axis: int) -> Any:
    # `fn` over chunks of `size` along `axis` of `arrays`, in a loop writing in place.
    n = arrays[0].shape[axis]
    if n <= size:
        return fn(*arrays)
    chunks = -(-n // size)

    def pad(a):
        widths = [(0, 0)] * a.ndim
        widths[axis] = (0, chunks * size - n)
        return jnp.pad(a, widths)

    padded = tuple(pad(a) for a in arrays)

    def chunk(i):
        return fn(*(jax.lax.dynamic_slice_in_dim(a, i * size, size, axis=axis) for a in padded))

    shapes = jax.eval_shape(chunk, 0)

    def buffer(s):
        shape = list(s.shape)
        shape[axis] = chunks * size
        return zeros_after(tuple(shape), s.dtype, padded[0])

    out = jax.tree.map(buffer, shapes)

    def step(i, out):
        return jax.tree.map(
            lambda o, r: jax.lax.dynamic_update_slice_in_dim(o, r, i * size, axis=axis),
            out,
            chunk(i),
        )

    out = jax.lax.fori_loop(0, chunks, step, out)
    return jax.tree.map(lambda a: jax.lax.slice_in_dim(a, 0, n, axis=axis), out)
