"""Adapters on disk in PEFT's layout, under transformers' `DeepseekV4ForCausalLM` module names.

`save` writes `adapter_config.json` and `adapter_model.safetensors` as `peft` writes them for
that model, so `peft.PeftModel.from_pretrained(transformers_model, path)` loads an adapter
trained here, and `load` reads one that `peft` wrote. The map, per layer `N`:

- `attn.wq_a` / `wq_b` / `wkv` / `wo_b` -> `model.layers.N.self_attn.q_a_proj` / `q_b_proj` /
  `kv_proj` / `o_b_proj` (`lora_A.weight` is `A`, `lora_B.weight` is `B`);
- `ffn.shared_experts.w1` / `w3` / `w2` -> `model.layers.N.mlp.shared_experts.gate_proj` /
  `up_proj` / `down_proj`;
- the routed experts, through PEFT's `target_parameters` for 3-D parameters: `experts.w1` and
  `experts.w3` -> `mlp.experts.gate_up_proj` (transformers concatenates them), one adapter of
  rank `r1 + r3` per expert (`A` the two `A`s stacked, `B` block-diagonal), `experts.w2` ->
  `mlp.experts.down_proj`; PEFT stores an expert stack's factors as `lora_A.weight`
  `[rank * experts, in]` (expert-major) and `lora_B.weight` `[out, rank * experts]`
  (expert-minor), under `mlp.experts.lora_*` for the outermost of its nested wrappers and
  `mlp.experts.base_layer.lora_*` for the one inside it (`gate_up_proj` when both are
  adapted).

Two kinds of adapter have no PEFT form: `wo_a` (transformers' grouped `o_a_proj` feeds each
group its own input, which PEFT's LoRA layer cannot) and those of the MTP and DSpark blocks
(transformers' model has none). They are written to `equinox_dsv4_adapter.safetensors`
beside the PEFT files, under their canonical names plus `.a` / `.b`, with their scales in
`equinox_dsv4_adapter.json` (`{"scales": {canonical name: scale}}`); `peft` ignores both,
`load` reads them, and `save(..., peft_only=True)` refuses a model that has them.
"""

import json
import math
import os
import pathlib
import re
import shutil
from typing import Any, TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from safetensors.numpy import load_file, save_file

from .._typecheck import typechecked
from ..ckpt import canonical_pieces, canonical_to_path
from ..parallel import barrier, is_primary, replace_directory
from ..quant import LoraWeight, factors_only, has_adapters, is_weight
from ._adapters import DRAFT, base, factor_shardings


M = TypeVar("M", bound=eqx.Module)

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
EXTRA = "equinox_dsv4_adapter.safetensors"
EXTRA_CONFIG = "equinox_dsv4_adapter.json"
_PREFIX = "base_model.model."
# Our weight (inside a layer) -> transformers' module.
_MODULES = {
    "attn.wq_a.weight": "self_attn.q_a_proj",
    "attn.wq_b.weight": "self_attn.q_b_proj",
    "attn.wkv.weight": "self_attn.kv_proj",
    "attn.wo_b.weight": "self_attn.o_b_proj",
    "ffn.shared_experts.w1.weight": "mlp.shared_experts.gate_proj",
    "ffn.shared_experts.w3.weight": "mlp.shared_experts.up_proj",
    "ffn.shared_experts.w2.weight": "mlp.shared_experts.down_proj",
}
_PARAMS = ("gate_up_proj", "down_proj")  # transformers' expert parameters, in module order
_LAYER = re.compile(r"layers\.(\d+)\.(.+)")


def _adapter_factors(model: Any) -> dict[str, tuple[np.ndarray, np.ndarray, float]]:
    """`{canonical weight name: (A, B, scale)}` of every adapter, one entry per layer (a
    stack's layers split, as `canonical_pieces` splits weights)."""
    scales = {
        jax.tree_util.keystr(p): w.scale
        for p, w in jax.tree_util.tree_flatten_with_path(model, is_leaf=is_weight)[0]
        if isinstance(w, LoraWeight)
    }
    adapters = eqx.filter(model, factors_only(model))
    if jax.process_count() > 1:
        # Every process's shards, to the host of every process (a collective), one factor at
        # a time: a whole stack replicated on every device only while it is copied out.
        from jax.experimental import multihost_utils

        adapters = jax.tree.map(
            lambda x: multihost_utils.process_allgather(x, tiled=True), adapters
        )
    pieces = dict(canonical_pieces(adapters))
    plan, stages = model.plan, _stages(model)
    out = {}
    for name, a in pieces.items():
        if not name.endswith(".a"):
            continue
        weight = name[:-2]
        path, _ = canonical_to_path(weight, plan, stages)
        out[weight] = (
            np.asarray(a, np.float32),
            np.asarray(pieces[weight + ".b"], np.float32),
            scales[path],
        )
    return out


def _stages(model: Any) -> int:
    # The DSpark drafter's stage count, which the canonical `mtp.<i>` names depend on.
    return model.config.dspark_stages if getattr(model, "dspark", None) is not None else 0


def _peft_name(weight: str) -> tuple[str, str] | None:
    """`(transformers module or parameter, kind)` of a canonical adapted weight that PEFT can
    express, kind `"module"` or `"param"`; `None` for the others."""
    m = _LAYER.fullmatch(weight)
    if not m:
        return None
    layer, rest = m[1], m[2]
    if rest in _MODULES:
        return f"model.layers.{layer}.{_MODULES[rest]}", "module"
    if rest in ("ffn.experts.w1", "ffn.experts.w3"):
        return f"model.layers.{layer}.mlp.experts.gate_up_proj", "param"
    if rest == "ffn.experts.w2":
        return f"model.layers.{layer}.mlp.experts.down_proj", "param"
    return None


def _expert_keys(layer: str, targeted: list[str]) -> dict[str, str]:
    # PEFT nests one wrapper per targeted parameter of the experts module, in the module's
    # parameter order, each outside the last: the innermost sits under the most `base_layer`s.
    keys = {}
    for i, param in enumerate(targeted):
        depth = len(targeted) - 1 - i
        keys[param] = f"model.layers.{layer}.mlp.experts" + ".base_layer" * depth
    return keys


@typechecked
def save(model: eqx.Module, path: str | os.PathLike, *, peft_only: bool = False) -> None:
    """Writes `model`'s adapters alone to directory `path` (replaced if it exists), in PEFT's
    layout (see the module's docstring). `peft_only`: refuse, naming them, adapters that PEFT
    cannot express instead of writing them beside the PEFT files. Written to a temporary
    sibling and renamed into place: `path` is never half-written. With several processes
    every one calls it (the adapters are gathered); process 0 writes."""
    if not has_adapters(model):
        raise ValueError("lora.save: the model has no adapters (lora.add or lora.load first)")
    factors = _adapter_factors(model)
    peft_tensors: dict[str, np.ndarray] = {}
    extra_tensors: dict[str, np.ndarray] = {}
    extra_scales: dict[str, float] = {}
    modules: list[str] = []
    params: list[str] = []
    ranks: dict[str, int] = {}
    alphas: dict[str, float] = {}
    experts: dict[str, Any] = {}
    for weight, (a, b, scale) in sorted(factors.items()):
        target = _peft_name(weight)
        if target is None:
            extra_tensors[weight + ".a"], extra_tensors[weight + ".b"] = a, b
            extra_scales[weight] = scale
            continue
        name, kind = target
        if kind == "module":
            modules.append(name)
            peft_tensors[f"{_PREFIX}{name}.lora_A.weight"] = a
            peft_tensors[f"{_PREFIX}{name}.lora_B.weight"] = b
            ranks[name], alphas[name] = a.shape[0], scale * a.shape[0]
        else:
            layer = _LAYER.fullmatch(weight)[1]
            experts.setdefault(layer, {})[weight.rsplit(".", 1)[1]] = (a, b, scale)
    # The expert stacks take the config's global `r` and `lora_alpha` (PEFT's patterns match
    # modules, not parameters): each padded with zeros to the largest rank, its scale folded
    # into B, so every one has scale `lora_alpha / r = 1`.
    stacks = {}
    for layer, parts in sorted(experts.items()):
        targeted = []
        if "w1" in parts or "w3" in parts:
            targeted.append("gate_up_proj")
            stacks[layer, "gate_up_proj"] = _packed(parts)
        if "w2" in parts:
            targeted.append("down_proj")
            a, b, scale = parts["w2"]
            stacks[layer, "down_proj"] = (a, b * scale)
        experts[layer] = targeted
    expert_rank = max((a.shape[1] for a, _ in stacks.values()), default=0)
    for layer, targeted in sorted(experts.items()):
        for param, key in _expert_keys(layer, targeted).items():
            a, b = stacks[layer, param]
            e, r = a.shape[0], a.shape[1]
            a = np.concatenate([a, np.zeros((e, expert_rank - r, a.shape[2]), a.dtype)], 1)
            b = np.concatenate([b, np.zeros((e, b.shape[1], expert_rank - r), b.dtype)], 2)
            # PEFT: lora_A [rank * experts, in] expert-major, lora_B [out, rank * experts]
            # with the expert the minor index.
            peft_tensors[f"{_PREFIX}{key}.lora_A.weight"] = a.reshape(e * expert_rank, -1)
            peft_tensors[f"{_PREFIX}{key}.lora_B.weight"] = b.transpose(1, 2, 0).reshape(
                b.shape[1], expert_rank * e
            )
            params.append(f"model.layers.{layer}.mlp.experts.{param}")
    if peft_only and extra_tensors:
        names = sorted({k[:-2] for k in extra_tensors})
        raise ValueError(
            f"lora.save(peft_only=True): PEFT cannot express the adapters of {names} "
            "(transformers' grouped o_a_proj; no MTP or DSpark blocks in its model)"
        )
    rank = expert_rank or max(ranks.values(), default=1)
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": None,
        "r": rank,
        "lora_alpha": float(rank),
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "target_modules": modules,
        "target_parameters": params,
        "rank_pattern": {k: v for k, v in ranks.items()},
        "alpha_pattern": {k: v for k, v in alphas.items()},
    }
    path = pathlib.Path(path)
    if not is_primary():
        barrier(f"equinox_dsv4-lora-saved-{path}")
        return
    tmp = path.with_name(f".{path.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        (tmp / CONFIG).write_text(json.dumps(config, indent=2) + "\n")
        save_file({k: np.ascontiguousarray(v) for k, v in peft_tensors.items()}, tmp / WEIGHTS)
        if extra_tensors:
            save_file({k: np.ascontiguousarray(v) for k, v in extra_tensors.items()}, tmp / EXTRA)
            (tmp / EXTRA_CONFIG).write_text(json.dumps({"scales": extra_scales}, indent=2) + "\n")
        replace_directory(tmp, path)  # the previous adapter stays whole until then
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    barrier(f"equinox_dsv4-lora-saved-{path}")


def _packed(parts: dict[str, tuple]) -> tuple[np.ndarray, np.ndarray]:
    # `w1`'s and `w3`'s adapters as one of transformers' `gate_up_proj` ([w1; w3] along the
    # output): `(A, B)`, A stacked along the rank, B block-diagonal, both scales folded in.
    like = parts["w1"] if "w1" in parts else parts["w3"]
    e, inter = like[0].shape[0], like[1].shape[1]
    blocks_a, blocks_b = [], []
    for i, name in enumerate(("w1", "w3")):
        if name not in parts:
            continue
        a, b, scale = parts[name]
        full = np.zeros((e, 2 * inter, a.shape[1]), np.float32)
        full[:, i * inter : (i + 1) * inter] = b * scale
        blocks_a.append(a)
        blocks_b.append(full)
    return np.concatenate(blocks_a, axis=1), np.concatenate(blocks_b, axis=2)


def _pattern_value(patterns: dict[str, Any], name: str, default: Any) -> Any:
    # PEFT's rule (`get_pattern_key`): a key matches a module name it ends, at a dot.
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", name):
            return value
    return default


@typechecked
def load(model: M, path: str | os.PathLike, *, dtype: Any = None) -> M:
    """`model` (its own adapters, if any, removed) with the adapters saved at `path` by `save`
    or by `peft` for transformers' `DeepseekV4ForCausalLM`, in the weights' dtype (or
    `dtype`). Weights of a stack that the file adapts in some layers only get zero factors in
    the others; factors of different ranks in one stack are padded with zeros to the largest
    (exact). Adapters of MTP or DSpark blocks that `model` was loaded without are left out.
    The factors of a weight placed on a mesh are placed beside it (`factor_shardings`).
    Refuses, naming them, LoRA variants it does not compute (DoRA, biases, other PEFT types)
    and tensors that name no weight of `model`."""
    path = pathlib.Path(path)
    if not (path / CONFIG).is_file():
        raise FileNotFoundError(f"lora.load: {path} has no {CONFIG}")
    config = json.loads((path / CONFIG).read_text())
    if config.get("peft_type") != "LORA":
        raise ValueError(f"lora.load: {path} is a {config.get('peft_type')!r} adapter, not LORA")
    for flag, bad in (("use_dora", True), ("fan_in_fan_out", True)):
        if config.get(flag) == bad:
            raise ValueError(f"lora.load: {path}: {flag}={bad} is not supported")
    if config.get("bias", "none") != "none" or config.get("lora_bias"):
        raise ValueError(f"lora.load: {path}: adapters with biases are not supported")
    if config.get("modules_to_save"):
        raise ValueError(
            f"lora.load: {path} also saves whole modules {config['modules_to_save']}, which a "
            "LoRA adapter here cannot hold"
        )
    tensors = load_file(path / WEIGHTS)
    rank_pattern, alpha_pattern = (
        config.get("rank_pattern") or {},
        config.get("alpha_pattern") or {},
    )

    def scale_of(name: str, r: int) -> float:
        alpha = _pattern_value(alpha_pattern, name, config.get("lora_alpha", r))
        return alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r

    factors: dict[str, tuple[np.ndarray, np.ndarray, float]] = {}
    # Which expert parameters each layer adapts, by PEFT's rule: a target names a parameter
    # in full or by a suffix at a dot ("mlp.experts.gate_up_proj" targets every layer's).
    wanted = config.get("target_parameters") or []
    layers = {
        m[1]
        for key in tensors
        if (m := re.match(r"base_model\.model\.model\.layers\.(\d+)\.mlp\.experts\.", key))
    }
    experts_keys = {}
    for layer in layers:
        params = [
            p
            for p in _PARAMS
            if any(
                (full := f"model.layers.{layer}.mlp.experts.{p}") == t or full.endswith("." + t)
                for t in wanted
            )
        ]
        for param, key in _expert_keys(layer, params).items():
            experts_keys[key] = (layer, param)
    by_module: dict[str, dict[str, np.ndarray]] = {}
    for key, value in tensors.items():
        m = re.fullmatch(r"base_model\.model\.(.+)\.lora_(A|B)(?:\.default)?\.weight", key)
        if not m:
            raise ValueError(f"lora.load: {path}: unexpected tensor {key!r}")
        by_module.setdefault(m[1], {})[m[2]] = value.astype(np.float32)
    reverse = {v: k for k, v in _MODULES.items()}
    for module, ab in by_module.items():
        if set(ab) != {"A", "B"}:
            raise ValueError(f"lora.load: {path}: {module} lacks lora_A or lora_B")
        a, b = ab["A"], ab["B"]
        if module in experts_keys:
            layer, param = experts_keys[module]
            # PEFT's layout back to [experts, rank, in] / [experts, out, rank].
            full = f"model.layers.{layer}.mlp.experts.{param}"
            r = _pattern_value(rank_pattern, full, config.get("r"))
            experts = a.shape[0] // r
            a3 = a.reshape(experts, r, a.shape[1])
            b3 = b.reshape(b.shape[0], r, experts).transpose(2, 0, 1)
            scale = scale_of(full, r)
            if param == "down_proj":
                factors[f"layers.{layer}.ffn.experts.w2"] = (a3, b3, scale)
            else:
                half = b3.shape[1] // 2
                factors[f"layers.{layer}.ffn.experts.w1"] = (a3, b3[:, :half], scale)
                factors[f"layers.{layer}.ffn.experts.w3"] = (a3, b3[:, half:], scale)
            continue
        m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", module)
        if not m or m[2] not in reverse:
            raise ValueError(f"lora.load: {path}: no weight here for PEFT module {module!r}")
        factors[f"layers.{m[1]}.{reverse[m[2]]}"] = (a, b, scale_of(module, a.shape[0]))
    if (path / EXTRA_CONFIG).is_file():
        more = load_file(path / EXTRA)
        for weight, scale in json.loads((path / EXTRA_CONFIG).read_text())["scales"].items():
            a, b = more[weight + ".a"], more[weight + ".b"]
            factors[weight] = (a.astype(np.float32), b.astype(np.float32), float(scale))
    return _with_factors(base(model), factors, dtype, str(path))


def _with_factors(model: M, factors: dict, dtype: Any, source: str) -> M:
    # Places per-layer factors `{canonical weight: (A, B, scale)}` into `LoraWeight`s, one per
    # leaf (a stack's layers together).
    plan, stages = model.plan, _stages(model)
    grouped: dict[str, list[tuple[tuple[int, ...], np.ndarray, np.ndarray, float]]] = {}
    for weight, (a, b, scale) in factors.items():
        where = canonical_to_path(weight, plan, stages)
        if where is None:
            raise ValueError(f"lora.load: {source}: the model has no weight {weight!r}")
        grouped.setdefault(where[0], []).append((where[1], a, b, scale))

    def place(path, leaf):
        key = jax.tree_util.keystr(path)
        if key not in grouped:
            return leaf
        entries = grouped.pop(key)
        rank = max(a.shape[-2] for _, a, _, _ in entries)
        scale = entries[0][3]
        *lead, out, inner = leaf.shape
        a_full = np.zeros((*lead, rank, inner), np.float32)
        b_full = np.zeros((*lead, out, rank), np.float32)
        for index, a, b, s in entries:
            if a.shape[-1] != inner or b.shape[-2] != out:
                raise ValueError(
                    f"lora.load: {source}: adapter of {key}{list(index)} is A {a.shape}, "
                    f"B {b.shape}; the weight is {tuple(leaf.shape)}"
                )
            r = a.shape[-2]
            a_full[index][..., :r, :] = a
            b_full[index][..., :, :r] = b * (s / scale)  # one scale per stack: the rest in B
        d = leaf.dtype if dtype is None else jnp.dtype(dtype)
        a_full, b_full = a_full.astype(d), b_full.astype(d)
        placed = factor_shardings(leaf)
        if placed is None:
            # device_put, not jnp.asarray: the latter compiles a copy program per shape.
            return LoraWeight(leaf, jax.device_put(a_full), jax.device_put(b_full), scale)
        # Each device takes its slice of the host copy (every process holds the same file).
        a, b = (
            jax.make_array_from_callback(x.shape, sharding, lambda index, x=x: x[index])
            for x, sharding in zip((a_full, b_full), placed, strict=True)
        )
        return LoraWeight(leaf, a, b, scale)

    out = jax.tree_util.tree_map_with_path(place, model, is_leaf=is_weight)
    # A model loaded without its drafting blocks (generation without drafts) runs without
    # their adapters; any other adapter without a weight is an error.
    grouped = {k: v for k, v in grouped.items() if not DRAFT.search(k)}
    if grouped:
        raise ValueError(f"lora.load: {source}: no weight of the model at {sorted(grouped)}")
    return out
