"""Hugging Face DeepSeek-V4 checkpoints -> model (in memory, optionally sharded) or -> disk.

Both paths first plan every tensor from the headers alone (names, shapes, dtypes, scales) and
raise one `CheckpointError` listing every problem before reading any data. Then tensors are read
one at a time: `load_hf` creates each leaf with `jax.make_array_from_callback`, each device
reading only the tensors its part needs; `convert` streams canonically named pieces into an
orbax checkpoint (`equinox_dsv4.load` reads it), never holding more than about one shard.
"""

import collections
import json
import os
import pathlib
import resource
import shutil
import time
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from beartype import beartype
from jax.sharding import Mesh
from jaxtyping import jaxtyped

import equinox_dsv4 as ed
from equinox_dsv4.ckpt import (
    PieceWriter,
    Slot,
    publish,
    quantized_meta,
    shardings_of,
    temporary_sibling,
    write_metadata,
)

from .plan import Source, plan


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


@jaxtyped(typechecker=beartype)
def load_hf(
    hf_dir: str | os.PathLike,
    *,
    dtype: Any = jnp.float32,
    mesh: Mesh | None = None,
    load_mtp: bool | None = None,
    rules: ed.parallel.ShardingRules | None = None,
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


@jaxtyped(typechecker=beartype)
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
    rules: ed.parallel.ShardingRules | None = None,
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
