"""Converter throughput and peak memory on a synthetic release-layout checkpoint.

Writes a multi-shard checkpoint in the official DeepSeek-V4 layout (FP8 e4m3 + ue8m0 block
scales for dense projections, packed FP4 routed experts with per-32 scales, bf16 / fp32 / int64
elsewhere) of at least `--size-gb`, then runs `python -m convert` on it in a subprocess and
reports throughput (checkpoint MB/s) and the converter's peak RSS against
`process baseline + 1.5 x largest shard` (the baseline is the same interpreter after importing
the converter and initialising JAX).

    python benchmarks/convert.py [--size-gb 2] [--shard-mb 400] [--workdir DIR]

Prints a table and writes benchmarks/results/convert.{json,md}.
"""

import argparse
import json
import math
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import time

import ml_dtypes
import numpy as np


ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from convert.reader import write_safetensors  # noqa: E402


FP8 = re.compile(
    r".*\.attn\.(wq_a|wq_b|wkv|wo_a|wo_b)\.weight|.*\.indexer\.wq_b\.weight"
    r"|.*\.shared_experts\.w[123]\.weight"
)
FP4 = re.compile(r".*\.experts\.\d+\.w[123]\.weight")
F32 = re.compile(r".*(hc_(attn|ffn|head)_(fn|base|scale)|\.ape|\.attn_sink|\.gate\.bias)")


def synthetic_config(layers: int) -> dict:
    ratios = [0, 0] + [4, 128] * ((layers - 2) // 2) + [4] * ((layers - 2) % 2)
    return {
        "vocab_size": 129280,
        "hidden_size": 1024,
        "num_hidden_layers": layers,
        "num_attention_heads": 16,
        "num_key_value_heads": 1,
        "head_dim": 512,
        "qk_rope_head_dim": 64,
        "q_lora_rank": 512,
        "o_groups": 4,
        "o_lora_rank": 512,
        "sliding_window": 128,
        "num_hash_layers": 3,
        "index_n_heads": 16,
        "index_head_dim": 128,
        "index_topk": 64,
        "hc_mult": 4,
        "n_routed_experts": 64,
        "num_experts_per_tok": 6,
        "n_shared_experts": 1,
        "moe_intermediate_size": 512,
        "scoring_func": "sqrtsoftplus",
        "routed_scaling_factor": 1.5,
        "rope_theta": 10000,
        "compress_rope_theta": 160000,
        "rope_scaling": {
            "type": "yarn",
            "factor": 16,
            "original_max_position_embeddings": 65536,
            "beta_fast": 32,
            "beta_slow": 1,
        },
        "num_nextn_predict_layers": 0,
        "compress_ratios": ratios + [0] * 0,
        "quantization_config": {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "scale_fmt": "ue8m0",
            "activation_scheme": "dynamic",
            "weight_block_size": [128, 128],
        },
        "expert_dtype": "fp4",
    }


def pieces(config: dict):
    """(official name, logical shape) of every weight, experts one by one."""
    import equinox as eqx
    import jax

    import equinox_dsv4 as ed
    from equinox_dsv4.ckpt import canonical_pieces

    model = eqx.filter_eval_shape(ed.DeepseekV4, ed.Config.from_hf(config), key=jax.random.key(0))
    for name, leaf in canonical_pieces(model):
        if ".ffn.experts.w" in name:
            layer, w = name.rsplit(".", 1)
            for e in range(leaf.shape[0]):
                yield f"{layer}.{e}.{w}.weight", leaf.shape[1:]
        else:
            yield name, leaf.shape


def tensors_for(name: str, shape, rng) -> dict[str, np.ndarray]:
    stem = name[: -len(".weight")]
    if FP4.fullmatch(name):
        packed = rng.integers(0, 256, (shape[0], shape[1] // 2), np.uint8).view(np.int8)
        scale = rng.integers(118, 124, (shape[0], math.ceil(shape[1] / 32)), np.uint8)
        return {name: packed, stem + ".scale": scale.view(ml_dtypes.float8_e8m0fnu)}
    if FP8.fullmatch(name):
        # Clear the mantissa's low bit: e4m3fn's only NaN is S.1111.111.
        q = (rng.integers(0, 256, shape, np.uint8) & 0xBE).view(ml_dtypes.float8_e4m3fn)
        grid = (math.ceil(shape[0] / 128), math.ceil(shape[1] / 128))
        scale = rng.integers(118, 124, grid, np.uint8).view(ml_dtypes.float8_e8m0fnu)
        return {name: q, stem + ".scale": scale}
    if name.endswith("tid2eid"):
        return {name: rng.integers(0, 64, shape, np.int64)}
    values = rng.standard_normal(shape, np.float32) * 0.02
    if F32.fullmatch(name):
        return {name: values}
    return {name: values.astype(ml_dtypes.bfloat16)}


def write_checkpoint(
    path: pathlib.Path, config: dict, shard_bytes: int, seed: int = 0
) -> list[int]:
    rng = np.random.default_rng(seed)
    shard, size, sizes, weight_map = {}, 0, [], {}

    def flush():
        nonlocal shard, size
        file = f"model-{len(sizes) + 1:05d}.safetensors"
        write_safetensors(path / file, shard)
        weight_map.update({n: file for n in shard})
        sizes.append(size)
        shard, size = {}, 0

    for name, shape in pieces(config):
        for n, array in tensors_for(name, shape, rng).items():
            if size and size + array.nbytes > shard_bytes:
                flush()
            shard[n] = array
            size += array.nbytes
    flush()
    (path / "config.json").write_text(json.dumps(config, indent=2))
    index = {"metadata": {"total_size": sum(sizes)}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    return sizes


def baseline_rss() -> int:
    code = "import jax, convert; jax.devices(); print(convert.load.peak_rss_bytes())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    return int(out.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-gb", type=float, default=2.0, help="minimum checkpoint size")
    parser.add_argument("--shard-mb", type=float, default=400.0, help="shard size")
    parser.add_argument("--workdir", help="where to write (default: a temporary directory)")
    args = parser.parse_args()

    work = pathlib.Path(args.workdir or tempfile.mkdtemp(prefix="dsv4-convert-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    src, out = work / "hf", work / "out"
    shutil.rmtree(src, ignore_errors=True)
    shutil.rmtree(out, ignore_errors=True)
    src.mkdir()
    # ~70 MB per layer plus 530 MB of embedding and head at this width.
    layers = max(4, math.ceil((args.size_gb * 1e9 - 530e6) / 70e6))
    t0 = time.perf_counter()
    sizes = write_checkpoint(src, synthetic_config(layers), int(args.shard_mb * 2**20))
    print(
        f"wrote {sum(sizes) / 1e9:.2f} GB in {len(sizes)} shards ({layers} layers) "
        f"in {time.perf_counter() - t0:.0f} s",
        file=sys.stderr,
    )

    base = baseline_rss()
    t0 = time.perf_counter()
    result = subprocess.run(
        [sys.executable, "-m", "convert", str(src), str(out), "--quiet"],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    seconds = time.perf_counter() - t0
    if result.returncode != 0:
        print(result.stderr, file=sys.stderr)
        return 1
    peak = int(float(re.search(r"peak RSS (\d+) MiB", result.stderr)[1]) * 2**20)
    total, largest = sum(sizes), max(sizes)
    bound = base + 1.5 * largest
    out_bytes = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    row = {
        "checkpoint_bytes": total,
        "shards": len(sizes),
        "largest_shard_bytes": largest,
        "output_bytes": out_bytes,
        "seconds": seconds,
        "throughput_mb_s": total / 1e6 / seconds,
        "baseline_rss_bytes": base,
        "peak_rss_bytes": peak,
        "bound_bytes": bound,
        "peak_over_baseline_in_shards": (peak - base) / largest,
        "within_bound": peak <= bound,
    }
    mib = 2**20
    cells = [
        f"{total / 1e9:.2f} GB",
        f"{len(sizes)} ({largest / mib:.0f} MiB)",
        f"{out_bytes / 1e9:.2f} GB",
        f"{seconds:.1f} s",
        f"{row['throughput_mb_s']:.0f} MB/s",
        f"{base / mib:.0f} MiB",
        f"{peak / mib:.0f} MiB",
        f"{bound / mib:.0f} MiB",
        f"{row['peak_over_baseline_in_shards']:.2f} shards",
    ]
    header = [
        "checkpoint",
        "shards (largest)",
        "output",
        "time",
        "throughput",
        "baseline RSS",
        "peak RSS",
        "bound (baseline + 1.5 x shard)",
        "peak - baseline",
    ]
    table = (
        "\n".join(
            [
                "| " + " | ".join(header) + " |",
                "|---" * len(header) + "|",
                "| " + " | ".join(cells) + " |",
            ]
        )
        + "\n"
    )
    print(table)
    results = ROOT / "benchmarks" / "results"
    results.mkdir(parents=True, exist_ok=True)
    (results / "convert.json").write_text(json.dumps(row, indent=2) + "\n")
    (results / "convert.md").write_text(table)
    if not args.workdir:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if row["within_bound"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
