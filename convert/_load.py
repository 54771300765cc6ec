"""Filling a model skeleton from named tensors, with every problem collected and raised once."""

from collections.abc import Iterable

import jax
import jax.numpy as jnp
import numpy as np

from equinox_dsv4 import DeepseekV4

from ._names import canonical_to_path


class CheckpointError(ValueError):
    """A checkpoint does not match the model; `problems` lists each mismatch on its own line."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        shown = problems[:50]
        more = f"\n  ... and {len(problems) - 50} more" if len(problems) > 50 else ""
        super().__init__(f"{len(problems)} checkpoint problem(s):\n  " + "\n  ".join(shown) + more)


def fill(skeleton: DeepseekV4, tensors: Iterable[tuple[str, np.ndarray]]) -> DeepseekV4:
    """Build the model from `skeleton` (an abstract `eqx.filter_eval_shape` model or a real one)
    and canonically named tensors (see `convert.hf_to_canonical`).

    Every leaf must be written exactly once (as a whole or slice by slice: one layer of a scanned
    stack, one expert) with the expected shape; tensors are cast to the leaf's dtype. All problems
    (unexpected, missing, duplicated, wrong shape or kind) are collected and raised together as a
    `CheckpointError`; nothing is returned unless the whole model was filled.
    """
    leaves, treedef = jax.tree_util.tree_flatten_with_path(skeleton)
    slot = {jax.tree_util.keystr(path): i for i, (path, _) in enumerate(leaves)}
    buffers: dict[int, np.ndarray] = {}
    covered: dict[int, np.ndarray] = {}
    problems: list[str] = []
    rejected: set[int] = set()  # leaves with a reported bad write: not also reported missing
    for name, array in tensors:
        target = canonical_to_path(name, skeleton.plan)
        if target is None or target[0] not in slot:
            problems.append(f"unexpected tensor {name!r} {list(array.shape)}")
            continue
        path, index = target
        i = slot[path]
        leaf = leaves[i][1]
        expected = tuple(leaf.shape[len(index) :])
        problem = None
        if any(not 0 <= j < n for j, n in zip(index, leaf.shape, strict=False)):
            problem = f"index {index} out of range for {path} {list(leaf.shape)}"
        elif tuple(array.shape) != expected:
            problem = f"expected shape {list(expected)}, found {list(array.shape)}"
        elif jnp.issubdtype(leaf.dtype, jnp.integer) != np.issubdtype(array.dtype, np.integer):
            problem = f"expected dtype {leaf.dtype}, found {array.dtype}"
        if problem is not None:
            problems.append(f"{name!r}: {problem}")
            rejected.add(i)
            continue
        cover = covered.setdefault(i, np.zeros(leaf.shape[:2], bool))
        if cover[index].any():
            problems.append(f"{name!r}: {path}{list(index)} written twice")
            continue
        cover[index] = True
        buffer = buffers.get(i)
        if buffer is None:
            buffer = buffers[i] = np.empty(leaf.shape, np.dtype(leaf.dtype))
        buffer[index] = np.asarray(array).astype(buffer.dtype)
    for i, (path, leaf) in enumerate(leaves):
        cover = covered.get(i)
        if i not in rejected and (cover is None or not cover.all()):
            problems.append(f"missing tensor for {jax.tree_util.keystr(path)} {list(leaf.shape)}")
    if problems:
        raise CheckpointError(problems)
    return jax.tree_util.tree_unflatten(
        treedef, [jnp.asarray(buffers[i]) for i in range(len(leaves))]
    )
