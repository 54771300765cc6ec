"""The two dialects of config.json a `Config` is read from (the transformers flavour and the
official release's) and the transformers one it is written to, plus the released presets.

A `Config` field marked `hf="plain"` is its own config.json key, copied as is (ints widened to
float for float fields); the rest are read and written here by name."""

import dataclasses
import json
import os
from typing import Any

from ._config import (
    CSA,
    DSPARK_FIELDS,
    DSPARK_STAGES,
    HASH_MOE,
    HCA,
    MOE,
    SLIDING,
    Config,
    YarnScaling,
)


# Keys that either flavour of config.json may carry and that do not change the computation
# (bookkeeping written by transformers, training-only knobs, generation defaults). Anything not
# listed here and not read by `Config.from_hf` is an error.
IGNORED_HF_KEYS = frozenset(
    {
        "_from_model_config",
        "_name_or_path",
        "architectures",
        "attention_dropout",
        "auto_map",
        "chunk_size_feed_forward",
        "dtype",
        "id2label",
        "initializer_range",
        "is_encoder_decoder",
        "label2id",
        "output_attentions",
        "output_hidden_states",
        "output_router_logits",
        "pad_token_id",
        "problem_type",
        "return_dict",
        "router_aux_loss_coef",
        "router_jitter_noise",
        "tokenizer_class",
        "torch_dtype",
        "transformers_version",
        "use_cache",
    }
)


# Keys whose value must be one fixed thing for DeepSeek-V4; anything else is a config we cannot run.
_FIXED_KEYS = {
    "model_type": "deepseek_v4",
    "num_key_value_heads": 1,
    "hidden_act": "silu",
    "attention_bias": False,
    "mlp_bias": False,
    "tie_word_embeddings": False,
    "topk_method": "noaux_tc",
}

_QUANT_KEYS = frozenset(
    {
        "quant_method",
        "fmt",
        "scale_fmt",
        "activation_scheme",
        "weight_block_size",
        "expert_dtype",
        "dequantize",
        "modules_to_not_convert",
    }
)


def _fields(kind: str) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(Config) if f.metadata["hf"] == kind]


def read_json(path: str | os.PathLike) -> dict[str, Any]:
    """The JSON object in `path`; `ValueError` naming the file otherwise."""
    with open(path) as f:
        try:
            data = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{os.fspath(path)} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{os.fspath(path)} must hold a JSON object")
    return data


def parse(data: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """`Config` keyword arguments from a config.json dictionary of either flavour, `overrides`
    (`Config` fields) applied last. Unknown keys raise `ValueError` listing them."""
    d = dict(data)
    names = {f.name for f in dataclasses.fields(Config)}
    unknown_overrides = sorted(set(overrides) - names)
    if unknown_overrides:
        raise ValueError(f"unknown Config fields in overrides: {unknown_overrides}")
    consumed: set[str] = set()

    def take(key, default=None):
        consumed.add(key)
        return d.get(key, default)

    for key, expected in _FIXED_KEYS.items():
        if key in d and take(key) != expected:
            raise ValueError(f"{key} must be {expected!r} for DeepSeek-V4, got {d[key]!r}")

    kw: dict[str, Any] = {}
    for f in _fields("plain"):
        if f.name in d:
            value = take(f.name)
            widen = f.type is float and isinstance(value, int) and not isinstance(value, bool)
            kw[f.name] = float(value) if widen else value
    missing = [
        f.name
        for f in _fields("plain")
        if f.default is dataclasses.MISSING and f.name not in kw and f.name not in overrides
    ]
    if missing:
        raise ValueError(f"config is missing required keys: {missing}")
    if "eos_token_id" in d:
        eos = take("eos_token_id")
        kw["eos_token_id"] = tuple(eos) if isinstance(eos, list) else eos

    n_layers = overrides.get("num_hidden_layers", kw.get("num_hidden_layers"))
    n_mtp = kw.get("num_nextn_predict_layers", 1)
    targets = take("dspark_target_layer_ids")
    if targets is not None:
        if not isinstance(targets, list | tuple):
            raise ValueError(f"dspark_target_layer_ids must be a list of ints, got {targets!r}")
        kw["dspark_target_layer_ids"] = tuple(targets)
    stages = take("dspark_stages")
    dspark = any(kw.get(name) is not None for name in DSPARK_FIELDS)
    head_dim = kw.get("head_dim", 512)

    # --- layer schedule
    rates = take("compress_rates")
    if rates is not None:
        if not isinstance(rates, dict) or set(rates) - {CSA, HCA}:
            raise ValueError(f"compress_rates must map {CSA!r}/{HCA!r} to ints, got {rates!r}")
        kw["compress_rate_csa"] = rates.get(CSA, 4)
        kw["compress_rate_hca"] = rates.get(HCA, 128)
    for legacy in ("compress_rate_csa", "compress_rate_hca"):
        if legacy in d:
            kw[legacy] = take(legacy)
    ratios = take("compress_ratios")
    layer_types = take("layer_types")
    if layer_types is not None:
        kw["layer_types"] = tuple(layer_types)
    elif ratios is not None:
        known = isinstance(ratios, list) and isinstance(n_layers, int)
        extra = len(ratios) - n_layers if known else 0
        if dspark and stages is None and extra > 0:
            stages = extra  # the release's trailing entries: one per drafter stage
        trailing = (stages or DSPARK_STAGES) if dspark else n_mtp
        kw.update(_layer_types_from_ratios(ratios, n_layers, trailing))
    if stages is not None:  # else `Config` takes the releases' count for a drafter
        kw["dspark_stages"] = stages
    mlp_types = take("mlp_layer_types")
    n_hash = take("num_hash_layers")
    if mlp_types is not None:
        kw["mlp_layer_types"] = tuple(mlp_types)
        if n_hash is not None and n_hash != sum(t == HASH_MOE for t in mlp_types):
            raise ValueError(
                f"num_hash_layers ({n_hash}) disagrees with mlp_layer_types ({list(mlp_types)})"
            )
    elif isinstance(n_layers, int):
        n_hash = 3 if n_hash is None else n_hash
        kw["mlp_layer_types"] = (HASH_MOE,) * min(n_layers, n_hash) + (MOE,) * max(
            0, n_layers - n_hash
        )
    if "layer_types" not in kw and "layer_types" not in overrides:
        raise ValueError("config has neither layer_types nor compress_ratios")

    # --- RoPE
    rope_dim = take("qk_rope_head_dim")
    partial = take("partial_rotary_factor")
    if partial is not None:
        from_partial = int(head_dim * partial)
        if rope_dim is not None and rope_dim != from_partial:
            raise ValueError(
                f"qk_rope_head_dim ({rope_dim}) disagrees with partial_rotary_factor ({partial}) "
                f"* head_dim ({head_dim})"
            )
        rope_dim = from_partial
    if rope_dim is not None:
        kw["qk_rope_head_dim"] = rope_dim
    rope_parameters = take("rope_parameters")
    rope_scaling = take("rope_scaling")
    if rope_parameters is not None and rope_scaling is not None:
        raise ValueError("config has both rope_parameters and rope_scaling; give one")
    if rope_parameters is not None:
        kw.update(_parse_rope_parameters(rope_parameters, kw, head_dim))
    elif rope_scaling is not None:
        kw["rope_scaling"] = _parse_yarn(rope_scaling, "rope_scaling")

    # --- checkpoint format
    quant = take("quantization_config")
    expert_dtype = take("expert_dtype")
    if quant is not None:
        kw.update(_parse_quantization(quant))
    if expert_dtype is not None:
        if kw.get("expert_dtype", expert_dtype) != expert_dtype:
            raise ValueError(
                f"expert_dtype ({expert_dtype!r}) disagrees with quantization_config.expert_dtype "
                f"({kw['expert_dtype']!r})"
            )
        kw["expert_dtype"] = expert_dtype

    unknown = sorted(set(d) - consumed - IGNORED_HF_KEYS)
    if unknown:
        raise ValueError(f"unknown config keys: {unknown}")
    kw.update(overrides)
    return kw


def dump(config: Config) -> dict[str, Any]:
    """The transformers-flavoured config.json dictionary of `config`."""
    rope_dim = config.qk_rope_head_dim
    partial = rope_dim / config.head_dim
    compress: dict[str, Any] = {
        "rope_type": "default",
        "rope_theta": config.compress_rope_theta,
        "partial_rotary_factor": partial,
    }
    if config.rope_scaling is not None:
        y = config.rope_scaling
        compress.update(
            rope_type="yarn",
            factor=y.factor,
            original_max_position_embeddings=y.original_max_position_embeddings,
            beta_fast=y.beta_fast,
            beta_slow=y.beta_slow,
            attention_factor=1.0,
        )
    eos = config.eos_token_id
    out: dict[str, Any] = {
        "model_type": "deepseek_v4",
        **{f.name: getattr(config, f.name) for f in _fields("plain")},
        **{k: v for k, v in _FIXED_KEYS.items() if k != "topk_method"},
        "qk_rope_head_dim": rope_dim,
        "partial_rotary_factor": partial,
        "layer_types": list(config.layer_types),
        "mlp_layer_types": list(config.mlp_layer_types),
        "compress_rates": {CSA: config.compress_rate_csa, HCA: config.compress_rate_hca},
        "rope_parameters": {
            "main": {
                "rope_type": "default",
                "rope_theta": config.rope_theta,
                "partial_rotary_factor": partial,
            },
            "compress": compress,
        },
        "eos_token_id": list(eos) if isinstance(eos, tuple) else eos,
    }
    if config.fp8_block_size is not None:
        out["quantization_config"] = {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "scale_fmt": "ue8m0",
            "activation_scheme": "dynamic",
            "weight_block_size": list(config.fp8_block_size),
        }
    if config.expert_dtype is not None:
        out["expert_dtype"] = config.expert_dtype
    if config.dspark:
        out["dspark_target_layer_ids"] = list(config.dspark_target_layer_ids or ())
        out["dspark_stages"] = config.dspark_stages
    else:
        for name in DSPARK_FIELDS:
            out.pop(name, None)
    return out


def _layer_types_from_ratios(ratios, n_layers, n_mtp) -> dict[str, Any]:
    if not isinstance(ratios, list | tuple) or not all(isinstance(r, int) for r in ratios):
        raise ValueError(f"compress_ratios must be a list of ints, got {ratios!r}")
    if not isinstance(n_layers, int):
        raise ValueError("compress_ratios needs num_hidden_layers")
    if len(ratios) not in (n_layers, n_layers + n_mtp):
        raise ValueError(
            f"compress_ratios has {len(ratios)} entries; expected num_hidden_layers ({n_layers}) "
            f"or num_hidden_layers + the MTP or DSpark stages ({n_layers + n_mtp})"
        )
    if any(r != 0 for r in ratios[n_layers:]):
        raise ValueError(
            f"compress_ratios entries for the MTP or DSpark stages must be 0 (sliding-only), got "
            f"{list(ratios[n_layers:])}"
        )
    ratios = ratios[:n_layers]
    bad = sorted({r for r in ratios if r < 0})
    if bad:
        raise ValueError(f"compress_ratios has negative entries {bad}")
    # The official code recognises CSA by ratio 4 (overlapping windows + indexer); any other
    # positive ratio is HCA.
    hca_rates = sorted({r for r in ratios if r not in (0, 4)})
    if len(hca_rates) > 1:
        raise ValueError(f"compress_ratios mixes several HCA ratios {hca_rates}")
    out: dict[str, Any] = {
        "layer_types": tuple({0: SLIDING, 4: CSA}.get(r, HCA) for r in ratios),
        "compress_rate_csa": 4,
    }
    if hca_rates:
        out["compress_rate_hca"] = hca_rates[0]
    return out


def _parse_yarn(spec: Any, where: str) -> YarnScaling | None:
    if not isinstance(spec, dict):
        raise ValueError(f"{where} must be a dict, got {spec!r}")
    spec = dict(spec)
    kind = spec.pop("rope_type", spec.pop("type", "default"))
    for key in ("rope_theta", "partial_rotary_factor"):
        spec.pop(key, None)
    if kind == "default":
        if spec:
            raise ValueError(f"{where}: keys {sorted(spec)} are not used by rope_type 'default'")
        return None
    if kind != "yarn":
        raise ValueError(f"{where}: rope_type must be 'default' or 'yarn', got {kind!r}")
    attention_factor = spec.pop("attention_factor", 1.0)
    if attention_factor != 1.0:
        raise ValueError(
            f"{where}.attention_factor must be 1.0 (DeepSeek-V4 applies no YaRN mscale), "
            f"got {attention_factor}"
        )
    for key in ("mscale", "mscale_all_dim"):
        spec.pop(key, None)
    if spec.pop("truncate", True) is not True:
        raise ValueError(f"{where}.truncate must be true")
    known = {"factor", "original_max_position_embeddings", "beta_fast", "beta_slow"}
    unknown = sorted(set(spec) - known)
    if unknown:
        raise ValueError(f"{where}: unknown keys {unknown}")
    missing = sorted({"factor", "original_max_position_embeddings"} - set(spec))
    if missing:
        raise ValueError(f"{where}: missing keys {missing}")
    return YarnScaling(
        factor=float(spec["factor"]),
        original_max_position_embeddings=int(spec["original_max_position_embeddings"]),
        beta_fast=float(spec.get("beta_fast") or 32.0),
        beta_slow=float(spec.get("beta_slow") or 1.0),
    )


def _parse_rope_parameters(rp: Any, kw: dict[str, Any], head_dim: int) -> dict[str, Any]:
    if not isinstance(rp, dict):
        raise ValueError(f"rope_parameters must be a dict, got {rp!r}")
    out: dict[str, Any] = {}
    if isinstance(rp.get("main"), dict) and isinstance(rp.get("compress"), dict):
        unknown = sorted(set(rp) - {"main", "compress"})
        if unknown:
            raise ValueError(f"rope_parameters: unknown keys {unknown}")
        for label in ("main", "compress"):
            sub = rp[label]
            partial = sub.get("partial_rotary_factor")
            if partial is not None and int(head_dim * partial) != kw.get("qk_rope_head_dim", 64):
                raise ValueError(
                    f"rope_parameters.{label}.partial_rotary_factor ({partial}) disagrees with "
                    f"qk_rope_head_dim ({kw.get('qk_rope_head_dim', 64)})"
                )
        main = rp["main"]
        if _parse_yarn(main, "rope_parameters.main") is not None:
            raise ValueError("rope_parameters.main must use rope_type 'default'")
        if "rope_theta" in main:
            out["rope_theta"] = float(main["rope_theta"])
        compress = rp["compress"]
        if "rope_theta" in compress:
            out["compress_rope_theta"] = float(compress["rope_theta"])
        out["rope_scaling"] = _parse_yarn(compress, "rope_parameters.compress")
    else:
        # Flat form: the YaRN keys of the compressed layers (transformers folds them the same way).
        out["rope_scaling"] = _parse_yarn(rp, "rope_parameters")
    return out


def _parse_quantization(q: Any) -> dict[str, Any]:
    if not isinstance(q, dict):
        raise ValueError(f"quantization_config must be a dict, got {q!r}")
    unknown = sorted(set(q) - _QUANT_KEYS)
    if unknown:
        raise ValueError(f"quantization_config: unknown keys {unknown}")
    for key, expected in (("quant_method", "fp8"), ("fmt", "e4m3"), ("scale_fmt", "ue8m0")):
        if key in q and q[key] != expected:
            raise ValueError(f"quantization_config.{key} must be {expected!r}, got {q[key]!r}")
    out: dict[str, Any] = {}
    block = q.get("weight_block_size", [128, 128])
    if not (isinstance(block, list | tuple) and len(block) == 2 and all(b > 0 for b in block)):
        raise ValueError(f"quantization_config.weight_block_size must be [int, int], got {block}")
    out["fp8_block_size"] = (int(block[0]), int(block[1]))
    if "expert_dtype" in q:
        out["expert_dtype"] = q["expert_dtype"]
    return out
