"""What the forward pass needs to know about the device mesh it runs on.

The mesh comes from JAX's own context (`with jax.set_mesh(mesh):`, which `equinox_dsv4.shard`'s
users and `generate` set), so it is part of every trace's cache key. Mesh axes are named by
convention: `data` and `fsdp` split the batch, `tensor` splits heads and hidden MLP units,
`expert` splits the routed experts. A missing axis, or one of size 1, is not used.
"""

import jax
from jax.sharding import PartitionSpec as P
from jaxtyping import Array

from ._policy import Policy


BATCH_AXES = ("data", "fsdp")
# The mesh axes that split the dense weights' `d_model` by default on a TPU mesh
# (`parallel.FSDP_EXPERT_RULES`): a decode step's activations split the same way.
EMBED_AXES = ("fsdp", "expert")
# The mesh axes that split the input dim of the queries' second projections by default
# (logical `q_lora_in`: `wq_b`, the indexer's `wq_b`).
Q_LORA_AXES = ("fsdp",)


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


def constrain_batch(x: Array, policy: Policy | None = None) -> Array:
    """The layout of activations `x` (`[batch, chunk, ..., d_model]`) at block boundaries:
    split along the batch over the batch mesh axes, the rest replicated. A chunk of at most
    `policy.stationary_tokens` tokens in all (a decode step) is split along `d_model` over
    `EMBED_AXES` instead, as the dense weights' `d_model` is (the default placement on a TPU
    mesh with `expert`): each device then multiplies its slice of every dense weight,
    and the products' partial sums and the activations travel, where split along the batch
    every device would gather every dense weight whole. A chunk of at least
    `policy.split_chunks` tokens per sequence is split along the sequence over `expert` too. A
    no-op without a mesh."""
    if jax.sharding.get_abstract_mesh().empty:
        return x
    axes = _stationary_axes(x.shape[0] * x.shape[1], x.shape[-1], policy)
    if axes:
        return jax.lax.with_sharding_constraint(x, P(*(None,) * (x.ndim - 1), axes))
    seq = "expert" if sequence_parts(x.shape[1], policy) > 1 else None
    spec = P(batch_axes(x.shape[0]), seq, *(None,) * (x.ndim - 2))
    return jax.lax.with_sharding_constraint(x, spec)


def sequence_parts(chunk: int, policy: Policy | None) -> int:
    """How many parts a chunk of `chunk` tokens per sequence is split into along the sequence
    at block boundaries (`constrain_batch`): the size of `expert` for a chunk of at least
    `policy.split_chunks` tokens that it divides, else 1 (also without a mesh)."""
    n = mesh_axis("expert")
    if policy is not None and 0 < policy.split_chunks <= chunk and chunk % n == 0:
        return n
    return 1


def constrain_features(
    x: Array, tokens: int, policy: Policy | None = None, axes: tuple[str, ...] = EMBED_AXES
) -> Array:
    """A decode step's activations `x` (`[..., features]`, `tokens` of them: at most
    `policy.stationary_tokens`) split along their features over `axes` (those the mesh has),
    as the default placement splits the input dim of the weights they enter (`d_model`:
    `EMBED_AXES`, as `constrain_batch` splits them at block boundaries). Each device then
    multiplies its slice of the weight and the partial sums travel; in another layout XLA
    may gather the weight instead. Other counts, or without a mesh, unchanged."""
    if jax.sharding.get_abstract_mesh().empty:
        return x
    axes = _stationary_axes(tokens, x.shape[-1], policy, axes)
    if not axes:
        return x
    return jax.lax.with_sharding_constraint(x, P(*(None,) * (x.ndim - 1), axes))


def _stationary_axes(
    tokens: int, width: int, policy: Policy | None, axes: tuple[str, ...] = EMBED_AXES
) -> tuple[str, ...] | None:
    # The axes of `axes` that split a decode step's features (`Policy.stationary_tokens`), if
    # any.
    if policy is None or tokens > policy.stationary_tokens:
        return None
    axes = [a for a in axes if mesh_axis(a) > 1]
    return tuple(axes) if axes and width % _product(axes) == 0 else None
