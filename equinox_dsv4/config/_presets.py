"""The released models' config.json values (official flavour), read by `Config.v4_flash`,
`Config.v4_pro` and `Config.v4_flash_0731`."""

from typing import Any


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


def _released(**sizes: Any) -> dict[str, Any]:
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


V4_FLASH = _released(**_FLASH)
V4_PRO = _released(**_PRO)
# The current Flash instruct release: the same trunk, its `mtp.<i>` blocks a three-stage DSpark
# drafter reading the last three layers (compress_ratios: 43 layers + 3 stages).
V4_FLASH_0731 = _released(
    **{**_FLASH, "compress_ratios": [0, 0] + [4, 128] * 20 + [4, 0, 0, 0]},
    dspark_block_size=5,
    dspark_markov_rank=256,
    dspark_target_layer_ids=[40, 41, 42],
    dspark_noise_token_id=128799,
)
