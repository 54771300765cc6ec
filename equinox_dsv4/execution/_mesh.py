"""What the forward pass needs to know about the device mesh it runs on.

The mesh comes from JAX's own context (`with jax.set_mesh(mesh):`, which `equinox_dsv4.shard`'s
users and `generate` set), so it is part of every trace's cache key. Mesh axes are named by
convention: `data` and `fsdp` split the batch, `tensor` splits heads and hidden MLP units,
`expert` splits the routed experts. A missing axis, or one of size 1, is not used.
"""

import functools

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


def gathered_in_steps(weight: Array, tokens: int, policy: Policy | None) -> Array:
    """A dense weight `[out, in]` that a product over `tokens` tokens reads whole (more than
    `policy.stationary_tokens`: a prefill, a train step), gathered one mesh axis at a time on
    a mesh of at least `policy.gather_in_steps` chips of `fsdp x expert`: its input dim over
    `expert`, then over `fsdp`, then its output dim likewise. There XLA's TPU compiler
    gathers a weight split over both axes at once as an all-reduce of a zero-filled buffer
    of the whole weight, then relays it out; axis by axis, each step is an all-gather among
    one axis's chips. Each dim divisible by `fsdp x expert` is viewed as
    `[fsdp, expert, rest]`, so that a dim split over both, or over one, is gathered one axis
    at a time whatever the placement (a constraint per step, each replicating one factor).
    The gradient is not constrained: XLA reduce-scatters it to the weight's placement as
    before. Unchanged without such a mesh, for few tokens, or for other shapes."""
    f, e = mesh_axis("fsdp"), mesh_axis("expert")
    steps = policy is not None and 0 < policy.gather_in_steps <= f * e
    if not steps or weight.ndim != 2 or tokens <= policy.stationary_tokens:
        return weight
    return _in_steps(weight, f, e)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _in_steps(weight, f, e):
    # The input dim, then the output dim: a dim divisible by f x e viewed as [f, e, rest]
    # (the other dim whole, or left as it is), its `expert` factor replicated, then its
    # `fsdp` factor; another dim replicated in one step. Viewing both dims at once made XLA
    # relay the weight out between the steps.
    w = weight
    for dim in (1, 0):
        n = w.shape[dim]
        if n % (f * e):
            spec = [P.UNCONSTRAINED] * 2
            spec[dim] = None
            w = jax.lax.with_sharding_constraint(w, P(*spec))
            continue
        view = w.reshape(w.shape[:dim] + (f, e, n // (f * e)) + w.shape[dim + 1 :])
        spec = [P.UNCONSTRAINED] * 4
        spec[dim + 1] = spec[dim + 2] = None
        view = jax.lax.with_sharding_constraint(view, P(*spec))
        spec[dim] = None
        w = jax.lax.with_sharding_constraint(view, P(*spec)).reshape(w.shape)
    return w


def _in_steps_fwd(weight, f, e):
    return _in_steps(weight, f, e), None


def _in_steps_bwd(f, e, _, cotangent):
    return (cotangent,)


_in_steps.defvjp(_in_steps_fwd, _in_steps_bwd)
