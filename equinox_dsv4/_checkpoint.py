"""Canonical weight names, and the on-disk format: an orbax pytree of canonically named weights.

Canonical names are the official DeepSeek-V4 release names (flat, no `model.` prefix, e.g.
`layers.3.attn.wq_a.weight`). Routed experts have two canonical forms: one expert
(`layers.3.ffn.experts.17.w1.weight`, as released) or the layer's stack
(`layers.3.ffn.experts.w1`, `[experts, inter, d_model]`, as transformers stores it; a quantised
stack is `layers.3.ffn.experts.w1.weight` beside its `layers.3.ffn.experts.w1.scale`).

Module attributes follow the official names, so a canonical name is mostly its own pytree path;
the exceptions are the mHC parameters (`hc_attn_fn` -> `hc_attn.fn`), the expert stacks, the
layer index (resolved through the model's `LayerPlan` to a slot of a layer stack) and the MTP
block's inner decoder block.

A saved model is a directory with `config.json` (transformers flavour), `equinox_dsv4.json`
(format version, parameter dtype, numerics, execution fields, how quantised weights are held)
and `weights/`: orbax checkpoints
`part-00000`, `part-00001`, ... of nested dicts keyed by the canonical names' components, written
as the pieces stream in, and `manifest.json` saying which part holds each piece (with its shape
and dtype). The format does not depend on the layer plan, so a checkpoint loads into any plan of
its config.
"""

import dataclasses
import json
import os
import pathlib
import re
import shutil
from collections.abc import Iterable, Iterator
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding

from ._config import Config
from ._distributed import barrier, is_primary, shared_token
from ._model import DeepseekV4
from ._plan import LayerPlan
from ._quant import FP8, QuantizedWeight
from ._release import abstract_quantized
from ._sharding import ShardingRules, named_shardings


FORMAT_VERSION = 1
_HC = re.compile(r"hc_(attn|ffn)_(fn|base|scale)")
_EXPERT = re.compile(r"ffn\.experts\.(\d+)\.(w1|w2|w3)\.weight")
_EXPERT_STACK = re.compile(r"ffn\.experts\.(w1|w2|w3)(?:\.weight)?")
_LAYER = re.compile(r"layers\.(\d+)\.(.+)")
_MTP = re.compile(r"mtp\.(\d+)\.(.+)")
_HC_HEAD = re.compile(r"hc_head_(fn|base|scale)")
_GLOBAL = {"embed.weight", "head.weight", "norm.weight"}
_MTP_OWN = {"e_proj.weight", "h_proj.weight", "enorm.weight", "hnorm.weight", "norm.weight"}


class CheckpointError(ValueError):
    """Weights do not match the model; `problems` lists each mismatch (name, expected, found)."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        shown = problems[:50]
        more = f"\n  ... and {len(problems) - 50} more" if len(problems) > 50 else ""
        super().__init__(f"{len(problems)} checkpoint problem(s):\n  " + "\n  ".join(shown) + more)


# --------------------------------------------------------------------------------------------
# canonical names <-> pytree paths


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


def canonical_to_path(name: str, plan: LayerPlan) -> tuple[str, tuple[int, ...]] | None:
    """`(pytree path, leading index)` of a canonical name in a model with this plan: the tensor
    fills `leaf[index]` of the leaf whose `jax.tree_util.keystr` is `path`. `None` when the name
    cannot belong to such a model (e.g. a layer beyond the plan). A quantisation scale
    (`X.scale` of weight `X.weight`, or of an expert stack `X`) goes to its weight's `.scale`;
    `assign` sends a weight to `.values` where the model holds it quantised."""
    if name.endswith(".scale"):
        base = name[: -len(".scale")]
        owner = canonical_to_path(base + ".weight", plan) or canonical_to_path(base, plan)
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
    if m := _MTP.fullmatch(name):
        depth, rest = int(m[1]), m[2]
        if rest in _MTP_OWN:
            return f".mtp[{depth}].{rest}", ()
        if h := _HC_HEAD.fullmatch(rest):
            return f".mtp[{depth}].hc_head.{h[1]}", ()
        path, index = block_path(rest)
        return f".mtp[{depth}].block{path}", index
    return None


def _block_rest(path: str) -> str:
    if m := re.fullmatch(r"\.hc_(attn|ffn)\.(fn|base|scale)", path):
        return f"hc_{m[1]}_{m[2]}"
    return path[1:]


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
                else:
                    piece = leaf[repeat]
                yield f"layers.{layer}.{_block_rest(m[3])}", piece
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
        target = canonical_to_path(name, skeleton.plan)
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
    return jax.tree_util.tree_unflatten(treedef, [jnp.asarray(b) for b in buffers])


# --------------------------------------------------------------------------------------------
# save / load


def _nest(name: str, value: Any, tree: dict) -> None:
    *parents, last = name.split(".")
    for p in parents:
        tree = tree.setdefault(p, {})
    tree[last] = value


def _flat_names(tree: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _flat_names(v, f"{prefix}{k}.")
    else:
        yield prefix[:-1], tree


def write_metadata(
    path: pathlib.Path, config: Config, dtype: Any, quantized: dict | None = None
) -> None:
    """`config.json` and `equinox_dsv4.json` of a saved model; `quantized` (for a model that
    holds the release's quantised weights, see `quantized_meta`) says how to rebuild it."""
    (path / "config.json").write_text(json.dumps(config.to_hf(), indent=2) + "\n")
    meta = {
        "format": FORMAT_VERSION,
        "dtype": jnp.dtype(dtype).name,
        "scan_layers": config.scan_layers,
        "scan_min_repeats": config.scan_min_repeats,
        "numerics": config.numerics,
        "quantized": quantized,
    }
    (path / "equinox_dsv4.json").write_text(json.dumps(meta, indent=2) + "\n")


def quantized_meta(model: Any) -> dict | None:
    """How `model` holds the release's quantised weights (FP8 block, scale dtype), for
    `write_metadata`; `None` when it holds none."""
    leaves = jax.tree.leaves(model, is_leaf=lambda x: isinstance(x, QuantizedWeight))
    held = [x for x in leaves if isinstance(x, QuantizedWeight)]
    if not held:
        return None
    fp8 = [x.block for x in held if x.fmt == FP8] or [model.config.fp8_block_size or (128, 128)]
    return {"fp8_block": list(fp8[0]), "scale_dtype": jnp.dtype(held[0].scale.dtype).name}


def skeleton_of(config: Config, dtype: Any, quantized: dict | None = None) -> DeepseekV4:
    """The abstract model of `config` in `dtype`, quantised as `quantized` says."""
    skeleton = eqx.filter_eval_shape(DeepseekV4, config, key=jax.random.key(0), dtype=dtype)
    if quantized is None:
        return skeleton
    block = tuple(quantized["fp8_block"])
    return abstract_quantized(skeleton, block, jnp.dtype(quantized["scale_dtype"]))


class PieceWriter:
    """Streams canonically named pieces into `weights/`: whenever `flush_bytes` are pending they
    are saved as the next orbax checkpoint `weights/part-NNNNN`, and `close` writes
    `weights/manifest.json` (name -> part, shape, dtype). Host memory stays bounded by
    `flush_bytes` plus one piece, whatever the model size.

    A piece is a host array or a `jax.Array`. With several processes every one of them makes the
    same calls with the same global `jax.Array` pieces, and each writes the shards it holds
    (orbax's multi-process save); process 0 makes the directory and writes the manifest."""

    def __init__(self, path: pathlib.Path, flush_bytes: int = 1 << 30):
        self._dir = path.absolute() / "weights"  # orbax refuses relative paths
        if is_primary():
            self._dir.mkdir()
        barrier(f"equinox_dsv4-writer-{self._dir}")
        self._pending: dict = {}
        self._bytes = 0
        self._flush_bytes = flush_bytes
        self._manifest: dict[str, dict] = {}
        self._parts = 0

    def add(self, name: str, array: np.ndarray | jax.Array) -> None:
        if name in self._manifest:
            raise ValueError(f"{name!r} written twice")
        _nest(name, array, self._pending)
        self._manifest[name] = {
            "part": self._parts,
            "shape": list(array.shape),
            "dtype": np.dtype(array.dtype).name,
        }
        # The global size (what every process counts alike), not the bytes held here.
        self._bytes += int(np.prod(array.shape)) * np.dtype(array.dtype).itemsize
        if self._bytes >= self._flush_bytes:
            self.flush()

    def flush(self) -> None:
        from orbax.checkpoint.experimental import v1 as ocp

        if self._pending:
            # No deep copy of the host arrays (they are not touched again) and no compression
            # (weights do not compress): each would hold another copy of the batch in memory.
            context = ocp.Context()
            context.array.saving.use_compression = False
            context.memory.deepcopy_host_arrays = False
            with context:
                ocp.save(self._dir / f"part-{self._parts:05d}", self._pending)
            self._parts += 1
            self._pending, self._bytes = {}, 0

    def close(self) -> None:
        self.flush()
        if is_primary():
            manifest = {"format": FORMAT_VERSION, "parts": self._parts, "pieces": self._manifest}
            (self._dir / "manifest.json").write_text(json.dumps(manifest))


def temporary_sibling(final: pathlib.Path) -> pathlib.Path:
    """Where a save to `final` is written before it is renamed into place: a name that every
    process agrees on, the directory made by process 0. `FileExistsError` if `final` exists."""
    if final.exists():
        raise FileExistsError(f"{final} already exists")
    tmp = final.with_name(f"{final.name}.tmp-{shared_token()}")
    if is_primary():
        tmp.mkdir(parents=True)
    barrier(f"equinox_dsv4-tmp-{tmp}")
    return tmp


def publish(tmp: pathlib.Path, final: pathlib.Path) -> None:
    """Rename the completed `tmp` to `final` once every process has written its part."""
    barrier(f"equinox_dsv4-written-{tmp}")
    if is_primary():
        tmp.rename(final)
    barrier(f"equinox_dsv4-published-{final}")


def save(path: str | os.PathLike, model: DeepseekV4) -> None:
    """Save `model` (see the module docstring for the format). `path` must not exist; it is
    written under a temporary sibling name and renamed when complete.

    With several processes (a model on a mesh that spans them), every process calls `save`
    with the same path on a shared file system; each writes the shards it holds, process 0
    the metadata and manifest."""
    final = pathlib.Path(path).absolute()
    tmp = temporary_sibling(final)
    try:
        if is_primary():
            write_metadata(tmp, model.config, model.embed.weight.dtype, quantized_meta(model))
        writer = PieceWriter(tmp)
        for name, array in canonical_pieces(model):
            writer.add(name, array)
        writer.close()
        publish(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def read_config(path: str | os.PathLike) -> tuple[Config, Any, dict | None]:
    """The config, parameter dtype and quantisation (see `quantized_meta`) of a saved model."""
    path = pathlib.Path(path)
    if not (path / "equinox_dsv4.json").is_file() or not (path / "weights/manifest.json").is_file():
        raise FileNotFoundError(
            f"{path} is not a saved equinox_dsv4 model "
            "(no equinox_dsv4.json or weights/manifest.json)"
        )
    meta = json.loads((path / "equinox_dsv4.json").read_text())
    if meta.get("format") != FORMAT_VERSION:
        raise ValueError(f"{path}: unsupported format {meta.get('format')!r}")
    config = Config.from_json(
        path / "config.json",
        scan_layers=meta["scan_layers"],
        scan_min_repeats=meta["scan_min_repeats"],
        numerics=meta.get("numerics", "exact"),
    )
    return config, jnp.dtype(meta["dtype"]), meta.get("quantized")


def shardings_of(skeleton: DeepseekV4, mesh: Mesh | None, rules: ShardingRules | None) -> list:
    """The sharding of each leaf (flattened) a loaded model gets: by `rules` on `mesh`, or all on
    the first device without a mesh (one process only: several need a mesh over their devices).
    """
    if mesh is not None:
        return jax.tree.leaves(named_shardings(skeleton, mesh, rules))
    if jax.process_count() > 1:
        raise ValueError(
            f"loading in {jax.process_count()} processes needs a mesh over their devices"
        )
    return [SingleDeviceSharding(jax.devices()[0])] * len(jax.tree.leaves(skeleton))


def load(
    path: str | os.PathLike,
    *,
    mesh: Mesh | None = None,
    rules: ShardingRules | None = None,
    batch_bytes: int = 1 << 30,
) -> DeepseekV4:
    """Load a model saved by `save` or by `python -m convert`.

    **Arguments:**

    - `path`: the saved model's directory.
    - `mesh`: when given, every leaf is created with its `NamedSharding` (see `ShardingRules`)
      and each device reads only its own part from disk. Required with several processes
      (every one of them calls `load`; a save from any number of processes loads on any mesh).
    - `rules`: logical-to-mesh axis rules (default `ShardingRules()`).
    - `batch_bytes`: how much is read from disk per batch of leaves.

    **Returns:** the `DeepseekV4` model, with its weights as saved: quantised weights (from
    `python -m convert --quantized` or `save` of a quantised model) come back as
    `QuantizedWeight`s, and the config keeps its `numerics`. Raises `CheckpointError` listing
    every mismatch between the saved pieces and the config before reading any weights.
    """
    from orbax.checkpoint.experimental import v1 as ocp

    config, dtype, quantized = read_config(path)
    weights = pathlib.Path(path).absolute() / "weights"  # orbax refuses relative paths
    manifest = json.loads((weights / "manifest.json").read_text())["pieces"]
    skeleton = skeleton_of(config, dtype, quantized)
    slots = assign(
        skeleton,
        (
            (name, tuple(m["shape"]), bool(np.issubdtype(np.dtype(m["dtype"]), np.integer)))
            for name, m in manifest.items()
        ),
    )
    leaves, treedef = jax.tree_util.tree_flatten(skeleton)
    leaf_shardings = shardings_of(skeleton, mesh, rules)
    by_leaf: dict[int, list[Slot]] = {}
    for slot in slots.values():
        by_leaf.setdefault(slot.number, []).append(slot)

    def piece_sharding(slot: Slot):
        sharding = leaf_shardings[slot.number]
        if isinstance(sharding, NamedSharding):
            return NamedSharding(sharding.mesh, PartitionSpec(*sharding.spec[len(slot.index) :]))
        return sharding

    context = ocp.Context()
    context.pytree.loading.partial_load = True
    out: list[Any] = [None] * len(leaves)

    def run(batch: list[int]) -> None:
        by_part: dict[int, dict] = {}
        for i in batch:
            for slot in by_leaf[i]:
                sds = jax.ShapeDtypeStruct(
                    slot.shape,
                    dtype=np.dtype(manifest[slot.name]["dtype"]),
                    sharding=piece_sharding(slot),
                )
                _nest(slot.name, sds, by_part.setdefault(manifest[slot.name]["part"], {}))
        restored: dict[str, Any] = {}
        with context:
            for part, abstract in by_part.items():
                restored.update(_flat_names(ocp.load(weights / f"part-{part:05d}", abstract)))
        for i in batch:
            pieces = [restored[s.name] for s in sorted(by_leaf[i], key=lambda s: s.index)]
            pieces = [p.astype(leaves[i].dtype) for p in pieces]
            if len(pieces) == 1 and not by_leaf[i][0].index:
                out[i] = jax.device_put(pieces[0], leaf_shardings[i])
            else:
                out[i] = _stack(leaves[i].shape, leaf_shardings[i])(*pieces)

    batch: list[int] = []
    size = 0
    for i, leaf in enumerate(leaves):
        batch.append(i)
        size += int(np.prod(leaf.shape)) * np.dtype(leaf.dtype).itemsize
        if size >= batch_bytes:
            run(batch)
            batch, size = [], 0
    if batch:
        run(batch)
    return jax.tree_util.tree_unflatten(treedef, out)


def _stack(shape: tuple[int, ...], sharding: Any):
    return jax.jit(lambda *pieces: jnp.stack(pieces).reshape(shape), out_shardings=sharding)
