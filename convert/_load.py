"""Hugging Face DeepSeek-V4 checkpoints -> model (in memory, optionally sharded) or -> disk.

Both paths first plan every tensor from the headers alone (names, shapes, dtypes, scales) and
raise one `CheckpointError` listing every problem before reading any data. Then tensors are read
one at a time: `load_hf` creates each leaf with `jax.make_array_from_callback`, each device
reading only the tensors its part needs; `convert` streams canonically named pieces into an
orbax checkpoint (`equinox_dsv4.load` reads it), never holding more than about one shard.
"""

import collections
import dataclasses
import json
import os
import pathlib
import resource
import shutil
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

import equinox_dsv4 as ed
from equinox_dsv4._checkpoint import (
    CheckpointError,
    PieceWriter,
    Slot,
    assign,
    canonical_to_path,
    publish,
    quantized_meta,
    shardings_of,
    temporary_sibling,
    write_metadata,
)

from ._names import Transform, hf_to_canonical, scale_owner
from ._quant import FP4_BLOCK, dequantize_fp4, dequantize_fp8, scale_grid, scale_multipliers
from ._reader import TensorInfo, list_tensors, read_tensor


@dataclasses.dataclass(frozen=True)
class Source:
    """How to produce one canonical piece: read `weight` (and `scale`), dequantise, transform.
    `kept`: the piece is a quantised weight's stored values (`"values"`: FP8 as is, packed FP4
    as `uint8`) or its scales (`"scale"`: ue8m0 as `uint8` exponents, or float32 multipliers
    when `is_int` is false), not dequantised."""

    name: str
    weight: TensorInfo
    scale: TensorInfo | None
    transform: Transform
    shape: tuple[int, ...]  # after dequantisation and transform
    is_int: bool
    kept: str | None = None

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes + (self.scale.nbytes if self.scale else 0)

    def read(self, fp8_block: tuple[int, int]) -> np.ndarray:
        w = read_tensor(self.weight)
        if self.kept is not None:
            out = self._kept(w)
        else:
            if self.scale is not None:
                s = read_tensor(self.scale)
                w = dequantize_fp4(w, s) if w.dtype == np.int8 else dequantize_fp8(w, s, fp8_block)
            out = self.transform(w)
        if not self.is_int and not _all_finite(out):
            raise CheckpointError(
                [f"{self.name!r} (from {self.weight.name!r}) has NaN or inf values"]
            )
        return out

    def _kept(self, w: np.ndarray) -> np.ndarray:
        if self.kept == "scale" and not self.is_int:
            return scale_multipliers(w)
        # Packed FP4, ue8m0 and uint8 scales: their bytes, as uint8.
        return w.view(np.uint8) if w.dtype.itemsize == 1 and self.is_int else w


def _all_finite(x: np.ndarray, chunk: int = 1 << 22) -> bool:
    flat = x.reshape(-1)  # in chunks: a whole-tensor boolean temporary is an eighth of the data
    return all(np.isfinite(flat[i : i + chunk]).all() for i in range(0, flat.size, chunk))


def _logical_shape(info: TensorInfo, scale: TensorInfo | None, block, problems) -> tuple | None:
    """Shape after dequantisation; problems for inconsistent dtypes or scale grids."""
    kind = info.dtype.name
    if scale is None:
        if kind.startswith("float8"):
            problems.append(f"{info.name!r}: {kind} weight without a scale")
            return None
        return info.shape
    if kind == "int8":
        shape = (*info.shape[:-1], 2 * info.shape[-1])
        grid = scale_grid(shape, FP4_BLOCK)
    elif kind.startswith("float8"):
        shape, grid = info.shape, scale_grid(info.shape, block)
    else:
        problems.append(
            f"{info.name!r}: has a scale but dtype {kind} (expected F8_E4M3 or packed I8)"
        )
        return None
    if scale.shape != grid:
        problems.append(
            f"{scale.name!r}: expected scale shape {list(grid)}, found {list(scale.shape)}"
        )
        return None
    return shape


class MTPSkippedWarning(UserWarning):
    """A transformers-layout checkpoint announces MTP layers in its config but holds none:
    it is loaded without its MTP block."""


@dataclasses.dataclass
class Plan:
    """Everything needed to read a checkpoint into a model: the validated sources, where each
    goes, and the skeleton."""

    config: ed.Config
    skeleton: ed.DeepseekV4
    sources: dict[str, Source]
    slots: dict[str, Slot]
    tensors_read: int
    bytes_read: int


def plan(
    hf_dir: str | os.PathLike,
    *,
    dtype: Any = jnp.float32,
    load_mtp: bool | None = None,
    layers: int | None = None,
    quantized: bool = False,
    numerics: str | None = None,
) -> Plan:
    """Read config and headers of `hf_dir`, map every tensor and check it against the model:
    names, shapes, dtypes, scales, the index and the files. Raises `CheckpointError` listing
    every problem; reads no tensor data. `load_mtp`, `quantized` and `numerics` as in
    `load_hf`."""
    hf_dir = pathlib.Path(hf_dir)
    if not (hf_dir / "config.json").is_file():
        raise FileNotFoundError(f"{hf_dir} has no config.json")
    config = ed.Config.from_json(hf_dir / "config.json")
    # Quantised weights (config.json with a `quantization_config`, as the release's) were
    # trained with the release's round trips: those numerics unless told otherwise.
    default = "release" if config.fp8_block_size is not None else "exact"
    config = dataclasses.replace(config, numerics=numerics or default)
    problems: list[str] = []
    tensors = list_tensors(hf_dir, problems)
    targets = {name: hf_to_canonical(name) or ((name, Transform()),) for name in tensors}
    load_mtp = _resolve_mtp(config, tensors, targets, load_mtp, problems)
    if not load_mtp:
        config = dataclasses.replace(config, num_nextn_predict_layers=0)
    if layers is not None:
        config = config.first_layers(layers)
    skeleton = eqx.filter_eval_shape(ed.DeepseekV4, config, key=jax.random.key(0), dtype=dtype)
    block = config.fp8_block_size or (128, 128)
    scales = {scale_owner(n): n for n in tensors if scale_owner(n) in tensors}
    # ue8m0 scales are kept as their exponent bytes; any float scale makes them all float32.
    exponents = all(tensors[n].dtype.itemsize == 1 for n in scales.values())
    if quantized:
        skeleton = ed.abstract_quantized(skeleton, block, np.uint8 if exponents else np.float32)
    held = {
        jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_flatten_with_path(skeleton)[0]
    }
    sources: dict[str, Source] = {}
    for name, info in tensors.items():
        if name in scales.values():
            continue
        owner = scale_owner(name)
        if owner is not None and (name.endswith("_scale_inv") or info.dtype.itemsize == 1):
            problems.append(f"{name!r}: a scale without its weight {owner!r}")
            continue
        scale = tensors.get(scales.get(name, ""))
        for canonical, transform in targets[name]:
            if _skipped(canonical, load_mtp, layers):
                continue
            target = canonical_to_path(canonical, skeleton.plan)
            if target is not None and target[0] + ".values" in held:
                _keep(sources, canonical, info, scale, transform, block, exponents, problems)
                continue
            shape = _logical_shape(info, scale, block, problems)
            if shape is not None:
                is_int = bool(np.issubdtype(info.dtype, np.integer)) and scale is None
                sources[canonical] = Source(
                    canonical, info, scale, transform, transform.shape(shape), is_int
                )
    try:
        slots = assign(skeleton, ((s.name, s.shape, s.is_int) for s in sources.values()))
    except CheckpointError as e:
        problems += e.problems
    if any(p.startswith("missing tensor for .mtp[") for p in problems):
        problems.append(_NO_MTP_HINT)
    if problems:
        raise CheckpointError(problems)
    read = {t.name: t for s in sources.values() for t in (s.weight, s.scale) if t is not None}
    return Plan(config, skeleton, sources, slots, len(read), sum(t.nbytes for t in read.values()))


def _keep(sources, canonical, info, scale, transform, block, exponents, problems) -> None:
    """Plan a weight the model holds quantised: its stored values and its scales, two pieces."""
    if scale is None:
        problems.append(
            f"{info.name!r}: quantized=True keeps the release's FP8/FP4 weights as stored, but "
            f"this one is stored as {info.dtype.name} without a scale; load with quantized=False"
        )
        return
    if transform.part != "all":
        problems.append(
            f"{info.name!r}: quantized=True cannot keep a quantised w1/w3 stack (gate_up_proj) "
            "as stored; load with quantized=False"
        )
        return
    if _logical_shape(info, scale, block, problems) is None:
        return
    packed = info.dtype.name == "int8"
    sources[canonical] = Source(canonical, info, None, transform, info.shape, packed, "values")
    base = canonical[: -len(".weight")] if canonical.endswith(".weight") else canonical
    name = base + ".scale"
    sources[name] = Source(name, scale, None, transform, scale.shape, exponents, "scale")


_NO_MTP_HINT = "to load without the MTP block, pass load_mtp=False (python -m convert: --no-mtp)"


def _resolve_mtp(
    config: ed.Config,
    tensors: dict[str, TensorInfo],
    targets: dict[str, tuple[tuple[str, Transform], ...]],
    load_mtp: bool | None,
    problems: list[str],
) -> bool:
    """Whether to load the MTP block. transformers' `DeepseekV4Config` announces one MTP layer
    by default while its model has none, so every checkpoint its `save_pretrained` writes says
    "one MTP layer" and holds no `mtp.*` tensor: with `load_mtp=None` such a checkpoint loads
    without the block (with a `MTPSkippedWarning`). A release-layout checkpoint missing the
    MTP its config announces is damaged, and stays an error (appended to `problems`).
    `targets`: each tensor's canonical names."""
    announced = config.num_nextn_predict_layers
    if load_mtp is False:
        return False
    if announced == 0:
        return True  # any mtp.* tensor is then reported as unexpected
    if any(c.startswith("mtp.") for named in targets.values() for c, _ in named):
        return True
    if not any(n.startswith(("model.", "lm_head.")) for n in tensors):
        problems.append(
            f"config.json announces {announced} MTP layer(s) (num_nextn_predict_layers) but the "
            f"checkpoint holds no mtp.* tensor; {_NO_MTP_HINT}"
        )
    elif load_mtp:
        problems.append(
            "load_mtp=True, but this transformers-layout checkpoint holds no mtp.* tensor (its "
            f"config's num_nextn_predict_layers={announced} is transformers' default: its "
            "DeepseekV4ForCausalLM has no MTP block, so save_pretrained writes none)"
        )
    else:
        warnings.warn(
            "the MTP block is absent from this transformers-layout checkpoint (config.json says "
            f"num_nextn_predict_layers={announced}, transformers' default, but it holds no mtp.* "
            "tensor): loading without it",
            MTPSkippedWarning,
            stacklevel=4,
        )
    return False


def _skipped(canonical: str, load_mtp: bool, layers: int | None) -> bool:
    if canonical.startswith("mtp."):
        return not load_mtp
    if layers is not None and canonical.startswith("layers."):
        return int(canonical.split(".")[1]) >= layers
    return False


class _PieceCache:
    """Dequantised pieces, least recently used evicted beyond `capacity` bytes: on a mesh several
    devices need (parts of) the same piece."""

    def __init__(self, read: Callable[[Source], np.ndarray], capacity: int):
        self._read, self._capacity = read, capacity
        self._items: collections.OrderedDict[str, np.ndarray] = collections.OrderedDict()
        self._bytes = 0

    def get(self, source: Source) -> np.ndarray:
        if source.name in self._items:
            self._items.move_to_end(source.name)
            return self._items[source.name]
        value = self._read(source)
        self._items[source.name] = value
        self._bytes += value.nbytes
        while self._bytes > self._capacity and len(self._items) > 1:
            _, old = self._items.popitem(last=False)
            self._bytes -= old.nbytes
        return value


def load_hf(
    hf_dir: str | os.PathLike,
    *,
    dtype: Any = jnp.float32,
    mesh: Mesh | None = None,
    load_mtp: bool | None = None,
    rules: ed.ShardingRules | None = None,
    cache_bytes: int = 2 << 30,
    quantized: bool = False,
    numerics: str | None = None,
    layers: int | None = None,
    stats: dict | None = None,
) -> ed.DeepseekV4:
    """Load a Hugging Face DeepSeek-V4 checkpoint (official release layout or transformers
    `save_pretrained` layout) into a model.

    **Arguments:**

    - `hf_dir`: directory with `config.json` and `model.safetensors[.index.json]`.
    - `dtype`: parameter dtype (`float32` or `bfloat16`); FP8/FP4 weights are dequantised
      unless `quantized`.
    - `mesh`: when given, each leaf is created with its `NamedSharding` (`rules`), each device
      reading only what it holds, so a model larger than one device loads sharded.
    - `load_mtp`: load the MTP block (`mtp.*`). `None` (default): load it if the checkpoint
      holds it; a transformers-layout checkpoint without one (transformers' model has no MTP
      block, yet its config announces one) loads without it, with a `MTPSkippedWarning`.
      `True`: the block must be there. `False`: leave the model without one.
    - `cache_bytes`: dequantised tensors kept for devices that share them.
    - `quantized`: keep the release's FP8 and FP4 weights as stored (`QuantizedWeight`
      leaves: values and ue8m0 scales, dequantised by each matmul inside the computation),
      about 0.53 bytes per routed-expert parameter and 1 per FP8 one instead of 2 in bfloat16.
      `dtype` is then the dtype they dequantise to. The checkpoint must store those weights
      quantised (the release does).
    - `numerics`: `"exact"` or `"release"` (`Config.numerics`: the FP8/FP4 round trips of the
      official inference code). Default: `"release"` for a checkpoint whose config.json has a
      `quantization_config` (the release's), else `"exact"`.
    - `layers`: keep only the first `layers` layers (for smoke runs).
    - `stats`: when given a dict, it receives `bytes_read` and `tensors_read` (what this
      process read from disk) and `bytes_total` (all the checkpoint's tensors the model uses).

    With several processes every one calls `load_hf` with the same mesh (spanning them all);
    each reads only the tensors its devices hold a part of.

    **Returns:** the model. Raises `CheckpointError` (listing every problem) before reading any
    data if the checkpoint does not match its config.
    """
    p = plan(
        hf_dir,
        dtype=dtype,
        load_mtp=load_mtp,
        layers=layers,
        quantized=quantized,
        numerics=numerics,
    )
    block = p.config.fp8_block_size or (128, 128)
    read = {"bytes_read": 0, "tensors_read": 0}

    def read_source(source: Source) -> np.ndarray:
        read["bytes_read"] += source.nbytes
        read["tensors_read"] += 1 + (source.scale is not None)
        return source.read(block)

    cache = _PieceCache(read_source, cache_bytes)
    leaves, treedef = jax.tree_util.tree_flatten(p.skeleton)
    shardings = shardings_of(p.skeleton, mesh, rules)
    by_leaf: dict[int, list[Slot]] = collections.defaultdict(list)
    for slot in p.slots.values():
        by_leaf[slot.number].append(slot)

    def region(i: int, index: tuple[slice, ...]) -> np.ndarray:
        leaf = leaves[i]
        ranges = [range(*s.indices(n)) for s, n in zip(index, leaf.shape, strict=True)]
        out = np.empty([len(r) for r in ranges], np.dtype(leaf.dtype))
        for slot in by_leaf[i]:
            k = len(slot.index)
            if not all(j in r for j, r in zip(slot.index, ranges, strict=False)):
                continue
            value = cache.get(p.sources[slot.name])[tuple(index[k:])]
            dest = tuple(r.index(j) for j, r in zip(slot.index, ranges, strict=False))
            out[dest] = value.astype(out.dtype)
        return out

    arrays = [
        jax.make_array_from_callback(leaf.shape, shardings[i], lambda idx, i=i: region(i, idx))
        for i, leaf in enumerate(leaves)
    ]
    if stats is not None:
        stats.update(read, bytes_total=p.bytes_read)
    return jax.tree_util.tree_unflatten(treedef, arrays)


def convert(
    hf_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    dtype: Any = jnp.bfloat16,
    load_mtp: bool | None = None,
    layers: int | None = None,
    progress: bool = False,
    quantized: bool = False,
    numerics: str | None = None,
    mesh: Mesh | None = None,
    rules: ed.ShardingRules | None = None,
) -> dict[str, Any]:
    """Convert a Hugging Face checkpoint into a saved model at `out_dir` (read it with
    `equinox_dsv4.load`).

    Validates everything first (`CheckpointError`), then streams tensors in file order, each
    dequantised, cast and written as one canonical piece. The output is written to a temporary
    sibling directory and renamed when complete; on any failure nothing is left at `out_dir`.
    With `quantized`, the release's FP8/FP4 weights are written as stored (see `load_hf`) and
    `equinox_dsv4.load` restores them so. `numerics` as in `load_hf`; the saved model keeps it.

    With a `mesh` (`rules` as in `load_hf`) the model is instead loaded onto it, each device
    reading only what it holds, and saved from there (`equinox_dsv4.save`): the mesh must hold
    the model. That is how several processes convert together: every one calls `convert` with
    the same arguments and a mesh over all their devices (default with several processes:
    `expert` over all devices where it divides the experts, else `fsdp`), paths on a shared
    file system; each reads and writes its part.

    **Returns:** a summary: `tensors` and `bytes` read by this process (`bytes_total`: the
    tensors the model uses), `seconds`, this process's `peak_rss_bytes`, the written `config`.
    """
    start = time.perf_counter()
    out_dir = pathlib.Path(out_dir)
    if out_dir.exists():
        raise FileExistsError(f"{out_dir} already exists; remove it or choose another path")
    if mesh is None and jax.process_count() > 1:
        n = jax.device_count()
        config = ed.Config.from_json(pathlib.Path(hf_dir) / "config.json")
        mesh = ed.make_mesh(**({"expert": n} if config.n_routed_experts % n == 0 else {"fsdp": n}))
    if mesh is not None:
        stats: dict = {}
        model = load_hf(
            hf_dir,
            dtype=dtype,
            mesh=mesh,
            load_mtp=load_mtp,
            rules=rules,
            quantized=quantized,
            numerics=numerics,
            layers=layers,
            stats=stats,
        )
        ed.save(out_dir, model)
        summary = {
            "tensors": stats["tensors_read"],
            "bytes": stats["bytes_read"],
            "bytes_total": stats["bytes_total"],
        }
    else:
        summary = _stream(hf_dir, out_dir, dtype, load_mtp, layers, progress, quantized, numerics)
    return {
        **summary,
        "seconds": time.perf_counter() - start,
        "peak_rss_bytes": peak_rss_bytes(),
        "config": json.loads((out_dir / "config.json").read_text()),
    }


def _stream(hf_dir, out_dir, dtype, load_mtp, layers, progress, quantized, numerics) -> dict:
    p = plan(
        hf_dir,
        dtype=dtype,
        load_mtp=load_mtp,
        layers=layers,
        quantized=quantized,
        numerics=numerics,
    )
    block = p.config.fp8_block_size or (128, 128)
    tmp = temporary_sibling(out_dir)
    bar = _progress(p.bytes_read, p.tensors_read) if progress else None
    try:
        write_metadata(tmp, p.config, dtype, quantized_meta(p.skeleton))
        largest = max((s.weight.file.stat().st_size for s in p.sources.values()), default=0)
        writer = PieceWriter(tmp, flush_bytes=max(32 << 20, min(largest // 4, 1 << 30)))
        for done, source in enumerate(_file_order(p.sources.values()), 1):
            slot = p.slots[source.name]
            writer.add(source.name, source.read(block).astype(np.dtype(slot.dtype), copy=False))
            if bar is not None:
                bar.update(source.nbytes)
                bar.set_postfix_str(f"{done}/{len(p.sources)} pieces", refresh=False)
        writer.close()
        publish(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        if bar is not None:
            bar.close()
    return {"tensors": p.tensors_read, "bytes": p.bytes_read, "bytes_total": p.bytes_read}


def peak_rss_bytes() -> int:
    """This process's peak resident set size. Linux's VmHWM, not `ru_maxrss`: the latter keeps
    the pre-exec size of a forked child, i.e. the parent's."""
    try:
        for line in pathlib.Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _file_order(sources) -> Iterator[Source]:
    return iter(sorted(sources, key=lambda s: (str(s.weight.file), s.weight.start, s.name)))


def _progress(total: int, tensors: int):
    from tqdm import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, desc=f"{tensors} tensors")
