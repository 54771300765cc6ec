"""Dequantisation of the release's FP8 (block-scaled e4m3) and FP4 (packed e2m1) weights.

FP8: `W[i, j] = e4m3(Q[i, j]) * S[i // bm, j // bn]` with `(bm, bn)` the config's
`weight_block_size` (128 x 128) and one scale per block, the grid ceil-divided.
FP4 (routed experts): each int8 byte packs two e2m1 values, the low nibble the even column;
`W[i, j] = e2m1(i, j) * S[i, j // 32]`.
Scales are `ue8m0` (F8_E8M0, the multiplier `2^(byte - 127)`), raw `uint8` exponents, or plain
floats (transformers' `weight_scale_inv`). All arithmetic is float32 and exact: e4m3 and e2m1
values times a power of two are representable.
"""

import ml_dtypes
import numpy as np


FP4_BLOCK = (1, 32)
# e2m1 nibble -> value; bit 3 is the sign.
FP4_VALUES = np.array(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
    np.float32,
)


def scale_multipliers(scale: np.ndarray) -> np.ndarray:
    """Float32 multipliers from a scale tensor of any supported encoding."""
    if scale.dtype == ml_dtypes.float8_e8m0fnu:
        return scale.astype(np.float32)
    if scale.dtype == np.uint8:
        return np.exp2(scale.astype(np.float32) - 127.0)
    if np.issubdtype(scale.dtype, np.floating) or scale.dtype == ml_dtypes.bfloat16:
        return scale.astype(np.float32)
    raise ValueError(f"unsupported scale dtype {scale.dtype}")


def scale_grid(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, ...]:
    """The scale shape for a weight of logical `shape` (any leading dims, then rows, cols)."""
    rows, cols = shape[-2:]
    return (*shape[:-2], -(-rows // block[0]), -(-cols // block[1]))


def apply_block_scale(values: np.ndarray, scale: np.ndarray, block: tuple[int, int]) -> np.ndarray:
    """`values * scale` with each scale entry covering a `block` of the last two dims (the last
    blocks may be partial)."""
    *lead, rows, cols = values.shape
    sr, sc = scale.shape[-2:]
    padded = np.zeros((*lead, sr * block[0], sc * block[1]), np.float32)
    padded[..., :rows, :cols] = values
    blocks = padded.reshape(*lead, sr, block[0], sc, block[1])
    blocks *= scale_multipliers(scale)[..., :, None, :, None]
    return padded[..., :rows, :cols]


def dequantize_fp8(
    weight: np.ndarray, scale: np.ndarray, block: tuple[int, int] = (128, 128)
) -> np.ndarray:
    """Float32 weights from e4m3 values and their per-block scales."""
    return apply_block_scale(weight.astype(np.float32), scale, block)


def unpack_fp4(packed: np.ndarray) -> np.ndarray:
    """Float32 e2m1 values from int8 bytes holding two each (low nibble = even column)."""
    u = packed.view(np.uint8)
    values = np.stack([FP4_VALUES[u & 0xF], FP4_VALUES[u >> 4]], axis=-1)
    return values.reshape(*packed.shape[:-1], 2 * packed.shape[-1])


def dequantize_fp4(packed: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """Float32 weights from packed FP4 values and one scale per 32 inputs."""
    return apply_block_scale(unpack_fp4(packed), scale, FP4_BLOCK)
