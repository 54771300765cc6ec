"""The name table: checkpoint tensor names -> canonical names -> paths in the model pytree.

Canonical names are the official DeepSeek-V4 release names (flat, no `model.` prefix, e.g.
`layers.3.attn.wq_a.weight`). Routed experts have two canonical forms: one expert
(`layers.3.ffn.experts.17.w1.weight`, as released) or the whole stack (`layers.3.ffn.experts.w1`,
`[experts, inter, d_model]`, as transformers stores it).

Module attributes follow the official names, so a canonical name is mostly its own pytree path;
the rows below are the exceptions: the mHC parameters (`hc_attn_fn` -> `hc_attn.fn`), the
expert stacks, the layer index (resolved through the model's `LayerPlan` to an unrolled block or
a slot of a scanned stack) and the MTP block's inner decoder block.
"""

import re
from collections.abc import Callable

import numpy as np

from equinox_dsv4 import LayerPlan


Transform = Callable[[np.ndarray], np.ndarray]


def _identity(x: np.ndarray) -> np.ndarray:
    return x


def _first_half(x: np.ndarray) -> np.ndarray:
    return x[:, : x.shape[1] // 2]


def _second_half(x: np.ndarray) -> np.ndarray:
    return x[:, x.shape[1] // 2 :]


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


def hf_to_canonical(name: str) -> tuple[tuple[str, Transform], ...] | None:
    """Canonical names (with the transform that produces each) for a transformers tensor name,
    or `None` when the name is not part of the model."""
    for pattern, targets in _HF_COMPILED:
        if m := pattern.fullmatch(name):
            return tuple((t.format(*m.groups()), f) for t, f in targets)
    return None


_HC = re.compile(r"hc_(attn|ffn)_(fn|base|scale)")
_EXPERT = re.compile(r"ffn\.experts\.(\d+)\.(w1|w2|w3)\.weight")
_EXPERT_STACK = re.compile(r"ffn\.experts\.(w1|w2|w3)")
_LAYER = re.compile(r"layers\.(\d+)\.(.+)")
_MTP = re.compile(r"mtp\.(\d+)\.(.+)")
_HC_HEAD = re.compile(r"hc_head_(fn|base|scale)")
_GLOBAL = {"embed.weight", "head.weight", "norm.weight"}
_MTP_OWN = {"e_proj.weight", "h_proj.weight", "enorm.weight", "hnorm.weight", "norm.weight"}


def block_path(rest: str) -> tuple[str, tuple[int, ...]]:
    """Path (relative to a `Block`) and leading index of a canonical per-layer name such as
    `attn.wq_a.weight`, `hc_attn_fn` or `ffn.experts.7.w1.weight`."""
    if m := _HC.fullmatch(rest):
        return f".hc_{m[1]}.{m[2]}", ()
    if m := _EXPERT.fullmatch(rest):
        return f".ffn.experts.{m[2]}", (int(m[1]),)
    if m := _EXPERT_STACK.fullmatch(rest):
        return f".ffn.experts.{m[1]}", ()
    return "." + rest, ()


def canonical_to_path(name: str, plan: LayerPlan) -> tuple[str, tuple[int, ...]] | None:
    """`(pytree path, leading index)` of a canonical name in a model with this plan: the tensor
    fills `leaf[index]` of the leaf whose `jax.tree_util.keystr` is `path`. `None` when the name
    cannot belong to such a model (e.g. a layer beyond the plan)."""
    if name in _GLOBAL:
        return "." + name, ()
    if m := _HC_HEAD.fullmatch(name):
        return f".hc_head.{m[1]}", ()
    if m := _LAYER.fullmatch(name):
        layer = int(m[1])
        if layer >= plan.num_layers:
            return None
        segment, position, repeat = plan.locate(layer)
        path, index = block_path(m[2])
        if plan.segments[segment].scanned:
            return f".layers[{segment}].blocks[{position}]{path}", (repeat, *index)
        return f".layers[{segment}]{path}", index
    if m := _MTP.fullmatch(name):
        depth, rest = int(m[1]), m[2]
        if rest in _MTP_OWN:
            return f".mtp[{depth}].{rest}", ()
        if h := _HC_HEAD.fullmatch(rest):
            return f".mtp[{depth}].hc_head.{h[1]}", ()
        path, index = block_path(rest)
        return f".mtp[{depth}].block{path}", index
    return None
