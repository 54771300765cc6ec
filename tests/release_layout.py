"""Writing tiny checkpoints in the official DeepSeek-V4 release layout (test fixtures).

Flat names; FP8 e4m3 weights with one ue8m0 scale per 128x128 block for the dense projections;
routed experts as packed FP4 (two e2m1 per int8 byte, low nibble = even column) with one ue8m0
scale per 32 inputs; compressor / indexer projections, router, embedding, head and norms in
bf16; mHC parameters, `ape`, `attn_sink` and the router bias in fp32; `tid2eid` int64; several
shards and a `model.safetensors.index.json`. The quantisation and the reference dequantisation
here are written independently of `convert/_quant.py`.
"""

import json
import pathlib
import re

import equinox as eqx
import jax
import ml_dtypes
import numpy as np

import equinox_dsv4 as ed
from convert import hf_to_canonical
from convert.reader import write_safetensors
from equinox_dsv4.ckpt import canonical_pieces


FP4_LUT = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
FP8_NAMES = re.compile(
    r"(.*\.attn\.(wq_a|wq_b|wkv|wo_a|wo_b)|.*\.indexer\.wq_b|.*\.shared_experts\.w[123]"
    r"|mtp\.\d+\.(e_proj|h_proj|main_proj))\.weight"
)
FP4_NAMES = re.compile(r".*\.ffn\.experts\.\d+\.w[123]\.weight")
F32_NAMES = re.compile(r".*(hc_(attn|ffn|head)_(fn|base|scale)|\.ape|\.attn_sink|\.gate\.bias)")


def write_sharded(out: pathlib.Path, tensors: dict[str, np.ndarray], shards: int) -> None:
    names = sorted(tensors)
    per = -(-len(names) // shards)
    weight_map = {}
    for s in range(shards):
        file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        chunk = names[s * per : (s + 1) * per]
        write_safetensors(out / file, {n: tensors[n] for n in chunk})
        weight_map.update({n: file for n in chunk})
    index = {"metadata": {"total_size": sum(a.nbytes for a in tensors.values())}}
    (out / "model.safetensors.index.json").write_text(
        json.dumps({**index, "weight_map": weight_map})
    )


def quantize_fp8(w: np.ndarray, block: int = 128):
    rows, cols = w.shape
    sr, sc = -(-rows // block), -(-cols // block)
    exponent = np.zeros((sr, sc))
    for i in range(sr):
        for j in range(sc):
            amax = np.abs(w[i * block : (i + 1) * block, j * block : (j + 1) * block]).max()
            exponent[i, j] = np.ceil(np.log2(max(amax, 1e-30) / 448.0))
    full = np.repeat(np.repeat(exponent, block, 0), block, 1)[:rows, :cols]
    q = (w / np.exp2(full)).astype(ml_dtypes.float8_e4m3fn)
    return q, np.exp2(exponent).astype(ml_dtypes.float8_e8m0fnu)


def dequantize_fp8(q, scale, block: int = 128):
    rows, cols = q.shape
    s = np.repeat(np.repeat(scale.astype(np.float64), block, 0), block, 1)[:rows, :cols]
    return (q.astype(np.float64) * s).astype(np.float32)


def quantize_fp4(w: np.ndarray):
    rows, cols = w.shape
    groups = -(-cols // 32)
    exponent = np.zeros((rows, groups))
    for g in range(groups):
        amax = np.abs(w[:, g * 32 : (g + 1) * 32]).max(axis=1)
        exponent[:, g] = np.ceil(np.log2(np.maximum(amax, 1e-30) / 6.0))
    scaled = w / np.exp2(np.repeat(exponent, 32, 1)[:, :cols])
    nibble = np.abs(scaled[..., None] - np.array(FP4_LUT)).argmin(-1).astype(np.uint8)
    packed = (nibble[:, 0::2] | (nibble[:, 1::2] << 4)).astype(np.uint8).view(np.int8)
    return packed, np.exp2(exponent).astype(ml_dtypes.float8_e8m0fnu)


def dequantize_fp4(packed, scale):
    rows, half = packed.shape
    out = np.zeros((rows, 2 * half))
    for i in range(rows):
        for j in range(half):
            byte = int(packed[i, j]) & 0xFF
            out[i, 2 * j] = FP4_LUT[byte & 0xF]
            out[i, 2 * j + 1] = FP4_LUT[byte >> 4]
    s = np.repeat(scale.astype(np.float64), 32, 1)[:, : 2 * half]
    return (out * s).astype(np.float32)


def official_config(config: ed.Config, fp8_block: int = 128) -> dict:
    """The config in the release's own flavour (as in deepseek-ai/DeepSeek-V4-Flash)."""
    ratio = {ed.config.SLIDING: 0, ed.config.CSA: 4, ed.config.HCA: config.compress_rate_hca}
    hf = config.to_hf()
    out = {
        k: v
        for k, v in hf.items()
        if k
        not in (
            "layer_types",
            "mlp_layer_types",
            "compress_rates",
            "rope_parameters",
            "partial_rotary_factor",
            "dspark_stages",  # the release counts them in compress_ratios
        )
    }
    out.update(
        architectures=["DeepseekV4ForCausalLM"],
        torch_dtype="bfloat16",
        transformers_version="4.57.1",
        topk_method="noaux_tc",
        num_hash_layers=config.num_hash_layers,
        compress_ratios=[ratio[t] for t in config.layer_types]
        + [0] * (config.dspark_stages or config.num_nextn_predict_layers),
        quantization_config={
            "activation_scheme": "dynamic",
            "fmt": "e4m3",
            "quant_method": "fp8",
            "scale_fmt": "ue8m0",
            "weight_block_size": [fp8_block, fp8_block],
        },
        expert_dtype="fp4",
    )
    if config.rope_scaling is not None:
        y = config.rope_scaling
        out["rope_scaling"] = {
            "type": "yarn",
            "factor": y.factor,
            "original_max_position_embeddings": y.original_max_position_embeddings,
            "beta_fast": y.beta_fast,
            "beta_slow": y.beta_slow,
        }
    return out


def write_release_checkpoint(
    out: pathlib.Path,
    config: ed.Config,
    reference,
    *,
    shards: int = 3,
    seed: int = 0,
    fp8_block: int = 128,
) -> dict[str, np.ndarray]:
    """Write `reference`'s weights (a transformers model of `config`) plus a random MTP block
    (or DSpark drafter, as V4-Flash-0731 ships it, when `config` has one) in the release
    layout, FP8 in `fp8_block` x `fp8_block` blocks. Returns the canonical float32 values a
    loader must reproduce (after quantisation / rounding), keyed by official name."""
    rng = np.random.default_rng(seed)
    values: dict[str, np.ndarray] = {}
    for key, tensor in reference.state_dict().items():
        for name, transform in hf_to_canonical(key):
            values[name] = transform(tensor.numpy())
    for name in [n for n in values if ".ffn.experts.w" in n]:
        stack = values.pop(name)
        layer, w = name.rsplit(".", 1)
        for e in range(stack.shape[0]):
            values[f"{layer}.{e}.{w}.weight"] = stack[e]
    abstract = eqx.filter_eval_shape(ed.DeepseekV4, config, key=jax.random.key(0))
    for name, leaf in canonical_pieces(abstract):
        if name.startswith("mtp."):
            if name.endswith("norm.weight"):
                values[name] = (1 + 0.2 * rng.standard_normal(leaf.shape)).astype(np.float32)
            else:
                scale = 1 / np.sqrt(leaf.shape[-1]) if len(leaf.shape) >= 2 else 0.5
                values[name] = (scale * rng.standard_normal(leaf.shape)).astype(np.float32)
    for name in [n for n in values if n.startswith("mtp.") and ".ffn.experts.w" in n]:
        stack = values.pop(name)
        layer, w = name.rsplit(".", 1)
        for e in range(stack.shape[0]):
            values[f"{layer}.{e}.{w}.weight"] = stack[e]

    tensors: dict[str, np.ndarray] = {}
    expected: dict[str, np.ndarray] = {}
    for name, v in values.items():
        if name.endswith("tid2eid"):
            tensors[name] = v.astype(np.int64)
            expected[name] = v
        elif FP4_NAMES.fullmatch(name):
            q, s = quantize_fp4(v)
            tensors[name], tensors[name[: -len(".weight")] + ".scale"] = q, s
            expected[name] = dequantize_fp4(q, s)
        elif FP8_NAMES.fullmatch(name):
            q, s = quantize_fp8(v, fp8_block)
            tensors[name], tensors[name[: -len(".weight")] + ".scale"] = q, s
            expected[name] = dequantize_fp8(q, s, fp8_block)
        elif F32_NAMES.fullmatch(name):
            tensors[name] = expected[name] = v.astype(np.float32)
        else:
            tensors[name] = v.astype(ml_dtypes.bfloat16)
            expected[name] = tensors[name].astype(np.float32)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(official_config(config, fp8_block), indent=2))
    write_sharded(out, tensors, shards)
    return expected


def hf_state_from_canonical(expected: dict[str, np.ndarray], reference) -> dict:
    """A transformers state dict holding the canonical values (for the reference forward)."""
    import torch

    state = {}
    for key, tensor in reference.state_dict().items():
        targets = hf_to_canonical(key)
        parts = []
        for name, _ in targets:
            if name in expected:
                parts.append(expected[name])
            else:  # a stack: per-expert names
                layer, w = name.rsplit(".", 1)
                parts.append(
                    np.stack([expected[f"{layer}.{e}.{w}.weight"] for e in range(tensor.shape[0])])
                )
        value = parts[0] if len(parts) == 1 else np.concatenate(parts, axis=1)
        state[key] = torch.from_numpy(np.asarray(value).astype(tensor.numpy().dtype))
    return state
