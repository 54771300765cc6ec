"""The release's weight formats on a whole model: which weights DeepSeek-V4 stores quantised,
and models whose weights stay that way in memory.

As released, the attention projections (`wq_a`, `wq_b`, `wkv`, `wo_a`, `wo_b`), the indexer's
`wq_b`, the shared experts, the MTP block's `e_proj`/`h_proj` and the DSpark drafter's
`main_proj` are FP8 e4m3 in 128 x 128 blocks, and the routed experts FP4 e2m1 in 1 x 32
blocks. Everything else (embedding, head, norms, mHC, compressors, the indexer's
`weights_proj`, the router, the DSpark Markov and confidence heads) is stored in bf16 or fp32
and stays a dense array here.
"""

import re
from typing import Any, TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from .._typecheck import typechecked
from ._weight import FP4, FP4_BLOCK, FP8, QuantizedWeight, quantize, scale_grid


# One program per weight shape and format, kept across calls (a wrapper made per call would
# trace and compile each again).
_quantize_jit = eqx.filter_jit(quantize)


# A model (`equinox_dsv4.DeepseekV4`): a module with a `config` whose weights sit at the
# release's paths.
M = TypeVar("M", bound=eqx.Module)


_FP8 = re.compile(
    r".*\.attn\.(wq_a|wq_b|wkv|wo_a|wo_b|indexer\.wq_b)\.weight"
    r"|.*\.ffn\.shared_experts\.w[123]\.weight"
    r"|\.mtp\[\d+\]\.(e_proj|h_proj)\.weight"
    r"|\.dspark\.main_proj\.weight"
)
_FP4 = re.compile(r".*\.ffn\.experts\.w[123]")
DEFAULT_BLOCK = (128, 128)


@typechecked
def release_format(path: str, expert_dtype: str | None = None) -> str | None:
    """`"e4m3"`, `"e2m1"` or `None`: how the release stores the weight at this pytree path
    (`jax.tree_util.keystr`). Routed experts are FP4 unless `expert_dtype` (the config's) is
    `"fp8"` (the official converter's `--expert-dtype fp8`)."""
    if _FP4.fullmatch(path):
        return FP8 if expert_dtype == "fp8" else FP4
    if _FP8.fullmatch(path):
        return FP8
    return None


def _fp8_block(model: M, block: tuple[int, int] | None) -> tuple[int, int]:
    return block or model.config.fp8_block_size or DEFAULT_BLOCK


def _map_release(model: M, fn) -> M:
    # fn(leaf, fmt) on every weight the release quantises; other leaves unchanged.
    def visit(path, leaf):
        if isinstance(leaf, QuantizedWeight):
            return leaf
        fmt = release_format(jax.tree_util.keystr(path), model.config.expert_dtype)
        return leaf if fmt is None else fn(leaf, fmt)

    return jax.tree_util.tree_map_with_path(
        visit, model, is_leaf=lambda x: isinstance(x, QuantizedWeight)
    )


@typechecked
def quantize_model(model: M, block: tuple[int, int] | None = None) -> M:
    """`model` with the weights the release quantises stored as it stores them (`quantize`):
    FP8 in `block`s (default: the config's `fp8_block_size`, else 128 x 128), routed experts
    FP4. For models that did not come from a release checkpoint (benchmarks, own weights);
    `convert.load_hf(..., quantized=True)` keeps a release's own bytes instead."""
    fp8 = _fp8_block(model, block)
    return _map_release(model, lambda w, fmt: _quantize_jit(w, fmt, fp8))


@typechecked
def dequantize_model(model: M) -> M:
    """`model` with every `QuantizedWeight` replaced by its dense weight (exact)."""
    return jax.tree.map(
        lambda x: x.dequantize() if isinstance(x, QuantizedWeight) else x,
        model,
        is_leaf=lambda x: isinstance(x, QuantizedWeight),
    )


@typechecked
def abstract_quantized(
    skeleton: M,
    block: tuple[int, int] | None = None,
    scale_dtype: Any = jnp.uint8,
) -> M:
    """The abstract structure of `quantize_model(skeleton)` (shapes and dtypes only), with
    scales of `scale_dtype` (`uint8` ue8m0 exponents, or `float32` multipliers)."""
    fp8 = _fp8_block(skeleton, block)

    def abstract(w, fmt):
        blk = fp8 if fmt == FP8 else FP4_BLOCK
        *lead, out, cols = w.shape
        stored = (*lead, out, cols // 2) if fmt == FP4 else w.shape
        dtype = jnp.uint8 if fmt == FP4 else jnp.float8_e4m3fn
        grid = scale_grid(w.shape, blk)
        return eqx.filter_eval_shape(
            lambda: QuantizedWeight(
                jnp.zeros(stored, dtype), jnp.zeros(grid, scale_dtype), fmt, blk, w.dtype
            )
        )

    return _map_release(skeleton, abstract)


@typechecked
def is_quantized(model: Any) -> bool:
    """Whether any weight of `model` is a `QuantizedWeight`."""
    leaves = jax.tree.leaves(model, is_leaf=lambda x: isinstance(x, QuantizedWeight))
    return any(isinstance(x, QuantizedWeight) for x in leaves)


@typechecked
def weight_bytes(model: Any) -> dict[str, int]:
    """Bytes of `model`'s weights: `"quantized"` (values and scales of every
    `QuantizedWeight`), `"dense"` (every other array) and `"total"`."""
    out = {"quantized": 0, "dense": 0}
    for leaf in jax.tree.leaves(model, is_leaf=lambda x: isinstance(x, QuantizedWeight)):
        if isinstance(leaf, QuantizedWeight):
            out["quantized"] += leaf.nbytes
        elif hasattr(leaf, "shape") and hasattr(leaf, "dtype"):
            out["dense"] += int(np.prod(leaf.shape)) * jnp.dtype(leaf.dtype).itemsize
    out["total"] = out["quantized"] + out["dense"]
    return out
