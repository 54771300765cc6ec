"""Block-quantised weights: the release's FP8 and FP4 storage, kept as it is in memory.

The release stores its dense projections as FP8 e4m3 with one power-of-two scale per 128 x 128
block, and its routed experts as FP4 e2m1 (two per byte, the low nibble the even column) with
one power-of-two scale per 32 inputs. A `QuantizedWeight` holds those bytes and scales as
pytree leaves; whoever multiplies by it dequantises it inside the computation (`dense`), one
matmul's operand at a time, so a model's resident weights stay at the release's size.

Scales are `uint8` exponents (`ue8m0`: the multiplier `2^(byte - 127)`) or float32 multipliers
(transformers' `weight_scale_inv`). With ue8m0 scales dequantisation is exact in float32 and
bfloat16: an e4m3 or e2m1 value times a power of two is representable in both.
"""

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import DTypeLike
from jaxtyping import Array, Float, Shaped

from .._typecheck import typechecked


FP8 = "e4m3"
FP4 = "e2m1"
FP8_MAX = 448.0
FP4_MAX = 6.0
FP4_BLOCK = (1, 32)


class QuantizedWeight(eqx.Module):
    """A block-quantised weight of logical shape `[*lead, out, in]` (HF `(out, in)` layout,
    optionally stacked along leading axes: layers, experts).

    - `values`: `float8_e4m3fn [*lead, out, in]` (`fmt="e4m3"`) or `uint8 [*lead, out, in/2]`,
      two e2m1 codes per byte, the low nibble the even column (`fmt="e2m1"`).
    - `scale`: `[*lead, ceil(out/bo), ceil(in/bi)]` for `block = (bo, bi)`: `uint8` ue8m0
      exponents or float32 multipliers.
    - `dtype`: what it dequantises to (the model's parameter dtype).

    It answers `shape`, `ndim`, `dtype` and leading-axis indexing (`w[e]`, `w[indices]`) like
    the dense array it stands for, and `dense` turns it into that array.
    """

    values: Shaped[Array, "*lead out stored"]
    scale: Shaped[Array, "*lead out_blocks in_blocks"]
    fmt: str = eqx.field(static=True)
    block: tuple[int, int] = eqx.field(static=True)
    dtype: Any = eqx.field(static=True, converter=jnp.dtype)

    def __check_init__(self):
        if self.fmt not in (FP8, FP4):
            raise ValueError(f"QuantizedWeight: fmt must be {FP8!r} or {FP4!r}, got {self.fmt!r}")
        stored = jnp.float8_e4m3fn if self.fmt == FP8 else jnp.uint8
        if self.values.dtype != stored:
            raise ValueError(
                f"QuantizedWeight: {self.fmt} values must be {jnp.dtype(stored).name}, got "
                f"{self.values.dtype}"
            )
        if self.scale.dtype != jnp.uint8 and not jnp.issubdtype(self.scale.dtype, jnp.floating):
            raise ValueError(
                f"QuantizedWeight: scales must be uint8 (ue8m0) or floats, got {self.scale.dtype}"
            )
        if self.values.ndim != self.scale.ndim or self.values.ndim < 2:
            raise ValueError(
                f"QuantizedWeight: values {self.values.shape} and scale {self.scale.shape} must "
                "have the same rank (at least 2)"
            )
        grid = scale_grid(self.shape, self.block)
        if tuple(self.scale.shape) != grid:
            raise ValueError(
                f"QuantizedWeight: scale shape {tuple(self.scale.shape)} does not match weight "
                f"{self.shape} in blocks of {self.block} (expected {grid})"
            )

    @property
    def shape(self) -> tuple[int, ...]:
        *lead, out, stored = self.values.shape
        return (*lead, out, 2 * stored if self.fmt == FP4 else stored)

    @property
    def ndim(self) -> int:
        return self.values.ndim

    @property
    def split_block(self) -> tuple[int, int]:
        """The granularity of a split of the last two dims across devices: whole blocks, and
        for FP4 (routed experts) multiples of 32 along both dims, so that an expert's `w1`,
        `w2` and `w3` (whose 32-wide blocks lie along different dims) split alike."""
        return (32, 32) if self.fmt == FP4 else self.block

    @property
    def nbytes(self) -> int:
        """Bytes held: values plus scales."""
        return sum(int(np.prod(a.shape)) * jnp.dtype(a.dtype).itemsize for a in self._arrays())

    def _arrays(self):
        return (self.values, self.scale)

    def __getitem__(self, index: Any) -> "QuantizedWeight":
        """Index the leading (stacking) axes only; the block dims stay whole."""
        parts = index if isinstance(index, tuple) else (index,)
        if len(parts) > self.ndim - 2 or any(p is Ellipsis for p in parts):
            raise IndexError(
                f"QuantizedWeight {self.shape}: only the {self.ndim - 2} leading axes can be "
                f"indexed, got {index!r}"
            )
        return QuantizedWeight(
            self.values[index], self.scale[index], self.fmt, self.block, self.dtype
        )

    def dequantize(self, dtype: DTypeLike | None = None) -> Float[Array, "*lead out in"]:
        """The dense weight in `dtype` (default `self.dtype`); exact."""
        dtype = self.dtype if dtype is None else dtype
        codes = _e2m1(self.values) if self.fmt == FP4 else self.values
        # Power-of-two (ue8m0) scales are exact in any float dtype; other float scales are
        # applied in float32, then rounded once.
        work = dtype if self.scale.dtype == jnp.uint8 else jnp.float32
        scaled = _apply_scale(codes.astype(work), multipliers(self.scale, work), self.block)
        return scaled.astype(dtype)


@typechecked
def dequantize_host(
    values: np.ndarray, scale: np.ndarray, block: tuple[int, int] | None = None
) -> np.ndarray:
    """Float32 weights from a checkpoint's stored values and scales (host arrays), computed on
    the host's CPU (`QuantizedWeight.dequantize`, exact): FP8 (`float8_e4m3fn` values, one
    scale per `block`) or FP4 (e2m1 packed two per byte, `int8` or `uint8`, one scale per 32
    inputs). Scales: ue8m0 (`float8_e8m0fnu`, or `uint8` exponents) or float multipliers."""
    if values.dtype.itemsize == 1 and np.issubdtype(values.dtype, np.integer):
        fmt, values, block = FP4, values.view(np.uint8), FP4_BLOCK
    elif values.dtype == jnp.float8_e4m3fn:
        fmt = FP8
        if block is None:
            raise ValueError("dequantize_host: FP8 values need their block size")
    else:
        raise ValueError(
            f"dequantize_host: values must be float8_e4m3fn (FP8) or packed int8/uint8 (FP4), "
            f"got {values.dtype}"
        )
    if scale.dtype.name == "float8_e8m0fnu":
        scale = scale.view(np.uint8)  # the byte is the exponent, as ue8m0 defines it
    elif scale.dtype != np.uint8:
        scale = scale.astype(np.float32)
    with jax.default_device(jax.local_devices(backend="cpu")[0]):
        # device_put, not jnp.asarray: the latter compiles a copy program per shape.
        weight = QuantizedWeight(
            jax.device_put(values), jax.device_put(scale), fmt, block, jnp.float32
        )
        return np.asarray(_dequantized(weight))


@eqx.filter_jit
def _dequantized(weight: QuantizedWeight) -> Array:
    return weight.dequantize()


def dense(weight: Any, dtype: DTypeLike) -> Array:
    """`weight` as a dense array of `dtype`: a `QuantizedWeight` dequantised, an array cast."""
    if isinstance(weight, QuantizedWeight):
        return weight.dequantize(dtype)
    return weight.astype(dtype)


def scale_grid(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, ...]:
    """The scale shape of a weight of logical `shape` in blocks of `block` (ceil-divided)."""
    *lead, rows, cols = shape
    return (*lead, -(-rows // block[0]), -(-cols // block[1]))


def whole_blocks(weight: Any, axis: int, parts: int) -> bool:
    """Whether `weight` splits into `parts` equal pieces along `axis` (negative: from the end)
    such that no quantisation block straddles two pieces. Any split that divides the size does
    for a dense array."""
    shape = weight.shape
    axis %= len(shape)
    size = shape[axis]
    if isinstance(weight, QuantizedWeight) and axis >= len(shape) - 2:
        return size % (parts * weight.split_block[axis - len(shape) + 2]) == 0
    return size % parts == 0


def multipliers(scale: Array, dtype: DTypeLike = jnp.float32) -> Array:
    """The scale multipliers in `dtype`: `2^(byte - 127)` of ue8m0 bytes, built from the bits
    (exact, unlike `exp2`), or float multipliers cast."""
    if scale.dtype != jnp.uint8:
        return scale.astype(dtype)
    # Byte 0 (2^-127, a subnormal) comes out 0, as it would flushed.
    bits = scale.astype(jnp.uint32) << 23
    return jax.lax.bitcast_convert_type(bits, jnp.float32).astype(dtype)


def _e2m1(packed: Array) -> Array:
    # Packed bytes [..., n] -> float32 e2m1 values [..., 2n], from the bits: sign (bit 3),
    # exponent (bits 1-2, bias 1), mantissa (bit 0); exponent 0 is the subnormal 0 or 0.5.
    nibbles = jnp.stack([packed & 0xF, packed >> 4], axis=-1).astype(jnp.uint32)
    sign = (nibbles >> 3) << 31
    exponent = (nibbles >> 1) & 3
    mantissa = nibbles & 1
    normal = ((exponent + 126) << 23) | (mantissa << 22)
    bits = sign | jnp.where(exponent == 0, mantissa * jnp.uint32(126 << 23), normal)
    values = jax.lax.bitcast_convert_type(bits, jnp.float32)
    return values.reshape(*packed.shape[:-1], 2 * packed.shape[-1])


def _apply_scale(values: Array, scale: Array, block: tuple[int, int]) -> Array:
    # values [..., rows, cols] times the scale entry of each (bo, bi) block.
    *lead, rows, cols = values.shape
    sr, sc = scale.shape[-2:]
    bo, bi = block
    if rows != sr * bo or cols != sc * bi:  # partial edge blocks
        full = jnp.repeat(jnp.repeat(scale, bo, axis=-2), bi, axis=-1)
        return values * full[..., :rows, :cols]
    blocks = values.reshape(*lead, sr, bo, sc, bi) * scale[..., :, None, :, None]
    return blocks.reshape(values.shape)


def _exponents(amax: Array, top: float) -> Array:
    # ceil(log2(amax / top)) exactly (frexp, not log2), as ue8m0 bytes; an all-zero block
    # gets the smallest scale.
    mantissa, exponent = jnp.frexp(jnp.maximum(amax, 1e-30) / top)
    e = jnp.where(mantissa == 0.5, exponent - 1, exponent)
    return jnp.clip(e + 127, 0, 254).astype(jnp.uint8)


def _block_amax(w: Array, block: tuple[int, int]) -> Array:
    *lead, rows, cols = w.shape
    sr, sc = -(-rows // block[0]), -(-cols // block[1])
    padded = jnp.pad(
        jnp.abs(w), [(0, 0)] * len(lead) + [(0, sr * block[0] - rows), (0, sc * block[1] - cols)]
    )
    return jnp.max(padded.reshape(*lead, sr, block[0], sc, block[1]), axis=(-3, -1))


@typechecked
def quantize(
    w: Float[Array, "*lead out in"], fmt: str, block: tuple[int, int] = (128, 128)
) -> QuantizedWeight:
    """`w` in the release's storage: a power-of-two scale per block, `2^ceil(log2(amax / max))`
    with `max` 448 (e4m3) or 6 (e2m1), and each value rounded to nearest (ties to even).
    `fmt="e2m1"` always uses 1 x 32 blocks and needs an even `in`."""
    dtype = w.dtype
    if fmt == FP4:
        block = FP4_BLOCK
        if w.shape[-1] % 2:
            raise ValueError(f"quantize: e2m1 packs two values per byte; in={w.shape[-1]} is odd")
    w32 = w.astype(jnp.float32)
    scale = _exponents(_block_amax(w32, block), FP8_MAX if fmt == FP8 else FP4_MAX)
    scaled = _apply_scale(w32, 1.0 / multipliers(scale), block)
    if fmt == FP8:
        values = jnp.clip(scaled, -FP8_MAX, FP8_MAX).astype(jnp.float8_e4m3fn)
    else:
        codes = jax.lax.bitcast_convert_type(
            jnp.clip(scaled, -FP4_MAX, FP4_MAX).astype(jnp.float4_e2m1fn), jnp.uint4
        ).astype(jnp.uint8)
        values = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return QuantizedWeight(values, scale, fmt, block, dtype)
