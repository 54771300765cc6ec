"""Execution policy: the forms the model's computations take on the backend they compile for.

The math is the same under every policy. A few computations have a second form that exists
only for one backend (XLA:CPU computes 16-bit floats in float32 and schedules breadth first);
`Policy` says which forms a program uses. It is decided once, where a computation enters
`jit` (`DeepseekV4.__call__` / `streams` / `mtp_logits` / `decode` / `forward`, `generate`'s
steps, the train step), from the platform the arrays live on, and handed down explicitly: it
is static, so each policy is its own compiled program, and a test can run any policy on any
machine.

The forms themselves live in `_forms.py`; benchmarks/NOTES.md has the measurements behind each.
"""

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax.typing import DTypeLike
from jaxtyping import Array


@dataclasses.dataclass(frozen=True)
class Policy:
    """How the layer loop and the primitives are laid out.

    - `platform`: what the policy was decided for (informative; the fields decide).
    - `widen_16bit`: the backend computes 16-bit floats in float32, converting operands first
      (XLA:CPU). Then 16-bit products take a float32 result (`linear_widened`), a few rows
      of a 16-bit cache are written as dynamic updates, not a scatter (`set_rows`), and a
      loop's 16-bit output buffer is held in float32 and rounded to 16 bits as it leaves the
      loop (`held_dtype`: XLA:CPU converts a 16-bit buffer whole around each dynamic update
      of it).
    - `carry_stacks`: for the same reason, 16-bit layer stacks ride in the layer scan's carry,
      through a barrier, so that their conversion cannot be hoisted in front of the loop,
      whole (`Route`).
    - `late_slices`: the scheduler creates values as early as it can (XLA:CPU's breadth-first
      default). Then an unrolled loop over stacked layers takes layer `r`'s slices, and loops
      their zero-initialised carries, only once the residual streams exist.
    - `group_matmuls`: the attention's grouped output projection runs as one matmul per group
      (XLA:CPU runs the batched einsum as per-token matmuls), except for a few tokens (a
      decode step), where the batched einsum reads `wo_a` as stored; 16-bit ones always
      (XLA:CPU would convert all of `wo_a` for the einsum).
    - `blocked_argmax`: greedy sampling takes block maxima of an order-preserving integer key,
      then an argmax inside the winning block (XLA:CPU's argmax is a scalar reduction).
    - `gather_experts`: decoding's routed experts gather the chosen experts' weights and batch
      the products, instead of a loop over assignments. Set by the layer loop, where the
      expert weights are slices of a stack (values, which a loop would copy whole), not by the
      platform.
    """

    platform: str = "generic"
    widen_16bit: bool = False
    carry_stacks: bool = False
    late_slices: bool = False
    group_matmuls: bool = False
    blocked_argmax: bool = False
    gather_experts: bool = False

    @classmethod
    def for_platform(cls, platform: str) -> "Policy":
        """The policy for programs compiled for `platform` (`"cpu"`, `"gpu"`, `"tpu"`, ...)."""
        if platform != "cpu":
            return cls(platform)
        return cls(
            platform,
            widen_16bit=True,
            carry_stacks=True,
            late_slices=True,
            group_matmuls=True,
            blocked_argmax=True,
        )

    @classmethod
    def for_arrays(cls, *trees: Any) -> "Policy":
        """The policy for the platform that the arrays in `trees` live on (`platform_of`)."""
        return cls.for_platform(platform_of(*trees))

    def narrow(self, *arrays: Array) -> bool:
        """Whether any of `arrays` is a 16-bit float that the backend widens (`widen_16bit`)."""
        return self.widen_16bit and _any_16bit(arrays)

    def held_dtype(self, dtype: DTypeLike) -> jnp.dtype:
        """The dtype a loop holds an output buffer of `dtype` values in, updated a block at a
        time: float32 for a 16-bit float the backend widens (`widen_16bit`), else `dtype`."""
        dtype = jnp.dtype(dtype)
        return jnp.dtype(jnp.float32) if self.widen_16bit and _is_16bit(dtype) else dtype

    def carries(self, *arrays: Array) -> bool:
        """Whether a layer scan over stacks holding `arrays` carries them (`carry_stacks`:
        some are 16-bit floats)."""
        return self.carry_stacks and _any_16bit(arrays)

    def per_group_projection(self, o: Array) -> bool:
        """Whether the grouped output projection of `o` `[batch, seq, ...]` takes one matmul
        per group (`group_matmuls`)."""
        few = o.shape[0] * o.shape[1] <= _FEW_TOKENS
        return self.group_matmuls and (not few or self.narrow(o))


# Tokens up to which `group_matmuls` keeps the batched einsum.
_FEW_TOKENS = 16


def _is_16bit(dtype: jnp.dtype) -> bool:
    return jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize < 4


def _any_16bit(arrays) -> bool:
    return any(_is_16bit(a.dtype) for a in arrays)


def resolve(policy: Policy | None, *trees: Any) -> Policy:
    """`policy`, or where it is `None` the policy for the arrays of `trees` (`for_arrays`; with
    none, for the context mesh or the default backend): for the components' own entry points
    and primitives, which are also called outside the model."""
    return Policy.for_arrays(*trees) if policy is None else policy


def platform_of(*trees: Any) -> str:
    """The platform of the computation on these arrays: the platform of the context mesh
    (`jax.set_mesh`, so that an ahead-of-time compile for a TPU topology from a CPU host is a
    TPU program), else of the first concrete array or sharded `ShapeDtypeStruct` among the
    leaves, else JAX's default backend (tracers carry no devices)."""
    device = jax.sharding.get_abstract_mesh().abstract_device
    if device is not None and device.platform:
        return device.platform
    for leaf in jax.tree.leaves(trees):
        if isinstance(leaf, jax.Array) and not isinstance(leaf, jax.core.Tracer):
            return next(iter(leaf.devices())).platform
        sharding = getattr(leaf, "sharding", None)
        if isinstance(leaf, jax.ShapeDtypeStruct) and isinstance(sharding, jax.sharding.Sharding):
            devices = getattr(sharding, "device_set", None)
            if devices:
                return next(iter(devices)).platform
    return jax.default_backend()
