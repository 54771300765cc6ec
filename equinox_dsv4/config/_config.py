"""The typed, frozen model configuration: its fields, their invariants and the presets. The
config.json dialects it is read from and written to live in `_hf_config`."""

import dataclasses
import os
import pathlib
from typing import Any

from . import _presets


_CONFIG_DIR = pathlib.Path(__file__).parent / "presets"

SLIDING = "sliding_attention"
CSA = "compressed_sparse_attention"
HCA = "heavily_compressed_attention"
LAYER_TYPES = (SLIDING, CSA, HCA)
HASH_MOE = "hash_moe"
MOE = "moe"
MLP_LAYER_TYPES = (HASH_MOE, MOE)
SCORING_FUNCS = ("sqrtsoftplus", "softmax", "sigmoid")
NUMERICS = ("exact", "release")
DSPARK_FIELDS = (
    "dspark_block_size",
    "dspark_markov_rank",
    "dspark_target_layer_ids",
    "dspark_noise_token_id",
)
# Stages of a DSpark drafter when neither the config nor a checkpoint says (the releases' 3).
DSPARK_STAGES = 3


def _field(default: Any = dataclasses.MISSING, *, hf: str | None = "plain", least: int = 1) -> Any:
    """A `Config` field. `hf`: how config.json holds it: "plain" (under its own name),
    "custom" (`_hf_config` reads and writes it), `None` (not in config.json). `least`: the
    smallest value allowed for an int field (a float field must be positive unless
    `least == 0`)."""
    return dataclasses.field(default=default, metadata={"hf": hf, "least": least})


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
    vocab_size: int = _field()
    hidden_size: int = _field()
    num_hidden_layers: int = _field()
    # --- attention: low-rank q, one shared K=V head, grouped low-rank output
    num_attention_heads: int = _field()
    head_dim: int = _field(512)
    qk_rope_head_dim: int = _field(64, hf="custom")  # or partial_rotary_factor * head_dim
    q_lora_rank: int = _field()
    o_groups: int = _field()
    o_lora_rank: int = _field()
    sliding_window: int = _field(128)
    # --- layer schedule (one entry per decoder layer; the MTP block is separate)
    layer_types: tuple[str, ...] = _field(hf="custom")
    mlp_layer_types: tuple[str, ...] = _field(hf="custom")
    compress_rate_csa: int = _field(4, hf="custom")
    compress_rate_hca: int = _field(128, hf="custom")
    # --- Lightning Indexer (CSA layers)
    index_n_heads: int = _field(64)
    index_head_dim: int = _field(128)
    index_topk: int = _field(512)
    # --- manifold-constrained hyper-connections
    hc_mult: int = _field(4)
    hc_sinkhorn_iters: int = _field(20)
    hc_eps: float = _field(1e-6)
    # --- MoE
    n_routed_experts: int = _field()
    num_experts_per_tok: int = _field()
    n_shared_experts: int = _field(1)
    moe_intermediate_size: int = _field()
    scoring_func: str = _field("sqrtsoftplus")  # "sqrtsoftplus", "softmax" or "sigmoid"
    norm_topk_prob: bool = _field(True)
    routed_scaling_factor: float = _field(1.0)
    swiglu_limit: float = _field(10.0, least=0)  # 0: no clamp
    # --- RoPE: sliding-only layers use `rope_theta` plainly; CSA/HCA layers use
    # `compress_rope_theta` with `rope_scaling` (YaRN) when given.
    rope_theta: float = _field(10000.0)
    compress_rope_theta: float = _field(160000.0)
    rope_scaling: YarnScaling | None = _field(None, hf="custom")
    max_position_embeddings: int = _field(1048576)
    # --- misc
    rms_norm_eps: float = _field(1e-6)
    num_nextn_predict_layers: int = _field(1, least=0)  # MTP blocks; none with a DSpark drafter
    bos_token_id: int | None = _field(0)
    eos_token_id: int | tuple[int, ...] | None = _field(1, hf="custom")
    # --- DSpark drafter (V4-Flash-0731, V4-*-DSpark; `None` / 0: no drafter). Its stages are
    # the checkpoint's `mtp.<i>` blocks, which then hold no MTP block; `dspark_stages` counts
    # them (config.json's `num_nextn_predict_layers` stays 1 in those releases).
    dspark_block_size: int | None = _field(None)  # draft slots per block (5)
    dspark_markov_rank: int | None = _field(None)  # width of the Markov head (256)
    dspark_target_layer_ids: tuple[int, ...] | None = _field(None, hf="custom")  # context taps
    dspark_noise_token_id: int | None = _field(None)  # the token of the slots after the first
    dspark_stages: int = _field(0, hf="custom", least=0)
    # --- checkpoint format (read by the converter; no effect on the computation)
    fp8_block_size: tuple[int, int] | None = _field(None, hf="custom")
    expert_dtype: str | None = _field(None, hf="custom")
    # --- numerics: "exact" (no quantisation round trips, as transformers computes) or
    # "release" (the FP8/FP4 round trips the release was trained with, see `_numerics`)
    numerics: str = _field("exact", hf=None)
    # --- execution
    scan_layers: bool = _field(True, hf=None)
    scan_min_repeats: int = _field(3, hf=None, least=2)

    def __post_init__(self):
        for f in dataclasses.fields(self):
            value, least = getattr(self, f.name), f.metadata["least"]
            if f.type is int and (
                not isinstance(value, int) or isinstance(value, bool) or value < least
            ):
                kind = "a positive int" if least == 1 else f"an int >= {least}"
                raise ValueError(f"{f.name} must be {kind}, got {value!r}")
            if f.type is float and not (value > 0 or (least == 0 and value == 0)):
                kind = "positive" if least else ">= 0"
                raise ValueError(f"{f.name} must be {kind}, got {value!r}")
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
        if rope % 2:
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
        if self.numerics not in NUMERICS:
            raise ValueError(f"numerics must be one of {list(NUMERICS)}, got {self.numerics!r}")
        index_dim = self.index_head_dim
        if self.numerics == "release" and CSA in self.layer_types and index_dim & (index_dim - 1):
            raise ValueError(
                f"numerics='release' rotates the indexer's {index_dim}-wide queries and keys "
                "by a Hadamard transform: index_head_dim must be a power of two"
            )
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, YarnScaling):
            raise ValueError(f"rope_scaling must be a YarnScaling, got {self.rope_scaling!r}")
        self._check_dspark()

    def _check_dspark(self) -> None:
        values = {name: getattr(self, name) for name in DSPARK_FIELDS}
        given = sorted(name for name, value in values.items() if value is not None)
        if not given:
            if self.dspark_stages:
                raise ValueError(
                    f"dspark_stages is {self.dspark_stages} but no dspark_* field is set: "
                    f"give {list(DSPARK_FIELDS)}"
                )
            return
        if not self.dspark_stages:  # the releases' count when nothing says otherwise
            object.__setattr__(self, "dspark_stages", DSPARK_STAGES)
        if len(given) < len(DSPARK_FIELDS):
            missing = sorted(set(DSPARK_FIELDS) - set(given))
            raise ValueError(f"a DSpark drafter needs every dspark_* field; missing {missing}")
        for name in ("dspark_block_size", "dspark_markov_rank"):
            value = values[name]
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        noise = self.dspark_noise_token_id
        if isinstance(noise, bool) or not (isinstance(noise, int) and 0 <= noise < self.vocab_size):
            raise ValueError(
                f"dspark_noise_token_id must be a token id below vocab_size ({self.vocab_size}), "
                f"got {noise!r}"
            )
        ids = self.dspark_target_layer_ids
        if (
            not isinstance(ids, tuple)
            or not ids
            or not all(isinstance(i, int) and 0 <= i < self.num_hidden_layers for i in ids)
            or len(set(ids)) != len(ids)
        ):
            raise ValueError(
                "dspark_target_layer_ids must be a non-empty tuple of distinct decoder layer "
                f"indices in 0 .. {self.num_hidden_layers - 1}, got {ids!r}"
            )

    # --- derived values

    def compress_ratio(self, layer: int) -> int:
        """Compression ratio of decoder layer `layer` (0 for sliding-only layers)."""
        return {SLIDING: 0, CSA: self.compress_rate_csa, HCA: self.compress_rate_hca}[
            self.layer_types[layer]
        ]

    @property
    def dspark(self) -> bool:
        """Whether the model has a DSpark drafter."""
        return self.dspark_stages > 0

    @property
    def mtp_blocks(self) -> int:
        """How many MTP blocks the model has: `num_nextn_predict_layers`, or none when the
        checkpoint's `mtp.<i>` blocks are DSpark stages."""
        return 0 if self.dspark else self.num_nextn_predict_layers

    @property
    def num_hash_layers(self) -> int:
        return sum(t == HASH_MOE for t in self.mlp_layer_types)

    # --- presets

    @classmethod
    def v4_flash(cls, **overrides: Any) -> "Config":
        """DeepSeek-V4-Flash (284B total, 13B active), as released."""
        return cls.from_hf(_presets.V4_FLASH, **overrides)

    @classmethod
    def v4_pro(cls, **overrides: Any) -> "Config":
        """DeepSeek-V4-Pro (1.6T total, 49B active), as released."""
        return cls.from_hf(_presets.V4_PRO, **overrides)

    @classmethod
    def v4_flash_0731(cls, **overrides: Any) -> "Config":
        """DeepSeek-V4-Flash-0731, as released: V4-Flash's trunk with a three-stage DSpark
        drafter (`dspark_*`) in place of the MTP block."""
        return cls.from_hf(_presets.V4_FLASH_0731, **overrides)

    @classmethod
    def tiny(cls, **overrides: Any) -> "Config":
        """The embedded default: V4-Flash's layer pattern at toy size (9 layers, hidden 64, 3
        Sinkhorn iterations where the release has 20, the real 129280-token vocabulary), from
        `equinox_dsv4/config/presets/tiny.json`. The Sinkhorn loop is unrolled, so at a toy
        width its rounds are much of what every program compiles."""
        return cls.from_json(_CONFIG_DIR / "tiny.json", **overrides)

    def first_layers(self, layers: int) -> "Config":
        """The same config keeping only its first `layers` decoder layers (the head, MTP and
        everything else unchanged): for smoke runs of a large model on a small machine."""
        if not 0 < layers <= self.num_hidden_layers:
            raise ValueError(f"layers must be in 1..{self.num_hidden_layers}, got {layers}")
        targets = self.dspark_target_layer_ids
        if targets is not None and max(targets) >= layers:
            # The drafter then reads the last layers kept, as the release reads its last three.
            if layers < len(targets):
                raise ValueError(
                    f"a DSpark drafter reads {len(targets)} layers; keep at least that many"
                )
            targets = tuple(range(layers - len(targets), layers))
        return dataclasses.replace(
            self,
            num_hidden_layers=layers,
            layer_types=self.layer_types[:layers],
            mlp_layer_types=self.mlp_layer_types[:layers],
            dspark_target_layer_ids=targets,
        )

    def trunk_only(self) -> "Config":
        """The same config without MTP blocks or a DSpark drafter."""
        return dataclasses.replace(
            self,
            num_nextn_predict_layers=0,
            dspark_stages=0,
            **{name: None for name in DSPARK_FIELDS},
        )

    # --- config.json (both flavours; see `_hf_config`)

    @classmethod
    def from_json(cls, path: str | os.PathLike, **overrides: Any) -> "Config":
        """Read a config.json of either flavour (see `from_hf`)."""
        from ._hf import read_json

        return cls.from_hf(read_json(path), **overrides)

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
        from ._hf import parse

        return cls(**parse(data, overrides))

    def to_hf(self) -> dict[str, Any]:
        """The transformers-flavoured config.json dictionary for this config."""
        from ._hf import dump

        return dump(self)
