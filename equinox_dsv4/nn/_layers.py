"""Rank-polymorphic primitives: linear layer, embedding table, RMS normalisation.

They act on the last axis under any leading axes, unlike `eqx.nn`'s per-example layers, because
every model-level module here carries an explicit batch axis.
"""

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
from jax.typing import DTypeLike
from jaxtyping import Array, Float, Int, PRNGKeyArray

from ..execution import Policy, linear, policy_field
from ..quant import LoraWeight, QuantizedWeight


# Std of the normal initialiser (transformers' `initializer_range`). Real weights come from a
# checkpoint; this only gives tiny random models sensible activations.
INIT_STD = 0.02


@functools.partial(jax.jit, static_argnums=(1, 2))
def init_normal(key: PRNGKeyArray, shape: tuple[int, ...], dtype: DTypeLike) -> Array:
    """`INIT_STD * N(0, 1)` of `shape`, in `dtype` (one compiled sampler per shape: drawn op by
    op, each of its primitives would be compiled for each shape)."""
    return (INIT_STD * jr.normal(key, shape, jnp.float32)).astype(dtype)


def f32(x: Array) -> Array:
    """`x` in at least float32 (float64 stays float64)."""
    return x if x.dtype.itemsize >= 4 else x.astype(jnp.float32)


def lead(a: Array, ndim: int) -> Array:
    """`a` with leading unit axes up to `ndim` axes: explicit broadcasting, which the tests'
    `jax_numpy_rank_promotion="raise"` demands."""
    return a.reshape((1,) * (ndim - a.ndim) + a.shape)


def _normalized(x: Array, eps: float) -> Array:
    xf = f32(x)
    # rsqrt rather than 1/sqrt: it is what both references evaluate and rounds differently.
    return xf * jax.lax.rsqrt(jnp.mean(jnp.square(xf), axis=-1, keepdims=True) + eps)


def rms_normalize(x: Float[Array, "*batch dim"], eps: float) -> Float[Array, "*batch dim"]:
    """Unweighted RMS normalisation over the last axis, computed in float32, cast back."""
    return _normalized(x, eps).astype(x.dtype)


def einsum_f32(spec: str, a: Array, b: Array) -> Array:
    """`jnp.einsum(spec, a, b)` of two activations, accumulated in and returned as float32
    (bfloat16 products are exact in float32)."""
    return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32)


class Linear(eqx.Module):
    """`y = x @ weight.T` without bias; `weight` is stored `(out, in)` as in the checkpoints,
    dense, as the release's block-quantised `QuantizedWeight`, or either with a LoRA adapter
    beside it (`LoraWeight`). The product takes the form
    its execution `policy` says (see `execution.with_policy`)."""

    weight: Float[Array, "out in"] | QuantizedWeight | LoraWeight
    axes: tuple[str | None, str | None] = eqx.field(static=True)
    policy: Policy | None = policy_field()

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
        self.policy = None

    def param_axes(self, name: str) -> tuple[str | None, ...]:
        del name
        return self.axes

    def __call__(
        self,
        x: Float[Array, "*batch in"],
        *,
        dtype: DTypeLike | None = None,
    ) -> Float[Array, "*batch out"]:
        """**Arguments:**

        - `x`: input `[..., in]`.
        - `dtype`: output dtype, and the accumulation dtype of the matmul; defaults to
          `x.dtype`. With bfloat16 operands and `dtype=float32` this equals a float32 matmul of
          the upcast operands (bf16 products are exact in float32) without copying the weight.

        **Returns:** `[..., out]`.
        """
        return linear(x, self.weight, self.policy, dtype=dtype)


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
