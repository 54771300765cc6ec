"""Rank-polymorphic primitives: linear layer, embedding table, RMS normalisation.

They act on the last axis under any leading axes, unlike `eqx.nn`'s per-example layers, because
every model-level module here carries an explicit batch axis.
"""

import functools
import math
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
from jax.typing import DTypeLike
from jaxtyping import Array, Float, Int, PRNGKeyArray

from ._forms import linear_widened, set_rows_by_updates, zeros_after
from ._parallel import batch_axes
from ._policy import Policy, resolve
from ._quant import QuantizedWeight


# Std of the normal initialiser (transformers' `initializer_range`). Real weights come from a
# checkpoint; this only gives tiny random models sensible activations.
INIT_STD = 0.02


@functools.partial(jax.jit, static_argnums=1)
def _flat_normal(key: PRNGKeyArray, n: int) -> Array:
    return jr.normal(key, (n,))


def init_normal(key: PRNGKeyArray, shape: tuple[int, ...], dtype: DTypeLike) -> Array:
    """`INIT_STD * N(0, 1)` of `shape`: the first `prod(shape)` entries of a power-of-two-sized
    draw, so that eager initialisation compiles one sampler per size class instead of one per
    weight shape (which dominates the build time of small models on CPU)."""
    n = math.prod(shape)
    draw = _flat_normal(key, 1 << max(0, (n - 1).bit_length()))
    return (INIT_STD * draw[:n].reshape(shape)).astype(dtype)


def f32(x: Array) -> Array:
    """`x` in at least float32 (float64 stays float64)."""
    return x if x.dtype.itemsize >= 4 else x.astype(jnp.float32)


def lead(a: Array, ndim: int) -> Array:
    """`a` with leading unit axes up to `ndim` axes: explicit broadcasting, which the tests'
    `jax_numpy_rank_promotion="raise"` demands."""
    return a.reshape((1,) * (ndim - a.ndim) + a.shape)


def map_chunks(fn, arrays: tuple[Array, ...], size: int) -> Any:
    """`fn(*arrays)` computed in chunks of `size` along axis 1 (one loop step each), for arrays
    `[batch, n, ...]`; `fn` must treat the entries along axis 1 independently and return arrays
    `[batch, size, ...]`. Bounds the memory of per-query intermediates (attention logits, index
    scores) on long chunks.

    Each step slices its chunk and writes its results in place, so nothing is transposed and
    the outputs are created once the inputs exist (`zeros_after`; `lax.map` starts from
    constants, which XLA:CPU creates at the start of the program).
    """
    n = arrays[0].shape[1]
    if n <= size:
        return fn(*arrays)
    chunks = -(-n // size)
    padded = tuple(
        jnp.pad(a, ((0, 0), (0, chunks * size - n)) + ((0, 0),) * (a.ndim - 2)) for a in arrays
    )

    def chunk(i):
        return fn(*(jax.lax.dynamic_slice_in_dim(a, i * size, size, axis=1) for a in padded))

    shapes = jax.eval_shape(chunk, 0)
    out = jax.tree.map(
        lambda s: zeros_after((s.shape[0], chunks * size, *s.shape[2:]), s.dtype, padded[0]), shapes
    )

    def step(i, out):
        return jax.tree.map(
            lambda o, r: jax.lax.dynamic_update_slice_in_dim(o, r, i * size, axis=1),
            out,
            chunk(i),
        )

    out = jax.lax.fori_loop(0, chunks, step, out)
    return jax.tree.map(lambda a: a[:, :n], out)


def _normalized(x: Array, eps: float) -> Array:
    xf = f32(x)
    # rsqrt rather than 1/sqrt: it is what both references evaluate and rounds differently.
    return xf * jax.lax.rsqrt(jnp.mean(jnp.square(xf), axis=-1, keepdims=True) + eps)


def rms_normalize(x: Float[Array, "*batch dim"], eps: float) -> Float[Array, "*batch dim"]:
    """Unweighted RMS normalisation over the last axis, computed in float32, cast back."""
    return _normalized(x, eps).astype(x.dtype)


# Up to this many rows `set_rows` writes a widened 16-bit array with one dynamic update each (a
# decode step's cache writes); more (a prefill chunk's) take the scatter.
_FEW_WRITES = 16


def set_rows(
    a: Float[Array, "..."],
    index: tuple[Int[Array, "..."], Int[Array, "..."]],
    values: Float[Array, "..."],
    *,
    layer: Int[Array, ""] | int | None = None,
    policy: Policy | None = None,
) -> Float[Array, "..."]:
    """`a.at[index].set(values, mode="drop")` for `index = (rows, cols)`, both non-negative: row
    `cols[w]` of sequence `rows[w]` becomes `values[w]`; an index past the end writes nothing.
    With `layer`, `a` is a stack of such arrays (a layer stack's cache, `[layers, batch,
    length, ...]`) and the rows are written into its layer `layer`, in place.

    Where `policy` widens `a`'s dtype, a few rows are written as dynamic updates
    (`set_rows_by_updates`), not with the batch split over devices (where an update at a traced
    row could gather the array). `policy=None`: the policy of the target platform.
    """
    values = values.astype(a.dtype)
    rows, cols = index
    lead = () if layer is None else (layer,)
    if a.shape[len(lead) + 1] == 0:
        # No rows to write (e.g. HCA entries of a sequence shorter than one block): JAX cannot
        # differentiate a scatter into an empty axis.
        return a
    narrow = resolve(policy).narrow(a)
    batch = a.shape[len(lead)]
    if not narrow or rows.size > _FEW_WRITES or batch_axes(batch):
        return a.at[(*lead, rows, cols)].set(values, mode="drop")
    return set_rows_by_updates(a, lead, rows, cols, values)


def einsum_f32(spec: str, a: Array, b: Array) -> Array:
    """`jnp.einsum(spec, a, b)` of two activations, accumulated in and returned as float32
    (bfloat16 products are exact in float32)."""
    return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32)


def wider_dtype(a: Array | QuantizedWeight, b: Array | QuantizedWeight) -> jnp.dtype:
    """The wider of two operands' dtypes, where mixed operands (bf16 activations against
    float32 weights, or the reverse) meet: strict dtype promotion has no bf16/f32 lattice. A
    `QuantizedWeight` counts as the dtype it dequantises to."""
    return max(a.dtype, b.dtype, key=lambda t: t.itemsize)


def linear(
    x: Float[Array, "*batch in"],
    weight: Float[Array, "out in"] | QuantizedWeight,
    *,
    dtype: DTypeLike | None = None,
    policy: Policy | None = None,
    precision: jax.lax.Precision | None = None,
) -> Float[Array, "*batch out"]:
    """`x @ weight.T`, accumulated and returned in `dtype` (default: the operands' dtype).
    Where `policy` widens the operands, the product takes `linear_widened`'s form.
    `policy=None`: the policy of the target platform. A `QuantizedWeight` is dequantised
    here, for this product only. `precision`: as `jnp.einsum`'s (`HIGHEST` for float32
    products that must not run at a backend's lower default precision)."""
    if isinstance(weight, QuantizedWeight):
        weight = weight.dequantize()
    if x.dtype != weight.dtype:
        common = wider_dtype(x, weight)
        x, weight = x.astype(common), weight.astype(common)
    out_dtype = x.dtype if dtype is None else dtype
    if resolve(policy).narrow(x):
        return linear_widened(x, weight, out_dtype)
    return jnp.einsum(
        "...i,oi->...o", x, weight, preferred_element_type=out_dtype, precision=precision
    )


class Linear(eqx.Module):
    """`y = x @ weight.T` without bias; `weight` is stored `(out, in)` as in the checkpoints,
    dense or as the release's block-quantised `QuantizedWeight`."""

    weight: Float[Array, "out in"] | QuantizedWeight
    axes: tuple[str | None, str | None] = eqx.field(static=True)

    def __init__(
        self,
        in_features: int,
        out_features: int,
        axes: tuple[str | None, str | None] = (None, None),
        *,
        key: PRNGKeyArray,
        dtype: DTypeLike = jnp.float32,
    ):
        """**Arguments:**

        - `in_features`, `out_features`: input and output widths.
        - `axes`: logical axis names of `weight`'s `(out, in)` dims, which the sharding rules
          map to mesh axes (`None`: replicated).
        - `key`: PRNG key for the normal initialiser.
        - `dtype`: parameter dtype.
        """
        self.weight = init_normal(key, (out_features, in_features), dtype)
        self.axes = axes

    def param_axes(self, name: str) -> tuple[str | None, ...]:
        del name
        return self.axes

    def __call__(
        self,
        x: Float[Array, "*batch in"],
        *,
        dtype: DTypeLike | None = None,
        policy: Policy | None = None,
    ) -> Float[Array, "*batch out"]:
        """**Arguments:**

        - `x`: input `[..., in]`.
        - `dtype`: output dtype, and the accumulation dtype of the matmul; defaults to
          `x.dtype`. With bfloat16 operands and `dtype=float32` this equals a float32 matmul of
          the upcast operands (bf16 products are exact in float32) without copying the weight.
        - `policy`: the execution policy (`None`: the target platform's).

        **Returns:** `[..., out]`.
        """
        return linear(x, self.weight, dtype=dtype, policy=policy)


class Embedding(eqx.Module):
    """Token embedding table `[vocab, d_model]`."""

    weight: Float[Array, "vocab d_model"]

    def __init__(
        self, vocab_size: int, dim: int, *, key: PRNGKeyArray, dtype: DTypeLike = jnp.float32
    ):
        self.weight = init_normal(key, (vocab_size, dim), dtype)

    def param_axes(self, name: str) -> tuple[str | None, ...]:
        del name
        return ("vocab", "embed")

    def __call__(self, ids: Int[Array, "*batch"]) -> Float[Array, "*batch d_model"]:
        return jnp.take(self.weight, ids, axis=0)


class RMSNorm(eqx.Module):
    """Weighted RMSNorm: `y = w * x * rsqrt(mean(x^2) + eps)`.

    The weight is kept in float32 and the product is taken in float32 before the cast back to
    the input dtype, as in the official DeepSeek-V4 code.
    """

    weight: Float[Array, " dim"]
    eps: float = eqx.field(static=True)

    def __init__(self, dim: int, eps: float = 1e-6):
        self.weight = jnp.ones((dim,), jnp.float32)
        self.eps = eps

    def param_axes(self, name: str) -> tuple[str | None, ...]:
        del name
        return (None,)  # small: replicated

    def __call__(self, x: Float[Array, "*batch dim"]) -> Float[Array, "*batch dim"]:
        y = _normalized(x, self.eps)
        return (lead(f32(self.weight), y.ndim) * y).astype(x.dtype)
