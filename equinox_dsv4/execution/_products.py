"""The products' forms: a linear map over a dense or quantised weight (widened to a float32
result where the backend converts 16-bit operands), the attention's grouped output projection
(one matmul per group, or one einsum), and the argmax of greedy sampling."""

import math

import jax
import jax.numpy as jnp
from jax.typing import DTypeLike
from jaxtyping import Array, Float, Int

from ..quant import LoraWeight, QuantizedWeight, dense
from ._mesh import gathered_in_steps, mesh_axis
from ._policy import Policy, resolve


def wider_dtype(
    a: Array | QuantizedWeight | LoraWeight, b: Array | QuantizedWeight | LoraWeight
) -> jnp.dtype:
    """The wider of two operands' dtypes, where mixed operands (bf16 activations against
    float32 weights, or the reverse) meet: strict dtype promotion has no bf16/f32 lattice. A
    `QuantizedWeight` counts as the dtype it dequantises to, a `LoraWeight` as its base's."""
    return max(a.dtype, b.dtype, key=lambda t: t.itemsize)


def linear(
    x: Float[Array, "*batch in"],
    weight: Float[Array, "out in"] | QuantizedWeight | LoraWeight,
    policy: Policy | None,
    *,
    dtype: DTypeLike | None = None,
    precision: jax.lax.Precision | None = None,
) -> Float[Array, "*batch out"]:
    """`x @ weight.T`, accumulated and returned in `dtype` (default: the operands' dtype).
    Where `policy` widens the operands, the product takes `linear_widened`'s form (`None`: the
    policy of the target platform). A `QuantizedWeight` is dequantised here, for this product
    only. A `LoraWeight` gives its base's product plus `scale * B (A x)` (`lora_delta`), added
    in the output dtype: with `B = 0` exactly the base's product. `precision`: as
    `jnp.einsum`'s (`HIGHEST` for float32 products that must not run at a backend's lower
    default precision)."""
    if isinstance(weight, LoraWeight):
        y = linear(x, weight.base, policy, dtype=dtype, precision=precision)
        return y + lora_delta(x, weight, policy).astype(y.dtype)
    policy = resolve(policy)
    if isinstance(weight, QuantizedWeight):
        weight = weight.dequantize()
    else:
        weight = gathered_in_steps(weight, math.prod(x.shape[:-1]), policy)
    if x.dtype != weight.dtype:
        common = wider_dtype(x, weight)
        x, weight = x.astype(common), weight.astype(common)
    out_dtype = x.dtype if dtype is None else dtype
    if policy.narrow(x):
        return linear_widened(x, weight, out_dtype)
    return jnp.einsum(
        "...i,oi->...o", x, weight, preferred_element_type=out_dtype, precision=precision
    )


def lora_delta(
    x: Float[Array, "*batch in"], weight: LoraWeight, policy: Policy | None
) -> Float[Array, "*batch out"]:
    """`scale * B (A x)` of a `LoraWeight`, float32: two thin products, never `B A`."""
    h = linear(x, weight.a, policy, dtype=jnp.float32)
    return weight.scale * linear(h, weight.b, policy, dtype=jnp.float32)


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


def grouped_linear(
    x: Float[Array, "batch seq groups group_in"],
    weight: Float[Array, "groups_x_out group_in"] | QuantizedWeight | LoraWeight,
    policy: Policy | None,
) -> Float[Array, "batch seq groups out"]:
    """Group `g` of `x` times the `g`-th of the `groups` equal row blocks of `weight`: a
    block-diagonal linear map (the attention's `wo_a`), in `x`'s dtype.

    One batched einsum, or where `policy.group_matmuls` one matmul per group (the backend runs
    the batched einsum as a matmul per token), except for `policy.few_tokens` tokens or fewer
    (a decode step), where the einsum reads the weight as stored; 16-bit ones always take the
    per-group matmuls (the einsum would convert the whole weight). Groups split over the
    `tensor` mesh axis take the einsum: each device computes its own. A `LoraWeight`'s
    adapter is `B`'s `g`-th row block times `A` on each group (`A` is shared: `B A` is the
    whole weight's update, as `merged` forms it)."""
    if isinstance(weight, LoraWeight):
        y = grouped_linear(x, weight.base, policy)
        b, s, g, _ = x.shape
        c = wider_dtype(x, weight.a)
        h = jnp.einsum(
            "bsgi,ri->bsgr", x.astype(c), weight.a.astype(c), preferred_element_type=jnp.float32
        )
        up = weight.b.reshape(g, -1, weight.rank).astype(jnp.float32)
        delta = weight.scale * jnp.einsum("bsgr,gor->bsgo", h, up)
        return y + delta.astype(y.dtype)
    policy = resolve(policy)
    b, s, g, _ = x.shape
    if not isinstance(weight, QuantizedWeight):
        weight = gathered_in_steps(weight, b * s, policy)
    w = dense(weight, x.dtype).reshape(g, -1, x.shape[-1])
    few = b * s <= policy.few_tokens
    per_group = policy.group_matmuls and (not few or policy.narrow(x))
    if mesh_axis("tensor") > 1 or not per_group:
        return jnp.einsum("bsgi,goi->bsgo", x, w)
    return jnp.stack([linear(x[:, :, i], w[i], policy) for i in range(g)], axis=2)


def argmax(logits: Float[Array, "batch vocab"], policy: Policy | None) -> Int[Array, " batch"]:
    """The first largest logit per row (NaN counting as largest), int32: `blocked_argmax` where
    `policy.blocked_argmax` (it needs the whole vocabulary on each device and int32 keys, so no
    float64 logits), else `jnp.argmax`."""
    if resolve(policy).blocked_argmax and mesh_axis("tensor") == 1 and logits.dtype.itemsize <= 4:
        return blocked_argmax(logits)
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)


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
