"""The release's numerics in torch, for the reference: a port of the official inference code's
quantisation functions (deepseek-ai DeepSeek-V4 `inference/kernel.py`: `act_quant` with ue8m0
scales, `fp4_act_quant`, and `rotate_activation`'s Hadamard transform), and `patch`, which puts
them into a transformers `DeepseekV4ForCausalLM` at the points where the official
`inference/model.py` applies them. Written from the official code's description, in torch,
independently of `equinox_dsv4.quant`'s round trips.
"""

import contextlib
import math

import torch
import torch.nn.functional as F
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf


FP8_MAX = 448.0
FP4_MAX = 6.0
FP4_GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def _pow2_ceil(r: torch.Tensor) -> torch.Tensor:
    # The kernels' fast_log2_ceil + fast_pow2: exponent bits, plus one for any mantissa bit.
    bits = r.float().view(torch.int32)
    exponent = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    return (exponent << 23).view(torch.float32)


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    pad = -x.shape[-1] % block
    z = F.pad(x.float(), (0, pad))
    return z.unflatten(-1, (-1, block))


def act_quant(x: torch.Tensor, block: int) -> torch.Tensor:
    """`act_quant(x, block, "ue8m0", inplace=True)`'s result: FP8 e4m3 quantise-dequantise."""
    z = _blocks(x, block)
    amax = z.abs().amax(-1, keepdim=True).clamp_min(1e-4)
    s = _pow2_ceil(amax * torch.tensor(1.0 / FP8_MAX, dtype=torch.float32))
    q = (z / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float()
    return (q * s).flatten(-2)[..., : x.shape[-1]].to(x.dtype)


def _to_e2m1(q: torch.Tensor) -> torch.Tensor:
    # Round to the nearest e2m1 value; ties go to the even code (0, 1, 2, 4 ... of the grid).
    a = q.abs().unsqueeze(-1)
    distance = (a - FP4_GRID).abs()
    best = distance.min(-1, keepdim=True).values
    candidates = distance == best
    # Among equally near grid points, the one with an even index (its mantissa bit clear).
    even = candidates & (torch.arange(8) % 2 == 0)
    index = torch.where(even.any(-1), even.int().argmax(-1), candidates.int().argmax(-1))
    return FP4_GRID[index].copysign(q)


def fp4_act_quant(x: torch.Tensor, block: int) -> torch.Tensor:
    """`fp4_act_quant(x, block, inplace=True)`'s result: FP4 e2m1 quantise-dequantise with
    ue8m0 scales."""
    z = _blocks(x, block)
    amax = z.abs().amax(-1, keepdim=True).clamp_min(FP4_MAX * 2.0**-126)
    s = _pow2_ceil(amax * torch.tensor(1.0 / FP4_MAX, dtype=torch.float32))
    q = _to_e2m1((z / s).clamp(-FP4_MAX, FP4_MAX))
    return (q * s).flatten(-2)[..., : x.shape[-1]].to(x.dtype)


def rotate_activation(x: torch.Tensor) -> torch.Tensor:
    """`x @ H / sqrt(n)` (Sylvester Hadamard), as butterflies in float32, cast back."""
    n = x.shape[-1]
    y = x.float()
    h = 1
    while h < n:
        y = y.unflatten(-1, (n // (2 * h), 2, h))
        a, b = y[..., 0, :], y[..., 1, :]
        y = torch.stack([a + b, a - b], dim=-2).flatten(-3)
        h *= 2
    return (y * torch.tensor(1 / math.sqrt(n), dtype=torch.float32)).to(x.dtype)


def bf16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).float()


def _quantize_input(module, args):
    return (act_quant(args[0], 128),)


def _kv_hook(rope_dim: int):
    def hook(module, args, out):
        nope = act_quant(out[..., :-rope_dim], 64)
        return torch.cat([nope, out[..., -rope_dim:]], dim=-1)

    return hook


def _experts_forward(self, hidden_states, top_k_index, top_k_weights):
    # As the official Expert: the routing weight multiplies the hidden activation before w2,
    # and both inputs of the FP4 expert GEMMs are FP8-quantised.
    final = torch.zeros_like(hidden_states)
    x = act_quant(hidden_states, 128)
    for e in range(self.num_experts):
        token, pos = torch.where(top_k_index == e)
        if token.numel() == 0:
            continue
        a = self._apply_gate(F.linear(x[token], self.gate_up_proj[e]))
        a = act_quant(a * top_k_weights[token, pos, None], 128)
        final.index_add_(0, token, F.linear(a, self.down_proj[e]).to(final.dtype))
    return final


# Every index score matrix the patched indexer computed (the tests check them for ties).
SCORES: list[torch.Tensor] = []


def top_k_ties(scores: torch.Tensor, k: int) -> int:
    """How many queries have a tie across the k-th place (an ambiguous selection)."""
    if scores.shape[-1] <= k:
        return 0
    top = scores.topk(k + 1, dim=-1).values
    finite = torch.isfinite(top[..., k])
    return int(((top[..., k - 1] == top[..., k]) & finite).sum())


def _indexer_forward(self, hidden_states, q_residual, position_ids, cache, layer_idx):
    # transformers' indexer without a cache, with the official indexer's Hadamard + FP4 on
    # its keys and queries, FP8 input to its q projection and bfloat16 scores.
    assert cache is None, "the release-numerics reference runs without a cache"
    batch, seq_len, _ = hidden_states.shape
    ratio, d = self.compress_rate, self.head_dim
    usable = (seq_len // ratio) * ratio
    kv, gate = self.kv_proj(hidden_states)[:, :usable], self.gate_proj(hidden_states)[:, :usable]
    n = usable // ratio
    kv = kv.view(batch, n, ratio, -1)
    gate = gate.view(batch, n, ratio, -1) + self.position_bias
    slots_kv = kv.new_zeros((batch, n, 2 * ratio, d))
    slots_gate = gate.new_full((batch, n, 2 * ratio, d), float("-inf"))
    slots_kv[:, :, ratio:], slots_gate[:, :, ratio:] = kv[..., d:], gate[..., d:]
    if n > 1:
        slots_kv[:, 1:, :ratio], slots_gate[:, 1:, :ratio] = kv[:, :-1, :, :d], gate[:, :-1, :, :d]
    keys = self.kv_norm((slots_kv * slots_gate.softmax(dim=2)).sum(dim=2))
    positions = (torch.arange(n) * ratio).unsqueeze(0).expand(batch, -1)
    cos, sin = self.rotary_emb(keys, position_ids=positions, layer_type=self.rope_layer_type)
    keys = hf.apply_rotary_pos_emb(keys.unsqueeze(1), cos, sin).squeeze(1)
    keys = fp4_act_quant(rotate_activation(keys), 32)

    cos_q, sin_q = self.rotary_emb(hidden_states, position_ids=position_ids, layer_type="compress")
    q = self.q_b_proj(act_quant(q_residual, 128)).view(batch, seq_len, -1, d).transpose(1, 2)
    q = hf.apply_rotary_pos_emb(q, cos_q, sin_q).transpose(1, 2)
    q = fp4_act_quant(rotate_activation(q), 32)

    scale = self.scorer.softmax_scale * self.scorer.weights_scaling
    weights = bf16(bf16(self.scorer.weights_proj(hidden_states)) * scale)  # [B, S, H]
    logits = bf16(torch.einsum("bshd,btd->bsht", q, keys))
    scores = bf16((bf16(logits.relu() * weights.unsqueeze(-1))).sum(dim=2))  # [B, S, T]
    top_k = min(self.index_topk, n)
    if n == 0:
        return scores.topk(top_k, dim=-1).indices
    threshold = (position_ids + 1) // ratio
    future = torch.arange(n).view(1, 1, -1) >= threshold.unsqueeze(-1)
    scores = scores.masked_fill(future, float("-inf"))
    SCORES.append(scores)
    picks = scores.topk(top_k, dim=-1).indices
    return torch.where(picks >= threshold.unsqueeze(-1), torch.full_like(picks, -1), picks)


@contextlib.contextmanager
def patch(model: "hf.DeepseekV4ForCausalLM"):
    """`model` computing with the release's numerics while the context lasts: FP8 activations
    into every linear the release stores in FP8/FP4 (not `wo_a`, which the official code runs
    in bf16), FP8 round trips of the KV's non-RoPE dims (window and compressed; before RoPE
    here, which touches only the RoPE dims), the indexer's own forward as above."""
    rope_dim = int(model.config.head_dim * model.config.partial_rotary_factor)
    handles = []
    for layer in model.model.layers:
        attn = layer.self_attn
        for linear in (attn.q_a_proj, attn.q_b_proj, attn.kv_proj, attn.o_b_proj):
            handles.append(linear.register_forward_pre_hook(_quantize_input))
        shared = layer.mlp.shared_experts
        for linear in (shared.gate_proj, shared.up_proj, shared.down_proj):
            handles.append(linear.register_forward_pre_hook(_quantize_input))
        handles.append(attn.kv_norm.register_forward_hook(_kv_hook(rope_dim)))
        compressor = getattr(attn, "compressor", None)
        if compressor is not None:
            handles.append(compressor.kv_norm.register_forward_hook(_kv_hook(rope_dim)))
    saved = hf.DeepseekV4Experts.forward, hf.DeepseekV4Indexer.forward
    hf.DeepseekV4Experts.forward = _experts_forward
    hf.DeepseekV4Indexer.forward = _indexer_forward
    try:
        yield model
    finally:
        hf.DeepseekV4Experts.forward, hf.DeepseekV4Indexer.forward = saved
        for handle in handles:
            handle.remove()
