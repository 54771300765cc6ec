"""Canonical weight names and how they map onto a model's leaves.

Canonical names are the official DeepSeek-V4 release names (flat, no `model.` prefix, e.g.
`layers.3.attn.wq_a.weight`). Routed experts have two canonical forms: one expert
(`layers.3.ffn.experts.17.w1.weight`, as released) or the layer's stack
(`layers.3.ffn.experts.w1`, `[experts, inter, d_model]`, as transformers stores it; a quantised
stack is `layers.3.ffn.experts.w1.weight` beside its `layers.3.ffn.experts.w1.scale`).

Module attributes follow the official names, so a canonical name is mostly its own pytree path;
the exceptions are the mHC parameters (`hc_attn_fn` -> `hc_attn.fn`), the expert stacks, the
layer index (resolved through the model's `LayerPlan` to a slot of a layer stack) and the MTP
block's inner decoder block.
"""

import dataclasses
import re
from collections.abc import Iterable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._typecheck import typechecked
from ..config import LayerPlan
from ..nn import DeepseekV4


_HC = re.compile(r"hc_(attn|ffn)_(fn|base|scale)")
_EXPERT = re.compile(r"ffn\.experts\.(\d+)\.(w1|w2|w3)\.weight")
_EXPERT_STACK = re.compile(r"ffn\.experts\.(w1|w2|w3)(?:\.weight)?")
_LAYER = re.compile(r"layers\.(\d+)\.(.+)")
_MTP = re.compile(r"mtp\.(\d+)\.(.+)")
_HC_HEAD = re.compile(r"hc_head_(fn|base|scale)")
_GLOBAL = {"embed.weight", "head.weight", "norm.weight"}
_MTP_OWN = {"e_proj.weight", "h_proj.weight", "enorm.weight", "hnorm.weight", "norm.weight"}
# A DSpark drafter's own tensors: path under `.dspark` -> (stage, name under `mtp.<stage>.`),
# stage -1 being the last.
_DSPARK_OWN = {
    "main_proj.weight": (0, "main_proj.weight"),
    "main_norm.weight": (0, "main_norm.weight"),
    "norm.weight": (-1, "norm.weight"),
    "hc_head.fn": (-1, "hc_head_fn"),
    "hc_head.base": (-1, "hc_head_base"),
    "hc_head.scale": (-1, "hc_head_scale"),
    "markov_w1.weight": (-1, "markov_head.markov_w1.weight"),
    "markov_w2.weight": (-1, "markov_head.markov_w2.weight"),
    "confidence.weight": (-1, "confidence_head.proj.weight"),
}


class CheckpointError(ValueError):
    """Weights do not match the model; `problems` lists each mismatch (name, expected, found)."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        shown = problems[:50]
        more = f"\n  ... and {len(problems) - 50} more" if len(problems) > 50 else ""
        super().__init__(f"{len(problems)} checkpoint problem(s):\n  " + "\n  ".join(shown) + more)


# --------------------------------------------------------------------------------------------
# canonical names <-> pytree paths


@typechecked
def block_path(rest: str) -> tuple[str, tuple[int, ...]]:
    """Path (relative to a `Block`) and leading index of a canonical per-layer name such as
    `attn.wq_a.weight`, `hc_attn_fn` or `ffn.experts.7.w1.weight`."""
    if m := _HC.fullmatch(rest):
        return f".hc_{m[1]}.{m[2]}", ()
    if m := _EXPERT.fullmatch(rest):
        return f".ffn.experts.{m[2]}", (int(m[1]),)
    if m := _EXPERT_STACK.fullmatch(rest):
        return f".ffn.experts.{m[1]}", ()
    return "." + rest, ()


@typechecked
def canonical_to_path(
    name: str, plan: LayerPlan, dspark_stages: int = 0
) -> tuple[str, tuple[int, ...]] | None:
    """`(pytree path, leading index)` of a canonical name in a model with this plan: the tensor
    fills `leaf[index]` of the leaf whose `jax.tree_util.keystr` is `path`. `None` when the name
    cannot belong to such a model (e.g. a layer beyond the plan). A quantisation scale
    (`X.scale` of weight `X.weight`, or of an expert stack `X`) goes to its weight's `.scale`;
    `assign` sends a weight to `.values` where the model holds it quantised. With
    `dspark_stages` (`Config.dspark_stages`) the `mtp.<i>` names are a DSpark drafter's."""
    if name.endswith(".scale"):
        base = name[: -len(".scale")]
        owner = canonical_to_path(base + ".weight", plan, dspark_stages) or canonical_to_path(
            base, plan, dspark_stages
        )
        return None if owner is None else (owner[0] + ".scale", owner[1])
    if name in _GLOBAL:
        return "." + name, ()
    if m := _HC_HEAD.fullmatch(name):
        return f".hc_head.{m[1]}", ()
    if m := _LAYER.fullmatch(name):
        layer = int(m[1])
        if layer >= plan.num_layers:
            return None
        segment, position, repeat = plan.locate(layer)
        path, index = block_path(m[2])
        return f".layers[{segment}].blocks[{position}]{path}", (repeat, *index)
    if (m := _MTP.fullmatch(name)) and dspark_stages:
        return _dspark_path(int(m[1]), m[2], dspark_stages)
    if m := _MTP.fullmatch(name):
        depth, rest = int(m[1]), m[2]
        if rest in _MTP_OWN:
            return f".mtp[{depth}].{rest}", ()
        if h := _HC_HEAD.fullmatch(rest):
            return f".mtp[{depth}].hc_head.{h[1]}", ()
        path, index = block_path(rest)
        return f".mtp[{depth}].block{path}", index
    return None


def _dspark_path(stage: int, rest: str, stages: int) -> tuple[str, tuple[int, ...]] | None:
    if stage >= stages:
        return None
    for path, (owner, own) in _DSPARK_OWN.items():
        if rest == own:
            return (f".dspark.{path}", ()) if stage == owner % stages else None
    path, index = block_path(rest)
    return f".dspark.stages[{stage}]{path}", index


def _block_rest(path: str) -> str:
    if m := re.fullmatch(r"\.hc_(attn|ffn)\.(fn|base|scale)", path):
        return f"hc_{m[1]}_{m[2]}"
    return path[1:]


@typechecked
def canonical_pieces(model: DeepseekV4) -> Iterator[tuple[str, jax.Array]]:
    """`(canonical name, array)` for every weight of `model`, one per layer (layer stacks are
    split; routed experts stay stacked per layer). A quantised weight gives its values under
    the weight's name and its scales as `X.scale`, as the release names them."""
    for name, leaf in _pieces(model):
        if name.endswith(".values"):  # an expert stack's too: `X.weight` beside `X.scale`
            name = name[: -len(".values")]
            name = name if name.endswith(".weight") else name + ".weight"
        elif name.endswith(".weight.scale"):
            name = name[: -len(".weight.scale")] + ".scale"
        yield name, leaf


def _pieces(model: DeepseekV4) -> Iterator[tuple[str, jax.Array]]:
    plan = model.plan
    for path, leaf in jax.tree_util.tree_flatten_with_path(model)[0]:
        key = jax.tree_util.keystr(path)
        if m := re.fullmatch(r"\.layers\[(\d+)\]\.blocks\[(\d+)\](.+)", key):
            seg = plan.segments[int(m[1])]
            for repeat in range(seg.repeats):
                layer = seg.layer(int(m[2]), repeat)
                if isinstance(leaf, jax.ShapeDtypeStruct):
                    piece = jax.ShapeDtypeStruct(leaf.shape[1:], leaf.dtype)
                elif isinstance(leaf, np.ndarray):
                    piece = leaf[repeat]
                else:
                    piece = _repeat_of(leaf, repeat)
                yield f"layers.{layer}.{_block_rest(m[3])}", piece
        elif m := re.fullmatch(r"\.dspark\.stages\[(\d+)\](.+)", key):
            yield f"mtp.{m[1]}.{_block_rest(m[2])}", leaf
        elif key.startswith(".dspark."):
            rest = key[len(".dspark.") :]
            path = next(p for p in _DSPARK_OWN if rest == p or rest.startswith(p + "."))
            stage, own = _DSPARK_OWN[path]
            yield f"mtp.{stage % model.config.dspark_stages}.{own}{rest[len(path) :]}", leaf
        elif m := re.fullmatch(r"\.mtp\[(\d+)\]\.block(.+)", key):
            yield f"mtp.{m[1]}.{_block_rest(m[2])}", leaf
        elif m := re.fullmatch(r"\.mtp\[(\d+)\]\.hc_head\.(fn|base|scale)", key):
            yield f"mtp.{m[1]}.hc_head_{m[2]}", leaf
        elif m := re.fullmatch(r"\.hc_head\.(fn|base|scale)", key):
            yield f"hc_head_{m[1]}", leaf
        else:
            yield re.sub(r"\[(\d+)\]", r".\1", key[1:]), leaf


# --------------------------------------------------------------------------------------------
# assigning named pieces to leaves


@dataclasses.dataclass(frozen=True)
class Slot:
    """Where the canonical piece `name` goes: `leaf[index]` of the leaf at `path` (its `number`
    in the flattened model)."""

    name: str
    path: str
    number: int
    index: tuple[int, ...]
    shape: tuple[int, ...]
    dtype: Any


def _index_depth(path: str) -> int:
    # How many leading dims of a leaf pieces can index: a scanned stack's layer axis, and the
    # expert axis of routed experts.
    return int(".blocks[" in path) + int(".ffn.experts." in path)


@typechecked
def assign(
    skeleton: DeepseekV4, pieces: Iterable[tuple[str, tuple[int, ...], bool]]
) -> dict[str, Slot]:
    """Map `(canonical name, shape, is_integer)` pieces onto `skeleton`'s leaves without reading
    any data. Every leaf must be covered exactly once (whole, per layer of a scanned stack, or
    per expert) with the expected shape and kind of dtype. All problems are collected and raised
    together as a `CheckpointError`."""
    leaves = jax.tree_util.tree_flatten_with_path(skeleton)[0]
    number = {jax.tree_util.keystr(path): i for i, (path, _) in enumerate(leaves)}
    covered: dict[int, np.ndarray] = {}
    rejected: set[int] = set()  # leaves with a reported bad piece are not also reported missing
    slots: dict[str, Slot] = {}
    problems: list[str] = []
    for name, shape, is_int in pieces:
        target = canonical_to_path(name, skeleton.plan, skeleton.config.dspark_stages)
        if target is not None and target[0] + ".values" in number:  # held quantised
            target = (target[0] + ".values", target[1])
        if target is None or target[0] not in number:
            problems.append(f"unexpected tensor {name!r} {list(shape)}")
            continue
        path, index = target
        i = number[path]
        leaf = leaves[i][1]
        expected = tuple(leaf.shape[len(index) :])
        problem = None
        if any(not 0 <= j < n for j, n in zip(index, leaf.shape, strict=False)):
            problem = f"index {index} out of range for {path} {list(leaf.shape)}"
        elif tuple(shape) != expected:
            problem = f"expected shape {list(expected)}, found {list(shape)}"
        elif jnp.issubdtype(leaf.dtype, jnp.integer) != is_int:
            problem = (
                f"expected {'an integer' if not is_int else 'a floating'} dtype like {leaf.dtype}"
            )
        if problem is not None:
            problems.append(f"{name!r}: {problem}")
            rejected.add(i)
            continue
        cover = covered.setdefault(i, np.zeros(leaf.shape[: _index_depth(path)], bool))
        if cover[index].any():
            problems.append(f"{name!r}: {path}{list(index)} written twice")
            continue
        cover[index] = True
        slots[name] = Slot(name, path, i, index, expected, leaf.dtype)
    for i, (path, leaf) in enumerate(leaves):
        cover = covered.get(i)
        if i not in rejected and (cover is None or not cover.all()):
            problems.append(f"missing tensor for {jax.tree_util.keystr(path)} {list(leaf.shape)}")
    if problems:
        raise CheckpointError(problems)
    return slots


@typechecked
def fill(skeleton: DeepseekV4, tensors: Iterable[tuple[str, np.ndarray]]) -> DeepseekV4:
    """The model with `skeleton`'s structure and the given canonically named host tensors (cast
    to each leaf's dtype). Validates everything (see `assign`) before building any leaf."""
    tensors = list(tensors)
    slots = assign(
        skeleton,
        ((n, a.shape, bool(np.issubdtype(a.dtype, np.integer))) for n, a in tensors),
    )
    arrays = dict(tensors)
    leaves, treedef = jax.tree_util.tree_flatten(skeleton)
    buffers = [np.empty(leaf.shape, np.dtype(leaf.dtype)) for leaf in leaves]
    for name, slot in slots.items():
        buffers[slot.number][slot.index] = np.asarray(arrays[name]).astype(
            buffers[slot.number].dtype
        )
    # device_put, not jnp.asarray: the latter compiles a copy program per shape.
    return jax.tree_util.tree_unflatten(treedef, [jax.device_put(b) for b in buffers])


@jax.jit
def _repeat_of(stack: jax.Array, repeat: int | jax.Array) -> jax.Array:
    # One program per stack shape for every repeat (eager indexing compiles two per shape).
    return stack[repeat]
