"""Saving a training run's state (parameters, optimizer state, step, data position) and
restoring it, atomically and from several processes."""

import json
import os
import pathlib
import shutil

import equinox as eqx
import jax

from .._typecheck import typechecked
from ..parallel import barrier, is_primary, replace_directory, shared_token
from ._losses import TrainState


_STATE_FORMAT = 1


@typechecked
def save_train_state(path: str | os.PathLike, state: TrainState, *, data_position: int = 0) -> None:
    """Saves `state` (parameters, optimizer state, step) and the data position to directory
    `path` with orbax. Written to a temporary sibling and renamed into place, so `path` is
    either the previous complete save or the new one, never a partial one.

    **Arguments:** `path`, the directory (replaced if it exists); `state`; `data_position`, where
    the data stream resumes (the caller's meaning, e.g. the next batch index).

    With several processes every one calls it with the same arguments (a shared file system);
    each writes the shards it holds.
    """
    from orbax.checkpoint.experimental import v1 as ocp

    path = pathlib.Path(path).absolute()  # orbax refuses relative paths
    leaves = jax.tree.leaves(eqx.filter(state, eqx.is_array))
    meta = {
        "format": _STATE_FORMAT,
        "step": int(state.step),
        "data_position": int(data_position),
        "leaves": [[list(x.shape), str(x.dtype)] for x in leaves],
    }
    tmp = path.with_name(f".{path.name}.tmp-{shared_token()}")
    if is_primary():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.mkdir()
    barrier(f"equinox_dsv4-state-tmp-{tmp}")
    try:
        ocp.save(tmp / "arrays", {f"{i:06d}": x for i, x in enumerate(leaves)})
        barrier(f"equinox_dsv4-state-written-{tmp}")
        if is_primary():
            (tmp / "train_state.json").write_text(json.dumps(meta) + "\n")
            replace_directory(tmp, path)
        barrier(f"equinox_dsv4-state-published-{path}")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


@typechecked
def restore_train_state(path: str | os.PathLike, like: TrainState) -> tuple[TrainState, int]:
    """Restores a state saved by `save_train_state` into the structure of `like` (e.g. a fresh
    `init_train_state`, or its `eqx.filter_eval_shape`), each array with `like`'s sharding.

    **Returns:** `(state, data_position)`. Raises `ValueError` naming the first mismatched
    leaf when the saved state does not fit `like` (another config, optimizer or dtype).
    """
    from orbax.checkpoint.experimental import v1 as ocp

    path = pathlib.Path(path)
    meta_path = path / "train_state.json"
    if not meta_path.is_file():
        raise FileNotFoundError(f"{path} is not a saved train state (no train_state.json)")
    meta = json.loads(meta_path.read_text())
    if meta.get("format") != _STATE_FORMAT:
        raise ValueError(f"{path}: unknown train-state format {meta.get('format')!r}")
    arrays, static = eqx.partition(like, eqx.is_array)
    leaves, treedef = jax.tree.flatten(arrays)
    if len(leaves) != len(meta["leaves"]):
        raise ValueError(
            f"{path} holds {len(meta['leaves'])} arrays, the target state has {len(leaves)}: "
            "another model config or optimizer"
        )
    paths = [jax.tree_util.keystr(k) for k, _ in jax.tree_util.tree_flatten_with_path(arrays)[0]]
    abstract = {}
    saved = meta["leaves"]
    for i, (leaf, (shape, dtype), name) in enumerate(zip(leaves, saved, paths, strict=True)):
        if list(leaf.shape) != shape or str(leaf.dtype) != dtype:
            raise ValueError(
                f"{path}: leaf {name} is saved as {dtype}{shape}, "
                f"the target expects {leaf.dtype}{list(leaf.shape)}"
            )
        sharding = getattr(leaf, "sharding", None)
        abstract[f"{i:06d}"] = jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding)
    restored = ocp.load(path.absolute() / "arrays", abstract)  # orbax refuses relative paths
    values = [restored[f"{i:06d}"] for i in range(len(leaves))]
    state = eqx.combine(jax.tree.unflatten(treedef, values), static)
    return state, int(meta["data_position"])
