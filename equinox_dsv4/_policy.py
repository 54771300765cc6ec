"""Execution policy: which platform a computation is being traced for, and the forms of it that
only XLA:CPU needs.

The model's math is the same on every backend, but a few computations have a second form that
exists only for XLA:CPU (its 16-bit floats, its scheduler; benchmarks/NOTES.md says why each
was needed). They ask here which platform the trace compiles for: the platform of the mesh set
with `jax.set_mesh` if there is one (so that an ahead-of-time compile for a TPU topology, from a
CPU host, takes the forms meant for TPUs), otherwise JAX's default backend.
"""

import jax
import jax.numpy as jnp
from jaxtyping import Array


def target_platform() -> str:
    """The platform (`"cpu"`, `"gpu"`, `"tpu"`, ...) of the computation being traced: the
    platform of the context mesh (`jax.set_mesh`), else `jax.default_backend()`."""
    device = jax.sharding.get_abstract_mesh().abstract_device
    if device is not None and device.platform:
        return device.platform
    return jax.default_backend()


def narrow_on_cpu(*arrays: Array) -> bool:
    """Whether any of `arrays` holds 16-bit floats and the target is XLA:CPU, which computes
    most 16-bit operations in float32, converting their operands first (benchmarks/NOTES.md,
    items 17 and 18)."""
    return target_platform() == "cpu" and any(
        jnp.issubdtype(a.dtype, jnp.floating) and a.dtype.itemsize < 4 for a in arrays
    )
