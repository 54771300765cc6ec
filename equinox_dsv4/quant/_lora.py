"""A frozen weight with a low-rank adapter beside it (LoRA): the weight as loaded, dense or
quantised, kept as it is, and the two small factors that training changes.

`LoraWeight` stands where the weight stood (a `Linear`'s `weight`, an expert stack's `w1`), so
every product that takes a weight takes it: the execution layer computes `W x` from the base
as it would without the adapter and adds `scale * B (A x)`, never forming `W + scale * B A`
(`merged`) inside a step. `equinox_dsv4.lora` puts adapters into a model and takes them out.
"""

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec
from jax.typing import DTypeLike
from jaxtyping import Array, Float

from .._typecheck import typechecked
from ._weight import QuantizedWeight, dense


class LoraWeight(eqx.Module):
    """A weight of logical shape `[*lead, out, in]` (HF `(out, in)` layout, optionally stacked
    along leading axes: layers, experts) that acts as `base + scale * b @ a`.

    - `base`: the weight as loaded, a dense array or a `QuantizedWeight`; frozen.
    - `a`: `[*lead, rank, in]`, Gaussian at creation.
    - `b`: `[*lead, out, rank]`, zeros at creation, so a fresh adapter changes nothing.
    - `scale`: `alpha / rank`.

    Like `QuantizedWeight` it answers `shape`, `ndim`, `dtype` (the base's) and leading-axis
    indexing (`w[e]`, `w[indices]`: every part alike).
    """

    # Annotated loosely on purpose: trees of this type also carry partition specs (sharding)
    # and cotangents with `None` parts (the expert loop's backward); `__check_init__` checks
    # the shapes whenever the parts are arrays.
    base: Any  # Float[Array, "*lead out in"] | QuantizedWeight
    a: Any  # Float[Array, "*lead rank in"]
    b: Any  # Float[Array, "*lead out rank"]
    scale: float = eqx.field(static=True)

    def __check_init__(self):
        if not all(hasattr(p, "shape") for p in (self.base, self.a, self.b)):
            return
        *lead, out, inner = self.base.shape
        rank = self.a.shape[-2]
        if tuple(self.a.shape) != (*lead, rank, inner) or tuple(self.b.shape) != (
            *lead,
            out,
            rank,
        ):
            raise ValueError(
                f"LoraWeight: a {tuple(self.a.shape)} and b {tuple(self.b.shape)} do not fit "
                f"a base of shape {tuple(self.base.shape)} (need a [*lead, rank, in], "
                "b [*lead, out, rank])"
            )

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.base.shape)

    @property
    def ndim(self) -> int:
        return len(self.base.shape)

    @property
    def dtype(self) -> jnp.dtype:
        return jnp.dtype(self.base.dtype)

    @property
    def rank(self) -> int:
        return int(self.a.shape[-2])

    def __getitem__(self, index: Any) -> "LoraWeight":
        """Index the leading (stacking) axes of the base and both factors alike."""
        return LoraWeight(self.base[index], self.a[index], self.b[index], self.scale)

    def with_base(self, base: Any) -> "LoraWeight":
        """The same adapter beside another form of the base (e.g. the base dequantised)."""
        return LoraWeight(base, self.a, self.b, self.scale)

    def merged(self, dtype: DTypeLike | None = None) -> Float[Array, "*lead out in"]:
        """`base + scale * b @ a` as one dense array of `dtype` (default: the adapter's
        dtype), the product accumulated in float32."""
        dtype = self.a.dtype if dtype is None else dtype
        delta = jnp.einsum("...or,...ri->...oi", self.b, self.a, preferred_element_type=jnp.float32)
        base = dense(self.base, jnp.float32)
        return (base + self.scale * delta).astype(dtype)


@typechecked
def is_weight(x: Any) -> bool:
    """Whether `x` is a weight form that trees of a model are mapped over whole
    (`is_leaf=is_weight`): a `QuantizedWeight` or a `LoraWeight`."""
    return isinstance(x, QuantizedWeight | LoraWeight)


@typechecked
def has_adapters(model: Any) -> bool:
    """Whether any weight of `model` has an adapter (`LoraWeight`)."""
    return any(isinstance(x, LoraWeight) for x in jax.tree.leaves(model, is_leaf=is_weight))


@typechecked
def factors_only(model: Any) -> Any:
    """The filter of the adapters' factors: `True` at every `A` and `B`, `False` at every
    other leaf (the bases included)."""

    def mark(w: Any) -> Any:
        if isinstance(w, LoraWeight):
            return LoraWeight(jax.tree.map(lambda _: False, w.base), True, True, w.scale)
        return jax.tree.map(lambda _: False, w)

    return jax.tree.map(mark, model, is_leaf=is_weight)


@typechecked
def factor_specs(spec: PartitionSpec, ndim: int) -> tuple[PartitionSpec, PartitionSpec]:
    """The partition specs of a `LoraWeight`'s `A` and `B` beside a base of `ndim` dims split
    by `spec`: `A` split like the base's input dim, `B` like its output dim, their rank dims
    whole, so that each device's products with its slices sum like the base's."""
    *lead, out, inner = tuple(spec) + (None,) * (ndim - len(spec))
    return trimmed_spec(*lead, None, inner), trimmed_spec(*lead, out, None)


@typechecked
def trimmed_spec(*entries: str | tuple[str, ...] | None) -> PartitionSpec:
    """`PartitionSpec(*entries)` without its trailing unsplit (`None`) dims: the form jit writes
    its outputs' specs in. A step's outputs fed back are then placed as its inputs were, and
    a trained factor comes back as it went in; an equal spec written otherwise compiles the
    step again (`ShardingRules.spec` writes every spec this way)."""
    while entries and entries[-1] is None:
        entries = entries[:-1]
    return PartitionSpec(*entries)


@typechecked
def base_dense(weight: Any, dtype: DTypeLike) -> Any:
    """`weight` with its base as a dense array of `dtype` (`dense`), the adapter factors of a
    `LoraWeight` cast to `dtype` beside it and kept apart."""
    if isinstance(weight, LoraWeight):
        return LoraWeight(
            dense(weight.base, dtype), weight.a.astype(dtype), weight.b.astype(dtype), weight.scale
        )
    return dense(weight, dtype)


@typechecked
def base_of(weight: Any) -> Any:
    """The base of a `LoraWeight`; any other weight itself."""
    return weight.base if isinstance(weight, LoraWeight) else weight
