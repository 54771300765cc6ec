"""A float32 torch port of the DSpark drafter (V4-Flash-0731), written from the published
description (issue 43, the vLLM and SGLang drafters as described there), not from our code.

The trunk is transformers' `DeepseekV4ForCausalLM`; its context taps are read with forward hooks
on its decoder layers. The stages are transformers' `DeepseekV4DecoderLayer`s (sliding-only,
learned routing) whose hyper-connections, norms, projections and MoE are called as modules;
the drafter's own attention (context rows + the block, no causal mask inside the block, a sink
per head), the context projection, the rings, the head and the Markov and confidence heads are
written here. Greedy drafting, one sequence at a time, float32, exact numerics.
"""

import dataclasses

import numpy as np
import torch
import transformers.models.deepseek_v4.modeling_deepseek_v4 as hf
from hf_reference import hf_config, randomize

import equinox_dsv4 as ed
from convert.names import hf_to_canonical


def rope(x: torch.Tensor, positions: torch.Tensor, dim: int, theta: float, inverse=False):
    """Interleaved-pair rotation of the trailing `dim` channels of `x` `[seq, ..., width]` by
    `positions` `[seq]` (pair `i` is the complex number `x[2i] + i x[2i+1]`)."""
    inv = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    angles = (positions.double()[:, None] * inv[None]).float()
    angles = angles.reshape(angles.shape[0], *(1,) * (x.ndim - 2), dim // 2)
    cos, sin = torch.cos(angles), torch.sin(angles)
    if inverse:
        sin = -sin
    a, b = x[..., -dim:][..., 0::2], x[..., -dim:][..., 1::2]
    rotated = torch.stack([a * cos - b * sin, b * cos + a * sin], dim=-1).flatten(-2)
    return torch.cat([x[..., :-dim], rotated], dim=-1)


@dataclasses.dataclass
class Drafter:
    """The drafter's weights as torch modules and tensors."""

    config: ed.Config
    stages: list[hf.DeepseekV4DecoderLayer]
    hc_head: hf.DeepseekV4HyperHead
    main_proj: torch.Tensor  # [d, taps * d]
    main_norm: hf.DeepseekV4RMSNorm
    norm: hf.DeepseekV4RMSNorm
    markov_w1: torch.Tensor  # [vocab, rank]
    markov_w2: torch.Tensor  # [vocab, rank]
    confidence: torch.Tensor  # [1, d + rank]

    @classmethod
    def random(cls, config: ed.Config, seed: int) -> "Drafter":
        n = config.dspark_stages
        stage_config = hf_config(
            dataclasses.replace(
                config.trunk_only(),
                num_hidden_layers=n,
                layer_types=(ed.config.SLIDING,) * n,
                mlp_layer_types=(ed.config.MOE,) * n,
            )
        )
        torch.manual_seed(seed)
        stages = [randomize(hf.DeepseekV4DecoderLayer(stage_config, i), seed + i) for i in range(n)]
        g = torch.Generator().manual_seed(seed)
        d, r, v = config.hidden_size, config.dspark_markov_rank, config.vocab_size
        taps = len(config.dspark_target_layer_ids)

        def normal(*shape):
            return torch.randn(shape, generator=g) / shape[-1] ** 0.5

        def norm():
            module = hf.DeepseekV4RMSNorm(d, config.rms_norm_eps)
            module.weight.data = 1 + 0.2 * torch.randn(d, generator=g)
            return module

        hc_head = randomize(hf.DeepseekV4HyperHead(stage_config), seed + 100)
        return cls(
            config, stages, hc_head, normal(d, taps * d), norm(), norm(),
            normal(v, r), normal(v, r), normal(1, d + r),
        )  # fmt: skip

    def canonical(self) -> dict[str, np.ndarray]:
        """The drafter's tensors under the release's names (`mtp.<i>.*`)."""
        out = {}
        last = len(self.stages) - 1
        for i, stage in enumerate(self.stages):
            for key, tensor in stage.state_dict().items():
                for name, transform in hf_to_canonical(f"model.layers.{i}.{key}"):
                    out["mtp." + name[len("layers.") :]] = transform(tensor.detach().numpy())
        for part in ("fn", "base", "scale"):
            out[f"mtp.{last}.hc_head_{part}"] = getattr(self.hc_head, f"hc_{part}").detach().numpy()
        out["mtp.0.main_proj.weight"] = self.main_proj.numpy()
        out["mtp.0.main_norm.weight"] = self.main_norm.weight.detach().numpy()
        out[f"mtp.{last}.norm.weight"] = self.norm.weight.detach().numpy()
        out[f"mtp.{last}.markov_head.markov_w1.weight"] = self.markov_w1.numpy()
        out[f"mtp.{last}.markov_head.markov_w2.weight"] = self.markov_w2.numpy()
        out[f"mtp.{last}.confidence_head.proj.weight"] = self.confidence.numpy()
        return out

    @torch.no_grad()
    def draft(self, trunk, prompt: list[int], anchor: int):
        """Greedy drafts after `prompt` (its context rows) with `anchor` the token after it:
        `(corrected logits [block, vocab], drafts [block], confidences [block])`."""
        c = self.config
        taps = trunk_taps(trunk, prompt, c.dspark_target_layer_ids)  # [seq, taps, d]
        main_x = self.main_norm(taps.flatten(1) @ self.main_proj.T)  # [seq, d]
        seq, q, w = len(prompt), c.dspark_block_size, c.sliding_window
        ctx = torch.arange(max(0, seq - w), seq)  # the ring: the last `window` positions
        block_pos = torch.arange(seq, seq + q)
        ids = torch.tensor([anchor] + [c.dspark_noise_token_id] * (q - 1))
        x = trunk.model.embed_tokens(ids)[:, None, :].expand(q, c.hc_mult, -1)[None].contiguous()
        for stage in self.stages:
            attn = stage.self_attn

            def kv(h, pos, attn=attn):
                k = attn.kv_norm(attn.kv_proj(h))
                return rope(k, pos, c.qk_rope_head_dim, c.rope_theta)

            rows = kv(main_x[ctx], ctx)
            post, comb, collapsed = stage.attn_hc(x)
            h = stage.input_layernorm(collapsed)[0]  # [q, d]
            qs = attn.q_b_norm(
                attn.q_b_proj(attn.q_a_norm(attn.q_a_proj(h))).view(q, -1, c.head_dim)
            )
            qs = rope(qs, block_pos, c.qk_rope_head_dim, c.rope_theta)
            keys = torch.cat([rows, kv(h, block_pos)])  # [ctx + q, head_dim]
            logits = torch.einsum("qhk,tk->qht", qs, keys) * c.head_dim**-0.5
            sink = attn.sinks[None, :, None].expand(q, -1, 1)
            probs = torch.softmax(torch.cat([logits, sink], dim=-1), dim=-1)[..., :-1]
            o = torch.einsum("qht,tk->qhk", probs, keys)
            o = rope(o, block_pos, c.qk_rope_head_dim, c.rope_theta, inverse=True)
            o = attn.o_b_proj(attn.o_a_proj(o.reshape(q, c.o_groups, -1)).flatten(1))
            x = post.unsqueeze(-1) * o[None, :, None, :] + torch.matmul(comb.transpose(-1, -2), x)
            post, comb, collapsed = stage.ffn_hc(x)
            m = stage.mlp(stage.post_attention_layernorm(collapsed), input_ids=ids[None])
            x = post.unsqueeze(-1) * m.unsqueeze(-2) + torch.matmul(comb.transpose(-1, -2), x)
        hx = self.hc_head(x)[0]  # [q, d], before the norm
        base = trunk.lm_head(self.norm(hx))
        prev, logits, drafts, conf = anchor, [], [], []
        for i in range(q):
            e = self.markov_w1[prev]
            z = base[i] + self.markov_w2 @ e
            conf.append(torch.sigmoid(self.confidence @ torch.cat([hx[i], e]))[0])
            prev = int(torch.argmax(z))
            logits.append(z)
            drafts.append(prev)
        return torch.stack(logits).numpy(), np.array(drafts), torch.stack(conf).numpy()


@torch.no_grad()
def trunk_taps(trunk, prompt: list[int], layers) -> torch.Tensor:
    """transformers' residual streams after each of `layers`, averaged over the streams:
    `[seq, len(layers), d]`."""
    seen = {}
    hooks = [
        trunk.model.layers[i].register_forward_hook(
            lambda module, args, out, i=i: seen.__setitem__(i, out.mean(dim=2)[0])
        )
        for i in layers
    ]
    try:
        ids = torch.tensor([prompt])
        trunk(input_ids=ids, attention_mask=torch.ones_like(ids))
    finally:
        for hook in hooks:
            hook.remove()
    return torch.stack([seen[i] for i in layers], dim=1)
