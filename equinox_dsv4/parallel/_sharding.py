"""Logical-axis sharding: every weight names its axes, one rules table maps them to mesh axes.

Each module declares the logical axes of its array fields (`param_axes(name)`, e.g. `Linear`'s
`("q_lora", "embed")` for `(out, in)`); the layers of a scanned stack get a leading `"layers"`
axis. `ShardingRules` maps logical names to mesh axis names; a logical axis whose mesh axis is
absent from the mesh, or whose size the mesh axis does not divide, is replicated. One mesh axis
may appear at most once in a spec.

Meshes have up to four axes: `data` and `fsdp` split the batch (`fsdp` also splits the weights'
`embed` dims, and the routed experts' `w1`/`w3` along their hidden units, gathered layer by
layer), `tensor` splits heads, the grouped output projection, the vocabulary and hidden MLP
units, `expert` splits the routed experts (see `_experts.expert_parallel`). Run a sharded
model under `with jax.set_mesh(mesh):` so that the forward pass sees the mesh: activations
are constrained to the batch axes at every block boundary.
"""

import dataclasses
import math
from collections.abc import Mapping
from typing import Any, TypeVar

import equinox as eqx
import jax
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec

from .._typecheck import typechecked
from ..execution import EMBED_AXES, batch_axes
from ..nn import KVCache, LayerStack
from ..quant import LoraWeight, QuantizedWeight, factor_specs, is_weight, trimmed_spec


# A model, or any module of one (e.g. a layer's `Experts`): placement is by its own axes.
M = TypeVar("M", bound=eqx.Module)

# logical axis -> mesh axis (or None). The mesh axes are conventionally "data", "fsdp",
# "tensor" and "expert"; any of them may be missing from a given mesh.
DEFAULT_RULES: dict[str, str | tuple[str, ...] | None] = {
    "layers": None,
    "vocab": "tensor",
    "embed": "fsdp",
    "embed_out": "tensor",
    "q_lora": None,
    # Weights with no `embed` dim are split over fsdp along their input dim.
    "q_lora_in": "fsdp",
    "group_in": "fsdp",
    "heads_x_dim": "tensor",
    "heads": "tensor",
    "head_dim": None,
    "groups_x_rank": "tensor",
    "experts": "expert",
    "expert_mlp": "tensor",
    # `w1`/`w3`'s hidden units, or their `d_model` where those do not split (e.g. into whole
    # FP8 blocks): the TPU compiler can lower a reduce-scatter along the minor dim, which
    # `d_model` is, as an all-reduce of the whole gradient (benchmarks/archive/NOTES.md).
    "expert_up": ("tensor", "fsdp"),
    "expert_in": ("fsdp",),
    # `w2`'s `d_model`: as a dense weight's `embed` is split where the experts take `expert`
    # alone; where they take `fsdp` too (`EXCHANGE_RULES`), whole.
    "expert_out": ("fsdp",),
    "mlp": "tensor",
}


# On a TPU mesh that splits the routed experts over `expert`, every chip of an `expert` row
# would hold the same slice of each dense weight as its neighbours. Split over `expert` too,
# their bytes per chip divide by `expert` (`benchmarks/results/tpu_memory.json`): with `fsdp`
# they are gathered layer by layer already, and the gather's group grows, not its traffic per
# chip; a decode step reads them in place (`Policy.stationary_tokens`); QLoRA on `expert`
# alone needs the room (`benchmarks/results/lora_fit.json`). Other platforms keep
# `DEFAULT_RULES` until measured: a GPU node serving on `expert` alone keeps its dense weights
# whole, where the generic policy would gather split ones in every layer.
FSDP_EXPERT_RULES: dict[str, str | tuple[str, ...] | None] = {
    "embed": EMBED_AXES,  # as a decode step's activations are split (`constrain_batch`)
    "heads_x_dim": ("tensor", "expert"),
    "groups_x_rank": ("tensor", "expert"),
    "mlp": ("tensor", "expert"),
}


# The routed experts split whole over `expert` and `fsdp` (each device holds `experts /
# (expert x fsdp)` of them, every hidden unit), as `Policy.expert_exchange` takes them: the
# tokens travel to their experts by all-to-all, and no expert's weights are gathered.
EXCHANGE_RULES: dict[str, str | tuple[str, ...] | None] = {"experts": ("expert", "fsdp")}


@dataclasses.dataclass(frozen=True)
class ShardingRules:
    """Logical axis name -> mesh axis name, or a tuple of them (see `spec`), or `None`
    (replicated). Unlisted names are replicated."""

    rules: tuple[tuple[str, str | tuple[str, ...] | None], ...] = tuple(DEFAULT_RULES.items())

    @classmethod
    def of(cls, mapping: Mapping[str, str | tuple[str, ...] | None]) -> "ShardingRules":
        return cls(tuple(mapping.items()))

    @classmethod
    def for_mesh(cls, mesh: Mesh | AbstractMesh) -> "ShardingRules":
        """The default placement on `mesh`: `DEFAULT_RULES`, and on a TPU mesh with an
        `expert` axis (of more than one device) the dense weights split over `fsdp` and
        `expert` (`FSDP_EXPERT_RULES`). What `shard`, `named_shardings`,
        `ed.load` and `convert.load_hf` use when given no rules."""
        if mesh.shape.get("expert", 1) > 1 and _platform(mesh) == "tpu":
            return cls.of({**DEFAULT_RULES, **FSDP_EXPERT_RULES})
        return cls()

    def replace(self, **changes: str | tuple[str, ...] | None) -> "ShardingRules":
        return self.of({**dict(self.rules), **changes})

    def changes(self) -> dict[str, str | tuple[str, ...] | None]:
        """The rules that differ from `DEFAULT_RULES` (a report's record of a placement)."""
        return {k: v for k, v in self.rules if DEFAULT_RULES.get(k, "unlisted") != v}

    def spec(
        self,
        axes: tuple[str | None, ...],
        shape: tuple[int, ...],
        mesh: Mesh | AbstractMesh,
        blocks: tuple[int, ...] | None = None,
    ) -> PartitionSpec:
        """The `PartitionSpec` of an array with these logical axes and shape on `mesh`. With
        `blocks` (a quantised weight's block size per dim), a dim is split only into whole
        blocks: a split that would cut a block replicates that dim instead.

        A rule may name several mesh axes (a tuple): the dim is split over those of them, in
        order, that the mesh has, that no other dim of the array names on its own or took
        for an earlier dim, and whose product keeps dividing it. E.g. `embed=("fsdp",
        "expert")` splits a dense weight's `embed` dim over both axes, and an expert stack's
        over `fsdp` only, its `experts` dim taking `expert`. Mesh axes of size 1 split
        nothing and are left out, as are trailing unsplit dims (`quant.trimmed_spec`)."""
        table = dict(self.rules)
        blocks = (1,) * len(shape) if blocks is None else blocks
        wanted = [table.get(name) if name is not None else None for name in axes]
        alone = {w for w in wanted if isinstance(w, str)}
        entries: list[str | tuple[str, ...] | None] = []
        taken: set[str] = set()  # mesh axes an earlier dim's tuple took
        for want, size, block in zip(wanted, shape, blocks, strict=True):
            options = (want,) if isinstance(want, str) else tuple(want or ())
            free = [a for a in options if isinstance(want, str) or a not in alone | taken]
            chosen: list[str] = []
            for axis in free:
                parts = mesh.shape.get(axis, 0) * math.prod(mesh.shape[c] for c in chosen)
                if mesh.shape.get(axis, 1) == 1:
                    continue  # absent, or a split over one device: no split
                if size % (parts * block) == 0:
                    chosen.append(axis)
                elif isinstance(want, str):
                    break
            if not isinstance(want, str):
                taken.update(chosen)
            entries.append(tuple(chosen) if len(chosen) > 1 else (chosen[0] if chosen else None))
        used = [a for e in entries if e is not None for a in ((e,) if isinstance(e, str) else e)]
        if len(used) != len(set(used)):
            raise ValueError(
                f"sharding rules map two axes of {axes} to the same mesh axis: {entries}"
            )
        return trimmed_spec(*entries)


def _platform(mesh: Mesh | AbstractMesh) -> str | None:
    # The platform of a mesh's devices; an abstract mesh's where it names one.
    if isinstance(mesh, Mesh):
        return mesh.devices.flat[0].platform
    device = getattr(mesh, "abstract_device", None)
    return getattr(device, "platform", None)


@typechecked
def shard(model: M, mesh: Mesh, rules: ShardingRules | None = None) -> M:
    """Place every weight of `model` (a model, or any module of one) by the rules: moved there
    (`jax.device_put`, wherever the arrays were committed), or inside a trace constrained
    there (`eqx.filter_shard`)."""
    shardings = named_shardings(model, mesh, rules)
    if any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(model)):
        return eqx.filter_shard(model, shardings)
    return jax.device_put(model, shardings)


@typechecked
def cache_shardings(cache: KVCache, mesh: Mesh) -> KVCache:
    """A pytree like `cache` with the `NamedSharding` of every array: split along its batch axis
    over the batch mesh axes (`data`, `fsdp`), like the activations."""
    with jax.set_mesh(mesh):
        axes = batch_axes(cache.positions.shape[0])

    def sharding(path, _):
        # Under `.layers` every array has a leading layer axis (a stack's, or a stack of one).
        stacked = path[0] == jax.tree_util.GetAttrKey("layers")
        return NamedSharding(mesh, PartitionSpec(*(None,) * stacked, axes))

    return jax.tree_util.tree_map_with_path(sharding, cache)


@typechecked
def shard_cache(cache: KVCache, mesh: Mesh) -> KVCache:
    """Place a decoding cache on `mesh` (see `cache_shardings`)."""
    return jax.tree.map(jax.device_put, cache, cache_shardings(cache, mesh))


@typechecked
def logical_axes(model: Any) -> dict[str, tuple[str | None, ...]]:
    """`{keystr(path): logical axes}` for every array leaf of `model` (or of any submodule)."""
    out: dict[str, tuple[str | None, ...]] = {}

    def visit(node, path, lead):
        if isinstance(node, LayerStack):
            visit(node.blocks, path + ".blocks", lead + ("layers",))
        elif isinstance(node, tuple | list):
            for i, child in enumerate(node):
                visit(child, f"{path}[{i}]", lead)
        elif isinstance(node, eqx.Module):
            for field in dataclasses.fields(node):
                if field.metadata.get("static", False):
                    continue
                value = getattr(node, field.name)
                child = f"{path}.{field.name}"
                if eqx.is_array(value) or isinstance(value, jax.ShapeDtypeStruct):
                    out[child] = lead + tuple(node.param_axes(field.name))
                elif isinstance(value, QuantizedWeight):  # scales go with their weight
                    axes = lead + tuple(node.param_axes(field.name))
                    out[child + ".values"] = out[child + ".scale"] = axes
                elif isinstance(value, LoraWeight):
                    # The base keeps the weight's axes; the factors are placed from the base's
                    # spec (`partition_specs`), their rank dims unnamed.
                    axes = lead + tuple(node.param_axes(field.name))
                    if isinstance(value.base, QuantizedWeight):
                        out[child + ".base.values"] = out[child + ".base.scale"] = axes
                    else:
                        out[child + ".base"] = axes
                    out[child + ".a"] = (*axes[:-2], None, axes[-1])
                    out[child + ".b"] = (*axes[:-2], axes[-2], None)
                elif value is not None:
                    visit(value, child, lead)

    visit(model, "", ())
    return out


@typechecked
def partition_specs(model: M, mesh: Mesh | AbstractMesh, rules: ShardingRules | None = None) -> M:
    """A pytree like `model` with the `PartitionSpec` of every array leaf, by `rules`
    (default: `ShardingRules.for_mesh(mesh)`)."""
    rules = ShardingRules.for_mesh(mesh) if rules is None else rules
    axes = logical_axes(model)

    def spec(path, leaf):
        key = jax.tree_util.keystr(path)
        if isinstance(leaf, LoraWeight):
            # The factors follow the base: `A` split like its input dim, `B` like its output
            # dim, so that each device's slices of the adapted product sum like the base's
            # (`execution.weight_spec`).
            base = spec(path + (jax.tree_util.GetAttrKey("base"),), leaf.base)
            whole = base if isinstance(base, PartitionSpec) else base.values
            return LoraWeight(base, *factor_specs(whole, leaf.ndim), leaf.scale)
        if not isinstance(leaf, QuantizedWeight):
            return rules.spec(axes[key], leaf.shape, mesh)
        # Values and scales split alike, into whole blocks, so each device dequantises its own.
        blocks = (1,) * (leaf.ndim - 2) + leaf.split_block
        one = rules.spec(axes[key + ".values"], leaf.shape, mesh, blocks)
        return jax.tree.map(lambda _: one, leaf)

    return jax.tree_util.tree_map_with_path(spec, model, is_leaf=is_weight)


@typechecked
def named_shardings(model: M, mesh: Mesh, rules: ShardingRules | None = None) -> M:
    """A pytree like `model` with the `NamedSharding` of every array leaf."""
    return jax.tree.map(
        lambda spec: NamedSharding(mesh, spec),
        partition_specs(model, mesh, rules),
        is_leaf=lambda x: isinstance(x, PartitionSpec),
    )


@typechecked
def committed(tree: Any) -> Any:
    """`tree` with every array committed to the device(s) it lives on (no copy). jit compiles
    a program for committed arguments apart from one for uncommitted ones: a model built here
    and one loaded from disk (committed) would otherwise cost two compiles of the same step."""

    def commit(x: Any) -> Any:
        if not isinstance(x, jax.Array) or isinstance(x, jax.core.Tracer):
            return x
        if x.is_deleted() or x.committed:
            return x
        return jax.device_put(x, x.sharding)

    return jax.tree.map(commit, tree)
