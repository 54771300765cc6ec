"""The release's numerics: the quantisation round trips DeepSeek-V4 was trained with and its
official inference code applies, for `Config.numerics == "release"`.

- Activations entering a linear whose weight the release stores in FP8 or FP4 are quantised
  to FP8 e4m3 in blocks of 128 along their last axis, with power-of-two scales (the official
  `act_quant` in front of its FP8/FP4 GEMMs). The GEMM of quantised operands equals the
  matmul of their dequantised values, so here the activation makes the round trip.
- The attention's KV (window and compressed entries) makes an FP8 round trip on its non-RoPE
  dims, in blocks of 64.
- The Lightning Indexer's queries and keys are rotated by a Hadamard transform and make an FP4
  e2m1 round trip in blocks of 32; its scores are rounded to bfloat16 where the official code
  computes them in bfloat16.

These are the current official revision's: its first one cast the scaled values of the
in-place round trips (the KV's) to the input dtype instead of FP8, which made them no-ops.

A round trip: per block, `s = 2^ceil(log2(amax * (1 / max)))` (amax clamped from below as
the official kernels do), `q = cast(clip(x / s, -max, max))` rounded to nearest even, and
`q * s` back in `x`'s dtype. All of it runs in float32.
"""

import math

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float


EXACT = "exact"
RELEASE = "release"
FP8_MAX = 448.0
FP4_MAX = 6.0
ACT_BLOCK = 128
KV_BLOCK = 64
INDEX_BLOCK = 32


def _pow2_ceil(r: Array) -> Array:
    # 2^ceil(log2 r) for positive normal float32 r, from the bits (the kernels' fast_log2_ceil
    # and fast_pow2): the exponent, plus one if any mantissa bit is set.
    bits = jax.lax.bitcast_convert_type(r, jnp.uint32)
    exponent = (bits >> 23) & 0xFF
    exponent = exponent + ((bits & 0x7FFFFF) != 0).astype(jnp.uint32)
    return jax.lax.bitcast_convert_type(exponent << 23, jnp.float32)


def _blocked(x: Array, block: int) -> tuple[Array, int]:
    # x [..., n] as [..., ceil(n / block), block] float32, zero-padded (zeros leave amax alone).
    n = x.shape[-1]
    pad = -n % block
    xf = x.astype(jnp.float32)
    if pad:
        xf = jnp.pad(xf, [(0, 0)] * (x.ndim - 1) + [(0, pad)])
    return xf.reshape(*x.shape[:-1], -1, block), n


def fp8_round_trip(x: Float[Array, "*batch n"], block: int) -> Float[Array, "*batch n"]:
    """The official `act_quant(x, block, "ue8m0", inplace=True)`: FP8 e4m3 in blocks of
    `block` along the last axis, power-of-two scales, amax clamped to at least 1e-4."""
    blocks, n = _blocked(x, block)
    amax = jnp.maximum(jnp.max(jnp.abs(blocks), axis=-1, keepdims=True), 1e-4)
    s = _pow2_ceil(amax * jnp.float32(1.0 / FP8_MAX))
    q = jnp.clip(blocks / s, -FP8_MAX, FP8_MAX).astype(jnp.float8_e4m3fn)
    y = q.astype(jnp.float32) * s
    return y.reshape(*x.shape[:-1], -1)[..., :n].astype(x.dtype)


def fp4_round_trip(x: Float[Array, "*batch n"], block: int) -> Float[Array, "*batch n"]:
    """The official `fp4_act_quant(x, block, inplace=True)`: FP4 e2m1 in blocks of `block`,
    power-of-two scales, amax clamped to at least `6 * 2^-126`."""
    blocks, n = _blocked(x, block)
    amax = jnp.maximum(jnp.max(jnp.abs(blocks), axis=-1, keepdims=True), FP4_MAX * 2.0**-126)
    s = _pow2_ceil(amax * jnp.float32(1.0 / FP4_MAX))
    q = jnp.clip(blocks / s, -FP4_MAX, FP4_MAX).astype(jnp.float4_e2m1fn)
    y = q.astype(jnp.float32) * s
    return y.reshape(*x.shape[:-1], -1)[..., :n].astype(x.dtype)


def hadamard(x: Float[Array, "*batch n"]) -> Float[Array, "*batch n"]:
    """`x @ H_n / sqrt(n)` for the Sylvester (natural-order) Hadamard matrix,
    `H[i, j] = (-1)^popcount(i & j)`, `n` a power of two: a fast Walsh-Hadamard transform in
    float32 (butterflies, no matmul precision to depend on), cast back."""
    n = x.shape[-1]
    if n & (n - 1):
        raise ValueError(f"hadamard: the last axis must be a power of two, got {n}")
    y = x.astype(jnp.float32)
    lead = x.shape[:-1]
    h = 1
    while h < n:
        pairs = y.reshape(*lead, n // (2 * h), 2, h)
        a, b = pairs[..., 0, :], pairs[..., 1, :]
        y = jnp.stack([a + b, a - b], axis=-2).reshape(*lead, n)
        h *= 2
    return (y * jnp.float32(1 / math.sqrt(n))).astype(x.dtype)


def act_quant(x: Float[Array, "*batch n"], numerics: str) -> Float[Array, "*batch n"]:
    """The input of an FP8/FP4-weight linear: unchanged under `"exact"`, FP8 round trip in
    blocks of 128 under `"release"`."""
    return fp8_round_trip(x, ACT_BLOCK) if numerics == RELEASE else x


def kv_round_trip(
    kv: Float[Array, "*batch head_dim"], rope_dim: int, numerics: str
) -> Float[Array, "*batch head_dim"]:
    """A KV entry: under `"release"`, FP8 round trip of its non-RoPE dims in blocks of 64."""
    if numerics != RELEASE:
        return kv
    nope = fp8_round_trip(kv[..., : kv.shape[-1] - rope_dim], KV_BLOCK)
    return jnp.concatenate([nope, kv[..., kv.shape[-1] - rope_dim :]], axis=-1)


def index_round_trip(x: Float[Array, "*batch n"], numerics: str) -> Float[Array, "*batch n"]:
    """An indexer query or key: under `"release"`, Hadamard rotation, then FP4 round trip in
    blocks of 32."""
    if numerics != RELEASE:
        return x
    return fp4_round_trip(hadamard(x), INDEX_BLOCK)


def bf16_round(x: Array) -> Array:
    """`x` rounded to bfloat16 and back to float32."""
    return x.astype(jnp.bfloat16).astype(jnp.float32)
