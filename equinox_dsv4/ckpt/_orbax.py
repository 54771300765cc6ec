"""The on-disk format of a saved model: an orbax pytree of canonically named weights.

A saved model is a directory with `config.json` (transformers flavour), `equinox_dsv4.json`
(format version, parameter dtype, numerics, execution fields, how quantised weights are held)
and `weights/`: orbax checkpoints `part-00000`, `part-00001`, ... of nested dicts keyed by the
canonical names' components (`_names`), written as the pieces stream in, and `manifest.json`
saying which part holds each piece (with its shape and dtype). The format does not depend on
the layer plan, so a checkpoint loads into any plan of its config.
"""

import functools
import json
import os
import pathlib
import shutil
from collections.abc import Iterator
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding

from .._typecheck import typechecked
from ..config import Config
from ..nn import DeepseekV4
from ..parallel import ShardingRules, barrier, is_primary, named_shardings, shared_token
from ..quant import FP8, QuantizedWeight, abstract_quantized, has_adapters, release_format
from ._names import Slot, assign, canonical_pieces


FORMAT_VERSION = 1


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


@typechecked
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


@typechecked
def quantized_meta(model: Any) -> dict | None:
    """How `model` holds the release's quantised weights (FP8 block, scale dtype), for
    `write_metadata`; `None` when it holds none."""
    leaves = jax.tree.leaves(model, is_leaf=lambda x: isinstance(x, QuantizedWeight))
    held = [x for x in leaves if isinstance(x, QuantizedWeight)]
    if not held:
        return None
    fp8 = [x.block for x in held if x.fmt == FP8] or [model.config.fp8_block_size or (128, 128)]
    return {"fp8_block": list(fp8[0]), "scale_dtype": jnp.dtype(held[0].scale.dtype).name}


def _check_uniform_quantization(model: Any) -> None:
    # A saved model is loaded either with every weight the release quantises quantised or
    # with none (`skeleton_of`); a mix (e.g. a QLoRA model merged: its adapted weights dense,
    # the others still FP8/FP4) would be written and then refused by `load`.
    if quantized_meta(model) is None:
        return
    leaves = jax.tree_util.tree_flatten_with_path(
        model, is_leaf=lambda x: isinstance(x, QuantizedWeight)
    )[0]
    for path, leaf in leaves:
        name = jax.tree_util.keystr(path)
        if release_format(name) and not isinstance(leaf, QuantizedWeight):
            raise ValueError(
                f"ed.save: {name} is dense while other weights are quantised, which ed.load "
                "cannot read back; dequantise the rest (ed.quant.dequantize_model) or quantise "
                "it (ed.quant.quantize_model) first"
            )


@typechecked
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


@typechecked
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


@typechecked
def publish(tmp: pathlib.Path, final: pathlib.Path) -> None:
    """Rename the completed `tmp` to `final` once every process has written its part."""
    barrier(f"equinox_dsv4-written-{tmp}")
    if is_primary():
        tmp.rename(final)
    barrier(f"equinox_dsv4-published-{final}")


@typechecked
def save(path: str | os.PathLike, model: DeepseekV4) -> None:
    """Save `model` (see the module docstring for the format). `path` must not exist; it is
    written under a temporary sibling name and renamed when complete.

    With several processes (a model on a mesh that spans them), every process calls `save`
    with the same path on a shared file system; each writes the shards it holds, process 0
    the metadata and manifest. A model with LoRA adapters is refused: save the adapters alone
    (`ed.lora.save`) or fold them in first (`ed.lora.merge`)."""
    if has_adapters(model):
        raise ValueError(
            "ed.save: the model has LoRA adapters; save them alone with ed.lora.save(model, "
            "path), or fold them in with ed.lora.merge(model) first"
        )
    _check_uniform_quantization(model)
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


@typechecked
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


@typechecked
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


@typechecked
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
    - `rules`: logical-to-mesh axis rules (default `ShardingRules.for_mesh(mesh)`).
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
                out[i] = _stack(leaves[i].shape, pieces[0].ndim, leaf_shardings[i])(*pieces)

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


@functools.lru_cache(maxsize=256)
def _stack(shape: tuple[int, ...], piece_ndim: int, sharding: Any):
    # One program per stacked shape and placement, kept: a model's stacked layers share a few
    # shapes, and loading the same model again compiles none.
    lead = len(shape) - piece_ndim
    spec = (*sharding.spec, *(None,) * len(shape)) if isinstance(sharding, NamedSharding) else ()
    axes = [() if a is None else (a,) if isinstance(a, str) else tuple(a) for a in spec[:lead]]
    splits = [int(np.prod([sharding.mesh.shape[a] for a in names])) for names in axes]
    if not any(axes) or any(n % k for n, k in zip(shape[:lead], splits, strict=True)):
        return jax.jit(lambda *pieces: jnp.stack(pieces).reshape(shape), out_shardings=sharding)

    # Each piece comes split as the stack's trailing dimensions are and whole along the mesh
    # axes that split the stack's leading ones, so every device stacks the pieces of its own
    # block of the leading dimensions from what it holds. Stacked by the partitioner instead,
    # the program moves the pieces between devices in several independent all-to-alls, which
    # XLA:CPU's devices may enter in different orders and then wait for each other for ever.
    blocks = [n // k for n, k in zip(shape[:lead], splits, strict=True)]

    def local(*pieces):
        stacked = jnp.stack(pieces).reshape(shape[:lead] + pieces[0].shape)
        # A dimension split over several axes: `axis_index` of the tuple, major axis first.
        starts = [
            jax.lax.axis_index(names) * n if names else 0
            for names, n in zip(axes, blocks, strict=True)
        ]
        zeros = [0] * piece_ndim
        return jax.lax.dynamic_slice(stacked, starts + zeros, blocks + list(pieces[0].shape))

    piece = PartitionSpec(*spec[lead : len(shape)])
    mapped = jax.shard_map(
        local,
        mesh=sharding.mesh,
        in_specs=piece,
        out_specs=PartitionSpec(*spec[: len(shape)]),
    )
    return jax.jit(mapped, out_shardings=sharding)
