"""The name table: checkpoint tensor names -> canonical names.

Canonical names are the official release names (see `equinox_dsv4.ckpt`, which maps them to pytree
paths), so the official layout needs no renaming: its only companions are the `.scale`
tensors of quantised weights. transformers' in-memory names (its `state_dict`) rename nearly
everything and stack each layer's routed experts, with `w1` and `w3` concatenated into
`gate_up_proj`; what its `save_pretrained` writes is close to official again. The tables below
undo both, one row per tensor kind.
"""

import dataclasses
import re

import numpy as np


@dataclasses.dataclass(frozen=True)
class Transform:
    """What becomes of a source tensor: all of it, or the first or second half of dim 1 (the
    `gate_up_proj` stack `[experts, 2 * inter, d_model]` holds `w1` then `w3`)."""

    part: str = "all"  # "all", "first_half" or "second_half"

    def __call__(self, x: np.ndarray) -> np.ndarray:
        if self.part == "all":
            return x
        half = x.shape[1] // 2
        return x[:, :half] if self.part == "first_half" else x[:, half:]

    def shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        if self.part == "all":
            return shape
        return (shape[0], shape[1] // 2, *shape[2:])


_identity, _first_half, _second_half = (
    Transform(),
    Transform("first_half"),
    Transform("second_half"),
)


# transformers `save_pretrained` names (transformers 5.24) -> canonical names: one row per tensor
# kind, `(regex over the transformers name, ((canonical template, transform), ...))`, where `{0}`
# in a template is the regex's layer group.
_L = r"model\.layers\.(\d+)\."
_ATTN = {
    "q_a_proj.weight": "wq_a.weight",
    "q_a_norm.weight": "q_norm.weight",
    "q_b_proj.weight": "wq_b.weight",
    "kv_proj.weight": "wkv.weight",
    "kv_norm.weight": "kv_norm.weight",
    "o_a_proj.weight": "wo_a.weight",
    "o_b_proj.weight": "wo_b.weight",
    "sinks": "attn_sink",
}
_COMPRESSOR = {
    "kv_proj.weight": "wkv.weight",
    "gate_proj.weight": "wgate.weight",
    "position_bias": "ape",
    "kv_norm.weight": "norm.weight",
}
_SHARED = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
_HF_TABLE: tuple[tuple[str, tuple[tuple[str, Transform], ...]], ...] = (
    (r"model\.embed_tokens\.weight", (("embed.weight", _identity),)),
    (r"lm_head\.weight", (("head.weight", _identity),)),
    (r"model\.norm\.weight", (("norm.weight", _identity),)),
    *(
        (rf"model\.hc_head\.hc_{p}", ((f"hc_head_{p}", _identity),))
        for p in ("fn", "base", "scale")
    ),
    (_L + r"input_layernorm\.weight", (("layers.{0}.attn_norm.weight", _identity),)),
    (_L + r"post_attention_layernorm\.weight", (("layers.{0}.ffn_norm.weight", _identity),)),
    *(
        (_L + rf"{hf}_hc\.{p}", ((f"layers.{{0}}.hc_{site}_{p}", _identity),))
        for hf, site in (("attn", "attn"), ("ffn", "ffn"))
        for p in ("fn", "base", "scale")
    ),
    *(
        (_L + r"self_attn\." + re.escape(hf), ((f"layers.{{0}}.attn.{ours}", _identity),))
        for hf, ours in _ATTN.items()
    ),
    *(
        (
            _L + r"self_attn\.compressor\." + re.escape(hf),
            ((f"layers.{{0}}.attn.compressor.{ours}", _identity),),
        )
        for hf, ours in _COMPRESSOR.items()
    ),
    *(
        (
            _L + r"self_attn\.compressor\.indexer\." + re.escape(hf),
            ((f"layers.{{0}}.attn.indexer.compressor.{ours}", _identity),),
        )
        for hf, ours in _COMPRESSOR.items()
    ),
    (
        _L + r"self_attn\.compressor\.indexer\.q_b_proj\.weight",
        (("layers.{0}.attn.indexer.wq_b.weight", _identity),),
    ),
    (
        _L + r"self_attn\.compressor\.indexer\.scorer\.weights_proj\.weight",
        (("layers.{0}.attn.indexer.weights_proj.weight", _identity),),
    ),
    (_L + r"mlp\.gate\.weight", (("layers.{0}.ffn.gate.weight", _identity),)),
    (_L + r"mlp\.gate\.e_score_correction_bias", (("layers.{0}.ffn.gate.bias", _identity),)),
    (_L + r"mlp\.gate\.tid2eid", (("layers.{0}.ffn.gate.tid2eid", _identity),)),
    *(
        (
            _L + rf"mlp\.shared_experts\.{hf}\.weight",
            ((f"layers.{{0}}.ffn.shared_experts.{ours}.weight", _identity),),
        )
        for hf, ours in _SHARED.items()
    ),
    (
        _L + r"mlp\.experts\.gate_up_proj",
        (
            ("layers.{0}.ffn.experts.w1", _first_half),
            ("layers.{0}.ffn.experts.w3", _second_half),
        ),
    ),
    (_L + r"mlp\.experts\.down_proj", (("layers.{0}.ffn.experts.w2", _identity),)),
)
_HF_COMPILED = tuple((re.compile(p), targets) for p, targets in _HF_TABLE)


# What `save_pretrained` writes (transformers 5.24): it reverses its own load-time renames, so
# inside the `model.` prefix the names are the official ones, except for keys its anchored
# patterns miss and the attention's kv_norm, which its `.kv_norm.` <-> `.norm.` rule (meant for
# the compressors) turns into `attn.norm`.
_SAVED_TABLE = (
    (r"model\.embed_tokens\.weight", "embed.weight"),
    (r"model\.hc_head\.hc_(fn|base|scale)", "hc_head_{0}"),
    (r"model\.layers\.(\d+)\.attn\.norm\.weight", "layers.{0}.attn.kv_norm.weight"),
    (r"model\.(.+)", "{0}"),
)
_SAVED_COMPILED = tuple((re.compile(p), t) for p, t in _SAVED_TABLE)


def hf_to_canonical(name: str) -> tuple[tuple[str, Transform], ...] | None:
    """Canonical names (with the transform that produces each) for a transformers tensor name,
    in-memory (`state_dict`) or as `save_pretrained` writes it; `None` for any other name
    (official names are canonical already)."""
    for pattern, targets in _HF_COMPILED:
        if m := pattern.fullmatch(name):
            return tuple((t.format(*m.groups()), f) for t, f in targets)
    for pattern, template in _SAVED_COMPILED:
        if m := pattern.fullmatch(name):
            return ((template.format(*m.groups()), _identity),)
    return None


def scale_owner(name: str) -> str | None:
    """The weight a quantisation scale belongs to: `X.scale` (official) and
    `X.weight_scale_inv` (transformers' FP8 layout) scale `X.weight`; `None` for other names."""
    if name.endswith(".weight_scale_inv"):
        return name[: -len("_scale_inv")]
    if name.endswith(".scale"):
        return name[: -len(".scale")] + ".weight"
    return None
