"""Interleaved partial rotary position embedding on the trailing dims, with optional YaRN."""

import math

import equinox as eqx
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from ..config import Config, YarnScaling
from ._layers import f32, lead


def inverse_frequencies(dim: int, theta: float, yarn: YarnScaling | None) -> np.ndarray:
    """The `dim // 2` rotation frequencies, float32, computed as both references do.

    With YaRN (DeepSeek-V3's variant), pair `i` blends the original frequency and the one divided
    by `factor` with a linear ramp between the correction dims of `beta_fast` and `beta_slow`.
    """
    exponents = np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)
    pos_freqs = np.power(np.float32(theta), exponents, dtype=np.float32)
    inv_freq = np.float32(1.0) / pos_freqs
    if yarn is None:
        return inv_freq

    def correction_dim(rotations: float) -> float:
        original = yarn.original_max_position_embeddings
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(correction_dim(yarn.beta_fast)), 0)
    high = min(math.ceil(correction_dim(yarn.beta_slow)), dim - 1)
    if low == high:
        high += 0.001  # both references nudge the ramp like this to avoid dividing by zero
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    ramp = ramp.astype(np.float32)
    interpolated = np.float32(1.0) / (np.float32(yarn.factor) * pos_freqs)
    return interpolated * ramp + inv_freq * (np.float32(1.0) - ramp)


class RoPE(eqx.Module):
    """Rotates the trailing `dim` channels of each vector by its position.

    Channels `(2i, 2i+1)` of the rotated slice form complex number `i`, multiplied by
    `exp(i * t * inv_freq_i)`; the leading channels pass through. Angles and the rotation are
    computed in float32 and the result is cast back to the input dtype.
    """

    dim: int = eqx.field(static=True)
    theta: float = eqx.field(static=True)
    yarn: YarnScaling | None = eqx.field(static=True, default=None)

    def __check_init__(self):
        if self.dim <= 0 or self.dim % 2:
            raise ValueError(f"RoPE dim must be a positive even int, got {self.dim}")

    @classmethod
    def for_layer(cls, config: Config, compressed: bool) -> "RoPE":
        """The "compress" rope (CSA/HCA layers) or the "main" rope (sliding-only layers)."""
        if compressed:
            return cls(config.qk_rope_head_dim, config.compress_rope_theta, config.rope_scaling)
        return cls(config.qk_rope_head_dim, config.rope_theta, None)

    def __call__(
        self,
        x: Float[Array, "*batch dim"],
        positions: Int[Array, "..."],
        *,
        inverse: bool = False,
    ) -> Float[Array, "*batch dim"]:
        """**Arguments:**

        - `x`: `[*lead, *rest, width]` with `width >= dim`.
        - `positions`: integer positions shaped `lead`, a prefix of `x`'s leading axes; the axes
          in `rest` (e.g. heads) share the rotation.
        - `inverse`: rotate by `-t` instead of `t` (undoes the rotation).

        **Returns:** `x` with its trailing `dim` channels rotated.
        """
        inv_freq = jnp.asarray(inverse_frequencies(self.dim, self.theta, self.yarn))
        angles = positions.astype(jnp.float32)[..., None] * lead(inv_freq, positions.ndim + 1)
        extra = x.ndim - 1 - positions.ndim
        if extra < 0 or x.shape[: positions.ndim] != positions.shape:
            raise ValueError(
                f"positions {positions.shape} must be a prefix of x's leading axes {x.shape[:-1]}"
            )
        angles = angles.reshape(positions.shape + (1,) * extra + (self.dim // 2,))
        cos, sin = jnp.cos(angles), jnp.sin(angles)
        if inverse:
            sin = -sin
        rot = f32(x[..., x.shape[-1] - self.dim :])
        rot = rot.reshape(*rot.shape[:-1], self.dim // 2, 2)
        a, b = rot[..., 0], rot[..., 1]
        rotated = jnp.stack([a * cos - b * sin, b * cos + a * sin], axis=-1)
        rotated = rotated.reshape(*x.shape[:-1], self.dim).astype(x.dtype)
        return jnp.concatenate([x[..., : x.shape[-1] - self.dim], rotated], axis=-1)
