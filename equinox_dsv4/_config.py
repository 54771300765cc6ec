"""The typed, frozen model configuration and its readers for both flavours of config.json."""

import dataclasses
import json
import os
import pathlib
from typing import Any


_CONFIG_DIR = pathlib.Path(__file__).parent / "configs"

SLIDING = "sliding_attention"
CSA = "compressed_sparse_attention"
HCA = "heavily_compressed_attention"
LAYER_TYPES = (SLIDING, CSA, HCA)
HASH_MOE = "hash_moe"
MOE = "moe"
MLP_LAYER_TYPES = (HASH_MOE, MOE)
SCORING_FUNCS = ("sqrtsoftplus", "softmax", "sigmoid")

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


@dataclasses.dataclass(frozen=True, kw_only=True)
class YarnScaling:
    """YaRN frequency interpolation (as in DeepSeek-V3), used by the compressed layers' RoPE.

    No attention (mscale) factor is applied: the softmax scale stays `head_dim**-0.5`.
    """

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0

    def __post_init__(self):
        if self.factor <= 0:
            raise ValueError(f"rope_scaling.factor must be positive, got {self.factor}")
        if self.original_max_position_embeddings <= 0:
            raise ValueError(
                "rope_scaling.original_max_position_embeddings must be positive, got "
                f"{self.original_max_position_embeddings}"
            )


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
    """Hyperparameters of a DeepSeek-V4 model.

    Field names follow the transformers `DeepseekV4Config`. Build one with a preset
    (`Config.v4_flash()`, `Config.v4_pro()`), from a config.json (`Config.from_json`,
    `Config.from_hf`) or directly; change one with `dataclasses.replace`. Invalid
    combinations raise `ValueError` naming the field.
    """

    # --- sizes
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    # --- attention: low-rank q, one shared K=V head, grouped low-rank output
    num_attention_heads: int
    head_dim: int = 512
    qk_rope_head_dim: int = 64
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    sliding_window: int = 128
    # --- layer schedule (one entry per decoder layer; the MTP block is separate)
    layer_types: tuple[str, ...]
    mlp_layer_types: tuple[str, ...]
    compress_rate_csa: int = 4
    compress_rate_hca: int = 128
    # --- Lightning Indexer (CSA layers)
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    # --- manifold-constrained hyper-connections
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    # --- MoE
    n_routed_experts: int
    num_experts_per_tok: int
    n_shared_experts: int = 1
    moe_intermediate_size: int
    scoring_func: str = "sqrtsoftplus"  # "sqrtsoftplus", "softmax" or "sigmoid"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    swiglu_limit: float = 10.0
    # --- RoPE: sliding-only layers use `rope_theta` plainly; CSA/HCA layers use
    # `compress_rope_theta` with `rope_scaling` (YaRN) when given.
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    rope_scaling: YarnScaling | None = None
    max_position_embeddings: int = 1048576
    # --- misc
    rms_norm_eps: float = 1e-6
    num_nextn_predict_layers: int = 1
    bos_token_id: int | None = 0
    eos_token_id: int | tuple[int, ...] | None = 1
    # --- checkpoint format (read by the converter; no effect on the computation)
    fp8_block_size: tuple[int, int] | None = None
    expert_dtype: str | None = None
    # --- execution
    scan_layers: bool = True
    scan_min_repeats: int = 3

    def __post_init__(self):
        def positive(name):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")

        for name in (
            "vocab_size",
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "head_dim",
            "q_lora_rank",
            "o_groups",
            "o_lora_rank",
            "sliding_window",
            "compress_rate_csa",
            "compress_rate_hca",
            "index_n_heads",
            "index_head_dim",
            "index_topk",
            "hc_mult",
            "hc_sinkhorn_iters",
            "n_routed_experts",
            "num_experts_per_tok",
            "moe_intermediate_size",
            "max_position_embeddings",
            "scan_min_repeats",
        ):
            positive(name)
        if self.scan_min_repeats < 2:
            raise ValueError(f"scan_min_repeats must be >= 2, got {self.scan_min_repeats}")
        for name, types, allowed in (
            ("layer_types", self.layer_types, LAYER_TYPES),
            ("mlp_layer_types", self.mlp_layer_types, MLP_LAYER_TYPES),
        ):
            if not isinstance(types, tuple):
                raise ValueError(f"{name} must be a tuple, got {type(types).__name__}")
            if len(types) != self.num_hidden_layers:
                raise ValueError(
                    f"{name} has {len(types)} entries but num_hidden_layers is "
                    f"{self.num_hidden_layers}"
                )
            bad = sorted({t for t in types if t not in allowed})
            if bad:
                raise ValueError(f"{name} has unknown entries {bad}; allowed: {list(allowed)}")
        rope = self.qk_rope_head_dim
        if not isinstance(rope, int) or rope <= 0 or rope % 2:
            raise ValueError(f"qk_rope_head_dim must be a positive even int, got {rope!r}")
        if rope > self.head_dim:
            raise ValueError(f"qk_rope_head_dim ({rope}) exceeds head_dim ({self.head_dim})")
        if CSA in self.layer_types and rope > self.index_head_dim:
            raise ValueError(
                f"qk_rope_head_dim ({rope}) exceeds index_head_dim ({self.index_head_dim})"
            )
        if self.num_attention_heads % self.o_groups:
            raise ValueError(
                f"o_groups ({self.o_groups}) must divide num_attention_heads "
                f"({self.num_attention_heads})"
            )
        if self.num_experts_per_tok > self.n_routed_experts:
            raise ValueError(
                f"num_experts_per_tok ({self.num_experts_per_tok}) exceeds n_routed_experts "
                f"({self.n_routed_experts})"
            )
        if self.n_shared_experts != 1:
            raise ValueError(
                f"n_shared_experts must be 1 (DeepSeek-V4 has one shared expert), got "
                f"{self.n_shared_experts}"
            )
        if self.scoring_func not in SCORING_FUNCS:
            raise ValueError(
                f"scoring_func must be one of {list(SCORING_FUNCS)}, got {self.scoring_func!r}"
            )
        if self.num_nextn_predict_layers < 0:
            raise ValueError(
                f"num_nextn_predict_layers must be >= 0, got {self.num_nextn_predict_layers}"
            )
        for name in ("rms_norm_eps", "hc_eps", "rope_theta", "compress_rope_theta"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)!r}")
        if self.swiglu_limit < 0:
            raise ValueError(f"swiglu_limit must be >= 0, got {self.swiglu_limit}")
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, YarnScaling):
            raise ValueError(f"rope_scaling must be a YarnScaling, got {self.rope_scaling!r}")

    # --- derived values

    def compress_ratio(self, layer: int) -> int:
        """Compression ratio of decoder layer `layer` (0 for sliding-only layers)."""
        return {SLIDING: 0, CSA: self.compress_rate_csa, HCA: self.compress_rate_hca}[
            self.layer_types[layer]
        ]

    @property
    def num_hash_layers(self) -> int:
        return sum(t == HASH_MOE for t in self.mlp_layer_types)

    # --- presets

    @classmethod
    def v4_flash(cls, **overrides: Any) -> "Config":
        """DeepSeek-V4-Flash (284B total, 13B active), as released."""
        return cls.from_hf(_released_config(**_FLASH), **overrides)

    @classmethod
    def v4_pro(cls, **overrides: Any) -> "Config":
        """DeepSeek-V4-Pro (1.6T total, 49B active), as released."""
        return cls.from_hf(_released_config(**_PRO), **overrides)

    @classmethod
    def tiny(cls, **overrides: Any) -> "Config":
        """The embedded default: V4-Flash's layer pattern at toy width (9 layers, hidden 64, the
        real 129280-token vocabulary), from `equinox_dsv4/configs/tiny.json`."""
        return cls.from_json(_CONFIG_DIR / "tiny.json", **overrides)

    def first_layers(self, layers: int) -> "Config":
        """The same config keeping only its first `layers` decoder layers (the head, MTP and
        everything else unchanged): for smoke runs of a large model on a small machine."""
        if not 0 < layers <= self.num_hidden_layers:
            raise ValueError(f"layers must be in 1..{self.num_hidden_layers}, got {layers}")
        return dataclasses.replace(
            self,
            num_hidden_layers=layers,
            layer_types=self.layer_types[:layers],
            mlp_layer_types=self.mlp_layer_types[:layers],
        )

    # --- readers / writers

    @classmethod
    def from_json(cls, path: str | os.PathLike, **overrides: Any) -> "Config":
        """Read a config.json of either flavour (see `from_hf`)."""
        with open(path) as f:
            try:
                data = json.load(f)
            except json.JSONDecodeError as e:
                raise ValueError(f"{os.fspath(path)} is not valid JSON: {e}") from None
        if not isinstance(data, dict):
            raise ValueError(f"{os.fspath(path)} must hold a JSON object")
        return cls.from_hf(data, **overrides)

    @classmethod
    def from_hf(cls, data: dict[str, Any], **overrides: Any) -> "Config":
        """Build a config from a config.json dictionary.

        Accepts the transformers flavour (`layer_types`, `mlp_layer_types`, `compress_rates`,
        nested `rope_parameters`) and the official release flavour (`compress_ratios` with the
        trailing MTP entries, `num_hash_layers`, `qk_rope_head_dim`, `rope_scaling`,
        `quantization_config`). Keys outside both flavours raise `ValueError` listing them,
        except the bookkeeping keys in `IGNORED_HF_KEYS`. `overrides` are `Config` fields
        applied last (e.g. `scan_layers=False`).
        """
        return _from_hf(cls, dict(data), overrides)

    def to_hf(self) -> dict[str, Any]:
        """The transformers-flavoured config.json dictionary for this config."""
        rope_dim = self.qk_rope_head_dim
        compress: dict[str, Any] = {
            "rope_type": "default",
            "rope_theta": self.compress_rope_theta,
            "partial_rotary_factor": rope_dim / self.head_dim,
        }
        if self.rope_scaling is not None:
            compress.update(
                rope_type="yarn",
                factor=self.rope_scaling.factor,
                original_max_position_embeddings=self.rope_scaling.original_max_position_embeddings,
                beta_fast=self.rope_scaling.beta_fast,
                beta_slow=self.rope_scaling.beta_slow,
                attention_factor=1.0,
            )
        out: dict[str, Any] = {
            "model_type": "deepseek_v4",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": 1,
            "head_dim": self.head_dim,
            "qk_rope_head_dim": rope_dim,
            "partial_rotary_factor": rope_dim / self.head_dim,
            "q_lora_rank": self.q_lora_rank,
            "o_groups": self.o_groups,
            "o_lora_rank": self.o_lora_rank,
            "sliding_window": self.sliding_window,
            "layer_types": list(self.layer_types),
            "mlp_layer_types": list(self.mlp_layer_types),
            "compress_rates": {CSA: self.compress_rate_csa, HCA: self.compress_rate_hca},
            "index_n_heads": self.index_n_heads,
            "index_head_dim": self.index_head_dim,
            "index_topk": self.index_topk,
            "hc_mult": self.hc_mult,
            "hc_sinkhorn_iters": self.hc_sinkhorn_iters,
            "hc_eps": self.hc_eps,
            "n_routed_experts": self.n_routed_experts,
            "num_experts_per_tok": self.num_experts_per_tok,
            "n_shared_experts": self.n_shared_experts,
            "moe_intermediate_size": self.moe_intermediate_size,
            "scoring_func": self.scoring_func,
            "norm_topk_prob": self.norm_topk_prob,
            "routed_scaling_factor": self.routed_scaling_factor,
            "swiglu_limit": self.swiglu_limit,
            "rope_theta": self.rope_theta,
            "compress_rope_theta": self.compress_rope_theta,
            "rope_parameters": {
                "main": {
                    "rope_type": "default",
                    "rope_theta": self.rope_theta,
                    "partial_rotary_factor": rope_dim / self.head_dim,
                },
                "compress": compress,
            },
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "num_nextn_predict_layers": self.num_nextn_predict_layers,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": (
                list(self.eos_token_id)
                if isinstance(self.eos_token_id, tuple)
                else self.eos_token_id
            ),
            "hidden_act": "silu",
            "attention_bias": False,
            "mlp_bias": False,
            "tie_word_embeddings": False,
        }
        if self.fp8_block_size is not None:
            out["quantization_config"] = {
                "quant_method": "fp8",
                "fmt": "e4m3",
                "scale_fmt": "ue8m0",
                "activation_scheme": "dynamic",
                "weight_block_size": list(self.fp8_block_size),
            }
        if self.expert_dtype is not None:
            out["expert_dtype"] = self.expert_dtype
        return out


# --------------------------------------------------------------------------------------------
# config.json parsing


_FIELD_NAMES = frozenset(f.name for f in dataclasses.fields(Config))

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


def _from_hf(cls, d: dict[str, Any], overrides: dict[str, Any]) -> Config:
    unknown_overrides = sorted(set(overrides) - _FIELD_NAMES)
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
    simple = (
        "vocab_size",
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "head_dim",
        "q_lora_rank",
        "o_groups",
        "o_lora_rank",
        "sliding_window",
        "index_n_heads",
        "index_head_dim",
        "index_topk",
        "hc_mult",
        "hc_sinkhorn_iters",
        "hc_eps",
        "n_routed_experts",
        "num_experts_per_tok",
        "n_shared_experts",
        "moe_intermediate_size",
        "scoring_func",
        "norm_topk_prob",
        "routed_scaling_factor",
        "swiglu_limit",
        "max_position_embeddings",
        "rms_norm_eps",
        "num_nextn_predict_layers",
        "bos_token_id",
    )
    floats = {"hc_eps", "routed_scaling_factor", "swiglu_limit", "rms_norm_eps"}
    for key in simple:
        if key in d:
            value = take(key)
            kw[key] = float(value) if key in floats and isinstance(value, int) else value
    missing = [
        k
        for k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")
        if k not in kw and k not in overrides
    ]
    if missing:
        raise ValueError(f"config is missing required keys: {missing}")
    if "eos_token_id" in d:
        eos = take("eos_token_id")
        kw["eos_token_id"] = tuple(eos) if isinstance(eos, list) else eos

    n_layers = overrides.get("num_hidden_layers", kw.get("num_hidden_layers"))
    n_mtp = kw.get("num_nextn_predict_layers", 1)
    head_dim = kw.get("head_dim", 512)

    # --- layer schedule
    rates = take("compress_rates")
    if rates is not None:
        if not isinstance(rates, dict) or set(rates) - {CSA, HCA}:
            raise ValueError(f"compress_rates must map {CSA!r}/{HCA!r} to ints, got {rates!r}")
        kw["compress_rate_csa"] = rates.get(CSA, 4)
        kw["compress_rate_hca"] = rates.get(HCA, 128)
    for legacy, field in (("compress_rate_csa", "csa"), ("compress_rate_hca", "hca")):
        if legacy in d:
            kw[f"compress_rate_{field}"] = take(legacy)
    ratios = take("compress_ratios")
    layer_types = take("layer_types")
    if layer_types is not None:
        kw["layer_types"] = tuple(layer_types)
    elif ratios is not None:
        kw.update(_layer_types_from_ratios(ratios, n_layers, n_mtp))
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
    if "rope_theta" in d:
        kw["rope_theta"] = float(take("rope_theta"))
    if "compress_rope_theta" in d:
        kw["compress_rope_theta"] = float(take("compress_rope_theta"))
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
    return cls(**kw)


def _layer_types_from_ratios(ratios, n_layers, n_mtp) -> dict[str, Any]:
    if not isinstance(ratios, list | tuple) or not all(isinstance(r, int) for r in ratios):
        raise ValueError(f"compress_ratios must be a list of ints, got {ratios!r}")
    if not isinstance(n_layers, int):
        raise ValueError("compress_ratios needs num_hidden_layers")
    if len(ratios) not in (n_layers, n_layers + n_mtp):
        raise ValueError(
            f"compress_ratios has {len(ratios)} entries; expected num_hidden_layers ({n_layers}) "
            f"or num_hidden_layers + num_nextn_predict_layers ({n_layers + n_mtp})"
        )
    if any(r != 0 for r in ratios[n_layers:]):
        raise ValueError(
            f"compress_ratios entries for the MTP block must be 0 (sliding-only), got "
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


# --------------------------------------------------------------------------------------------
# presets (released config.json values, official flavour)

_FLASH = dict(
    hidden_size=4096,
    num_hidden_layers=43,
    num_attention_heads=64,
    q_lora_rank=1024,
    o_groups=8,
    index_topk=512,
    n_routed_experts=256,
    moe_intermediate_size=2048,
    routed_scaling_factor=1.5,
    compress_ratios=[0, 0] + [4, 128] * 20 + [4, 0],
)
_PRO = dict(
    hidden_size=7168,
    num_hidden_layers=61,
    num_attention_heads=128,
    q_lora_rank=1536,
    o_groups=16,
    index_topk=1024,
    n_routed_experts=384,
    moe_intermediate_size=3072,
    routed_scaling_factor=2.5,
    compress_ratios=[128, 128] + [4, 128] * 29 + [4, 0],
)


def _released_config(**sizes: Any) -> dict[str, Any]:
    base = {
        "vocab_size": 129280,
        "head_dim": 512,
        "qk_rope_head_dim": 64,
        "o_lora_rank": 1024,
        "sliding_window": 128,
        "num_hash_layers": 3,
        "index_n_heads": 64,
        "index_head_dim": 128,
        "hc_mult": 4,
        "hc_sinkhorn_iters": 20,
        "hc_eps": 1e-6,
        "num_experts_per_tok": 6,
        "n_shared_experts": 1,
        "scoring_func": "sqrtsoftplus",
        "norm_topk_prob": True,
        "swiglu_limit": 10.0,
        "rope_theta": 10000,
        "compress_rope_theta": 160000,
        "rope_scaling": {
            "type": "yarn",
            "factor": 16,
            "original_max_position_embeddings": 65536,
            "beta_fast": 32,
            "beta_slow": 1,
        },
        "max_position_embeddings": 1048576,
        "rms_norm_eps": 1e-6,
        "num_nextn_predict_layers": 1,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "quantization_config": {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "scale_fmt": "ue8m0",
            "activation_scheme": "dynamic",
            "weight_block_size": [128, 128],
        },
        "expert_dtype": "fp4",
    }
    base.update(sizes)
    return base
