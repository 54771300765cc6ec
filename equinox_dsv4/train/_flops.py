"""Useful FLOPs and active parameters of a config: what the math of a forward pass, a decode
step or a train step needs (2 FLOPs per multiply-add), not what an implementation happens to
compute (no masked scores, no padding, no recomputation). The yardstick of MFU figures
(`python -m equinox_dsv4.compile`, the benchmarks' rooflines)."""

from typing import Literal

import equinox as eqx
import jax
import numpy as np

from .._typecheck import typechecked
from ..config import CSA, HCA, Config
from ..nn import DeepseekV4


@typechecked
def forward_flops(config: Config, tokens: int, *, logits: Literal["last", "all"] = "last") -> float:
    """Useful FLOPs of one sequence's causal forward over `tokens` positions: every decoder
    layer's projections, mHC mixes, router, shared and top-k routed experts, compressors and
    indexer, attention over the keys each position sees (its sliding window, its compressed
    blocks, the indexer's top-k), and the output head at the last position (`logits="last"`, a
    prefill) or at every position (`"all"`, training). The MTP block is not counted."""
    d, h, k = config.hidden_size, config.num_attention_heads, config.head_dim
    w, n = config.sliding_window, config.hc_mult
    t = np.arange(tokens)
    total = 0.0
    for layer_type in config.layer_types:
        per_token = 2 * 2 * n * d * (2 + n) * n  # two mHC sites
        per_token += 2 * (d * config.q_lora_rank + config.q_lora_rank * h * k + d * k)
        per_token += 2 * (h * k * config.o_lora_rank + config.o_groups * config.o_lora_rank * d)
        per_token += 2 * d * config.n_routed_experts
        per_token += 3 * 2 * d * config.moe_intermediate_size * (config.num_experts_per_tok + 1)
        keys = np.minimum(t + 1, w).astype(float)
        if layer_type == HCA:
            per_token += 2 * 2 * d * k
            keys += (t + 1) // config.compress_rate_hca
        if layer_type == CSA:
            di, hi = config.index_head_dim, config.index_n_heads
            per_token += 2 * 2 * d * 2 * k + 2 * 2 * d * 2 * di  # compressor + index keys
            per_token += 2 * (config.q_lora_rank * hi * di + d * hi)
            visible = (t + 1) // config.compress_rate_csa
            total += float(np.sum(2 * hi * di * visible))  # index scores
            keys += np.minimum(visible, config.index_topk)
        total += tokens * per_token + float(np.sum(2 * 2 * h * k * keys))
    head = 2 * d * config.vocab_size + 2 * n * n * d  # the head and its mHC reduction
    return total + head * (tokens if logits == "all" else 1)


@typechecked
def train_flops(config: Config, tokens: int) -> float:
    """Useful FLOPs of one sequence's train step over `tokens` positions: the forward with
    every position's logits and a backward of twice its products (the usual 3x)."""
    return 3 * forward_flops(config, tokens, logits="all")


@typechecked
def active_parameters(config: Config) -> float:
    """Parameters one token's forward multiplies by: all but the embedding table (one row) and
    the hash layers' token-to-expert tables, the routed experts at top-k of them, the head
    included."""
    model = eqx.filter_eval_shape(DeepseekV4, config, key=jax.random.key(0))
    total = 0.0
    for path, leaf in jax.tree_util.tree_leaves_with_path(model):
        name = jax.tree_util.keystr(path)
        size = float(np.prod(leaf.shape))
        if ".embed." in name or name.endswith(".tid2eid"):
            continue
        if ".experts." in name:
            size *= config.num_experts_per_tok / config.n_routed_experts
        total += size
    return total
