"""Adding low-rank adapters to a model's weights and folding them back in.

An adapter stands beside one weight (`LoraWeight`): the weight stays exactly as loaded (float32,
bf16, or the release's FP8/FP4 `QuantizedWeight`) and the product becomes
`W x + (alpha / rank) B A x`. Targets are named by the weight they adapt, as the release names
it inside a block: the attention's projections, the shared expert's and the routed experts'
(one `A`/`B` pair per expert, stacked along the experts axis like the weights).
"""

import functools
import re
from collections.abc import Sequence
from typing import Any, TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
from jax.sharding import NamedSharding
from jax.typing import DTypeLike
from jaxtyping import PRNGKeyArray

from .._typecheck import typechecked
from ..quant import LoraWeight, QuantizedWeight, factor_specs, has_adapters, is_weight


M = TypeVar("M", bound=eqx.Module)

# Target name -> the path of its weight inside a block (a layer, an MTP block, a DSpark stage).
TARGETS: dict[str, str] = {
    "wq_a": r"\.attn\.wq_a\.weight",
    "wq_b": r"\.attn\.wq_b\.weight",
    "wkv": r"\.attn\.wkv\.weight",
    "wo_a": r"\.attn\.wo_a\.weight",
    "wo_b": r"\.attn\.wo_b\.weight",
    "shared_experts.w1": r"\.ffn\.shared_experts\.w1\.weight",
    "shared_experts.w2": r"\.ffn\.shared_experts\.w2\.weight",
    "shared_experts.w3": r"\.ffn\.shared_experts\.w3\.weight",
    "experts.w1": r"\.ffn\.experts\.w1",
    "experts.w2": r"\.ffn\.experts\.w2",
    "experts.w3": r"\.ffn\.experts\.w3",
}
# The compressor, indexer, router, norms and mHC are never targets by default (nor can be).
DEFAULT_TARGETS: tuple[str, ...] = tuple(TARGETS)
# Where the drafting blocks live: an MTP block, a DSpark drafter's stages.
DRAFT = re.compile(r"\.(mtp\[\d+\]|dspark)\.")


@typechecked
def target_of(path: str) -> str | None:
    """The target name of the weight at pytree path `path` (`jax.tree_util.keystr`), or
    `None` when no adapter can stand beside it."""
    for name, pattern in TARGETS.items():
        if re.search(pattern + "$", path):
            return name
    return None


@typechecked
def add(
    model: M,
    *,
    rank: int,
    alpha: float | None = None,
    targets: Sequence[str] | None = None,
    drafters: bool = True,
    dtype: DTypeLike | None = None,
    key: PRNGKeyArray,
) -> M:
    """`model` with a low-rank adapter beside each targeted weight.

    **Arguments:**

    - `model`: a `DeepseekV4` (or any module of one); its weights are kept as they are.
    - `rank`: the adapters' rank `r`.
    - `alpha`: the scale's numerator, `scale = alpha / rank` (default: `rank`, a scale of 1).
    - `targets`: names from `TARGETS` (default `DEFAULT_TARGETS`: every attention projection,
      the shared and the routed experts); an unknown name is an error.
    - `drafters`: also adapt the MTP blocks and the DSpark drafter's stages.
    - `dtype`: the adapters' dtype (default: each weight's own).
    - `key`: PRNG key for `A` (`N(0, 1/r^2)`, PEFT's Gaussian initialisation); `B` starts at
      zero, so the model computes what it did.

    The factors of a weight placed on a mesh are created there (`factor_shardings`), with
    several processes too.

    **Returns:** the model with `LoraWeight`s in place of the targeted weights.
    """
    if rank < 1:
        raise ValueError(f"lora.add: rank must be >= 1, got {rank}")
    chosen = DEFAULT_TARGETS if targets is None else tuple(targets)
    unknown = [t for t in chosen if t not in TARGETS]
    if unknown:
        raise ValueError(f"lora.add: unknown target(s) {unknown}; targets are {list(TARGETS)}")
    if has_adapters(model):
        raise ValueError("lora.add: the model already has adapters (lora.merge them first)")
    scale = float(rank if alpha is None else alpha) / rank
    leaves = jax.tree_util.tree_flatten_with_path(model, is_leaf=is_weight)[0]
    picked = {
        jax.tree_util.keystr(p)
        for p, _ in leaves
        if target_of(jax.tree_util.keystr(p)) in chosen
        and (drafters or not DRAFT.search(jax.tree_util.keystr(p)))
    }
    if not picked:
        raise ValueError(f"lora.add: no weight of the model matches the targets {list(chosen)}")
    # Every factor in one program (one per weight shape, and several per shape eagerly,
    # would each be compiled), each placed beside its weight where the weight is placed.
    targeted = [leaf for p, leaf in leaves if jax.tree_util.keystr(p) in picked]
    specs = tuple(
        (
            tuple(w.shape[:-2]),
            w.shape[-2],
            w.shape[-1],
            jnp.dtype(w.dtype if dtype is None else dtype),
        )
        for w in targeted
    )
    placed = [factor_shardings(w) for w in targeted]
    keys = jr.split(key, len(targeted))
    if all(p is not None for p in placed):
        made = _placed_factors(specs, rank, tuple(placed))(keys)
    elif any(p is not None for p in placed):
        # Some placed and some not: each where its weight is.
        made = [
            _placed_factors((spec,), rank, (p,))(k[None])[0]
            if p is not None
            else _FACTORS(k[None], specs=(spec,), rank=rank)[0]
            for spec, p, k in zip(specs, placed, keys, strict=True)
        ]
    else:
        made = _FACTORS(keys, specs=specs, rank=rank)
    made = iter(made)

    def adapt(path, leaf):
        if jax.tree_util.keystr(path) not in picked:
            return leaf
        a, b = next(made)
        return LoraWeight(leaf, a, b, scale)

    return jax.tree_util.tree_map_with_path(adapt, model, is_leaf=is_weight)


def _factors(keys, specs, rank):
    # Per weight [*lead, out, in]: A ~ N(0, 1/r^2) [*lead, r, in] in float32 then the
    # adapter's dtype, B zeros [*lead, out, r].
    return tuple(
        (
            (jr.normal(k, (*lead, rank, inner), jnp.float32) / rank).astype(d),
            jnp.zeros((*lead, out, rank), d),
        )
        for k, (lead, out, inner, d) in zip(keys, specs, strict=True)
    )


_FACTORS = jax.jit(_factors, static_argnames=("specs", "rank"))


@functools.lru_cache(maxsize=64)
def _placed_factors(specs, rank, placed):
    # `_factors` with each pair placed; kept per shapes and placements, as `_FACTORS` is.
    return jax.jit(functools.partial(_factors, specs=specs, rank=rank), out_shardings=placed)


def factor_shardings(weight: Any) -> tuple[NamedSharding, NamedSharding] | None:
    """Where the factors go beside a weight placed on a mesh: `A` split like the weight's input
    dim, `B` like its output dim (as `parallel.partition_specs` places them); `None` for a
    weight that is not (a single device, an abstract or traced one)."""
    array = weight.values if isinstance(weight, QuantizedWeight) else weight
    if isinstance(array, jax.core.Tracer) or not isinstance(array, jax.Array):
        return None
    sharding = array.sharding
    if not isinstance(sharding, NamedSharding):
        return None
    a, b = factor_specs(sharding.spec, array.ndim)
    return NamedSharding(sharding.mesh, a), NamedSharding(sharding.mesh, b)


@typechecked
def merge(model: M) -> M:
    """`model` with every adapter folded into its weight: `W + scale * B A` as one dense array
    in the adapter's dtype (a quantised base dequantised first), a plain model again."""
    return jax.tree.map(
        lambda w: w.merged() if isinstance(w, LoraWeight) else w,
        model,
        is_leaf=is_weight,
    )


@typechecked
def base(model: M) -> M:
    """`model` without its adapters: each `LoraWeight` replaced by its base, as loaded."""
    return jax.tree.map(
        lambda w: w.base if isinstance(w, LoraWeight) else w, model, is_leaf=is_weight
    )
