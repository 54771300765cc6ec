"""Planning a checkpoint read from its headers alone: every tensor's source (its weight and
scale), what becomes of it, and where it goes in the model, with every problem collected and
raised as one `CheckpointError` before any data is read."""

import dataclasses
import os
import pathlib
import re
import sys
import warnings
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jaxtyping
import numpy as np
from beartype import beartype
from jaxtyping import jaxtyped

import equinox_dsv4 as ed
from equinox_dsv4.ckpt import CheckpointError, Slot, assign, canonical_to_path

from .names import Transform, hf_to_canonical, scale_owner
from .reader import TensorInfo, list_tensors, read_tensor


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
                w = ed.quant.dequantize_host(w, s, fp8_block)
            out = self.transform(w)
        if not self.is_int and not _all_finite(out):
            raise CheckpointError(
                [f"{self.name!r} (from {self.weight.name!r}) has NaN or inf values"]
            )
        return out

    def _kept(self, w: np.ndarray) -> np.ndarray:
        if self.kept == "scale" and not self.is_int:
            return np.asarray(ed.quant.multipliers(jnp.asarray(_exponent_bytes(w))))
        # Packed FP4, ue8m0 and uint8 scales: their bytes, as uint8.
        return w.view(np.uint8) if w.dtype.itemsize == 1 and self.is_int else w


def _exponent_bytes(scale: np.ndarray) -> np.ndarray:
    # ue8m0 scales as their exponent bytes (float scales unchanged).
    return scale.view(np.uint8) if scale.dtype.name == "float8_e8m0fnu" else scale


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
        grid = ed.quant.scale_grid(shape, ed.quant.FP4_BLOCK)
    elif kind.startswith("float8"):
        shape, grid = info.shape, ed.quant.scale_grid(info.shape, block)
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


@jaxtyped(typechecker=beartype)
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
    stages = {int(m[1]) for name in tensors if (m := re.match(r"mtp\.(\d+)\.", name))}
    if config.dspark and stages:
        # The release's config says one MTP layer (num_nextn_predict_layers) and ships three
        # drafter stages: they are counted from the checkpoint.
        config = dataclasses.replace(config, dspark_stages=max(stages) + 1)
    load_mtp = _resolve_mtp(config, tensors, targets, load_mtp, problems)
    if not load_mtp:
        config = config.trunk_only()
    if layers is not None:
        config = config.first_layers(layers)
    skeleton = eqx.filter_eval_shape(ed.DeepseekV4, config, key=jax.random.key(0), dtype=dtype)
    block = config.fp8_block_size or (128, 128)
    scales = {scale_owner(n): n for n in tensors if scale_owner(n) in tensors}
    # ue8m0 scales are kept as their exponent bytes; any float scale makes them all float32.
    exponents = all(tensors[n].dtype.itemsize == 1 for n in scales.values())
    if quantized:
        skeleton = ed.quant.abstract_quantized(
            skeleton, block, np.uint8 if exponents else np.float32
        )
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
            target = canonical_to_path(canonical, skeleton.plan, config.dspark_stages)
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
    if any(
        p.startswith(("missing tensor for .mtp[", "missing tensor for .dspark.")) for p in problems
    ):
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


_NO_MTP_HINT = (
    "to load without the MTP block or DSpark drafter, pass load_mtp=False (python -m convert: "
    "--no-mtp)"
)


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
    if config.dspark:
        if not any(c.startswith("mtp.") for named in targets.values() for c, _ in named):
            last = config.dspark_stages - 1
            problems.append(
                f"config.json announces a DSpark drafter (dspark_* keys, {config.dspark_stages} "
                "stages) but the checkpoint holds none of its tensors (mtp.0.main_proj.weight, "
                f"mtp.0.main_norm.weight, mtp.<i>.attn.*, mtp.{last}.markov_head.markov_w1.weight, "
                f"mtp.{last}.confidence_head.proj.weight, ...); {_NO_MTP_HINT}"
            )
            return False
        return True
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
            stacklevel=_caller_level(),
        )
    return False


def _caller_level() -> int:
    # `warnings.warn`'s stacklevel of the first frame outside this package and the type
    # checkers' wrappers: the user's call.
    frame, level = sys._getframe(1), 1
    inside = (os.path.dirname(__file__), os.path.dirname(jaxtyping.__file__))
    while frame is not None and frame.f_code.co_filename.startswith(inside):
        frame, level = frame.f_back, level + 1
    return level


def _skipped(canonical: str, load_mtp: bool, layers: int | None) -> bool:
    if canonical.startswith("mtp."):
        return not load_mtp
    if layers is not None and canonical.startswith("layers."):
        return int(canonical.split(".")[1]) >= layers
    return False
