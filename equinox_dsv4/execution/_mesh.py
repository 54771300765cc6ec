"""What the forward pass needs to know about the device mesh it runs on.

The mesh comes from JAX's own context (`with jax.set_mesh(mesh):`, which `equinox_dsv4.shard`'s
users and `generate` set), so it is part of every trace's cache key. Mesh axes are named by
convention: `data` and `fsdp` split the batch, `tensor` splits heads and hidden MLP units,
`expert` splits the routed experts. A missing axis, or one of size 1, is not used.
"""

import jax
from jax.sharding import PartitionSpec as P
from jaxtyping import Array


BATCH_AXES = ("data", "fsdp")


def mesh_axis(name: str) -> int:
    """Size of a mesh axis in the current context (1 when absent or no mesh)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or name not in mesh.axis_names:
        return 1
    return mesh.shape[name]


def batch_axes(size: int) -> tuple[str, ...] | None:
    """The mesh axes that split a batch dimension of `size` (those that divide it)."""
    axes: list[str] = []
    for name in BATCH_AXES:
        n = mesh_axis(name)
        if n > 1 and size % (n * _product(axes)) == 0:
            axes.append(name)
    return tuple(axes) or None


def _product(axes: list[str]) -> int:
    out = 1
    for a in axes:
        out *= mesh_axis(a)
    return out


def constrain_batch(x: Array) -> Array:
    """Shard `x`'s leading (batch) axis over the batch mesh axes, the rest replicated: the layout
    at block boundaries. A no-op without a mesh."""
    if jax.sharding.get_abstract_mesh().empty:
        return x
    spec = P(batch_axes(x.shape[0]), *(None,) * (x.ndim - 1))
    return jax.lax.with_sharding_constraint(x, spec)
