"""Shared pieces of the benchmarks: the "small" config, the transformers twin with the same
weights, timing, and result files."""

import datetime
import json
import os
import pathlib
import platform
import statistics
import sys
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np


ROOT = pathlib.Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
sys.path.insert(0, str(ROOT))

# The tables' format is the performance page's (a stdlib-only script).
from performance import markdown as markdown  # noqa: E402

import equinox_dsv4 as ed  # noqa: E402
from convert import fill, hf_to_canonical  # noqa: E402


S, C, H = ed.config.SLIDING, ed.config.CSA, ed.config.HCA


def small_config(layers: int = 8, **overrides) -> ed.Config:
    """The documented "small" config: hidden 512, 8 heads x head_dim 128 with 32 rope dims, the
    V4-Flash layer pattern (two sliding-only layers, then CSA / HCA alternating, the first three
    hash-routed), 16 experts top-4, window 128, ratios 4 / 128, the real vocabulary."""
    pattern = ((S, S) + tuple(C if i % 2 == 0 else H for i in range(max(0, layers - 2))))[:layers]
    base = dict(
        vocab_size=129280,
        hidden_size=512,
        num_hidden_layers=layers,
        num_attention_heads=8,
        head_dim=128,
        qk_rope_head_dim=32,
        q_lora_rank=256,
        o_groups=4,
        o_lora_rank=256,
        sliding_window=128,
        layer_types=pattern,
        mlp_layer_types=(ed.config.HASH_MOE,) * min(3, layers)
        + (ed.config.MOE,) * max(0, layers - 3),
        compress_rate_csa=4,
        compress_rate_hca=128,
        index_n_heads=8,
        index_head_dim=64,
        index_topk=128,
        hc_mult=4,
        n_routed_experts=16,
        num_experts_per_tok=4,
        moe_intermediate_size=512,
        routed_scaling_factor=1.5,
        rope_scaling=ed.config.YarnScaling(factor=16.0, original_max_position_embeddings=65536),
        num_nextn_predict_layers=0,
    )
    base.update(overrides)
    return ed.Config(**base)


def weight_kinds(config: ed.Config, dtype, quantized: bool = False) -> dict[str, float]:
    """The model's weight bytes by kind, as stored in `dtype` (or, `quantized`, as the release's
    FP8/FP4 values with their scales): `tables` (the embedding and the hash routers' token
    tables, read one row per token), `row` (one row of each), `experts` (the routed experts,
    all layers) and `other` (everything else)."""
    model = eqx.filter_eval_shape(ed.DeepseekV4, config, key=jax.random.key(0), dtype=dtype)
    if quantized:
        model = ed.quant.abstract_quantized(model)
    kinds = {"tables": 0.0, "row": 0.0, "experts": 0.0, "other": 0.0}
    for path, leaf in jax.tree_util.tree_leaves_with_path(model):
        name = jax.tree_util.keystr(path)
        nbytes = float(np.prod(leaf.shape)) * leaf.dtype.itemsize
        if ".embed." in name or name.endswith(".tid2eid"):
            kinds["tables"] += nbytes
            kinds["row"] += nbytes / leaf.shape[-2]
        elif ".experts." in name:
            kinds["experts"] += nbytes
        else:
            kinds["other"] += nbytes
    return kinds


def reference_and_ours(config: ed.Config, dtype, seed: int = 0):
    """A random transformers model and our model with the same weights, both in `dtype`."""
    reference = _random_reference(config, seed)
    tensors = []
    for key, tensor in reference.state_dict().items():
        for name, transform in hf_to_canonical(key):
            tensors.append((name, transform(tensor.numpy())))
    skeleton = eqx.filter_eval_shape(ed.DeepseekV4, config, key=jax.random.key(0), dtype=dtype)
    return _in_dtype(reference, dtype), fill(skeleton, tensors)


def reference_model(config: ed.Config, dtype, seed: int = 0):
    """The transformers model of `reference_and_ours`, without building ours."""
    return _in_dtype(_random_reference(config, seed), dtype)


def _random_reference(config: ed.Config, seed: int):
    import torch
    import transformers

    torch.manual_seed(seed)
    reference = transformers.DeepseekV4ForCausalLM(transformers.DeepseekV4Config(**config.to_hf()))
    reference = reference.eval()
    # transformers initialises the hash routers' token->expert tables to zeros, which sends every
    # token to expert 0 four times over; a checkpoint picks distinct experts, so do we.
    with torch.no_grad():
        for name, table in reference.state_dict().items():
            if name.endswith("tid2eid"):
                rows = [torch.randperm(config.n_routed_experts)[: table.shape[1]] for _ in table]
                table.copy_(torch.stack(rows))
    return reference


def _in_dtype(reference, dtype):
    import torch

    if jnp.dtype(dtype) == jnp.bfloat16:
        # transformers keeps norms, mHC, sinks, slot and router biases in float32 as we do.
        reference = reference.to(torch.bfloat16)
        for name, module in reference.named_modules():
            if name.split(".")[-1] in _FP32_MODULES:
                module.float()
        for module in reference.modules():
            for attr in ("sinks", "position_bias", "e_score_correction_bias"):
                if hasattr(module, attr) and isinstance(getattr(module, attr), torch.Tensor):
                    getattr(module, attr).data = getattr(module, attr).data.float()
    return reference


_FP32_MODULES = {
    "attn_hc",
    "ffn_hc",
    "hc_head",
    "q_a_norm",
    "kv_norm",
    "input_layernorm",
    "post_attention_layernorm",
    "norm",
}


def timed(fn, repeats: int, warmup: int = 1) -> float:
    """Median seconds of `fn()` (which must block until done) over `repeats` runs."""
    return timed_with_faults(fn, repeats, warmup)[0]


def timed_with_faults(fn, repeats: int, warmup: int = 1) -> tuple[float, float]:
    """As `timed`, and the process's minor page faults per timed run."""
    for _ in range(warmup):
        fn()
    runs = [_run(fn) for _ in range(repeats)]
    return statistics.median(r[0] for r in runs), sum(r[1] for r in runs) / repeats


def timed_pair(ours, reference, repeats: int, warmup: int = 1) -> dict:
    """`ours()` and `reference()` (each blocking until done) run alternately, `repeats` times
    each after `warmup` runs of each, so that both see the same phases of a shared machine (its
    memory bandwidth was seen to swing between 20 and 36 GB/s within 90 seconds here).

    **Returns:** for each (`ours`, `reference`) the median seconds and the minor page faults per
    run, and `ratio`, the median over the pairs of reference seconds / ours seconds.
    """
    for _ in range(warmup):
        ours()
        reference()
    pairs = [(_run(ours), _run(reference)) for _ in range(repeats)]
    result = {"ratio": statistics.median(r[0] / o[0] for o, r in pairs)}
    for i, name in enumerate(("ours", "reference")):
        result[f"{name}_seconds"] = statistics.median(p[i][0] for p in pairs)
        result[f"{name}_faults"] = sum(p[i][1] for p in pairs) / repeats
    return result


def _run(fn) -> tuple[float, int]:
    # Seconds and the process's minor page faults of one call of `fn`.
    import resource

    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    t0 = time.perf_counter()
    fn()
    seconds = time.perf_counter() - t0
    return seconds, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults


def machine() -> dict:
    import torch

    return {
        "cpu": platform.processor() or platform.machine(),
        # Ratios moved with the machine: f32 matmul 177 GFLOP/s on one, 470 with AVX-512 on
        # another (benchmarks/archive/NOTES.md, Round 9).
        **_cpu_info(),
        "cores": os.cpu_count(),
        "jax": jax.__version__,
        "jax_devices": [str(d) for d in jax.devices()],
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
    }


def _cpu_info() -> dict:
    """Model name, vector extensions and caches from /proc/cpuinfo and sysfs (Linux only)."""
    info = {}
    try:
        text = pathlib.Path("/proc/cpuinfo").read_text()
    except OSError:
        return info
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name" and "cpu_model" not in info:
            info["cpu_model"] = value.strip()
        elif key.strip() == "flags" and "vector_flags" not in info:
            flags = value.split()
            info["vector_flags"] = sorted(f for f in flags if f.startswith(("avx", "fma", "amx")))
    caches = pathlib.Path("/sys/devices/system/cpu/cpu0/cache")
    for index in sorted(caches.glob("index*")):
        try:
            level = (index / "level").read_text().strip()
            kind = (index / "type").read_text().strip()
            size = (index / "size").read_text().strip()
        except OSError:
            continue
        if kind != "Instruction":
            info[f"l{level}_cache"] = size
    return info


def today() -> str:
    """Today's date, UTC, ISO: what a results file or row records."""
    return datetime.datetime.now(datetime.UTC).date().isoformat()


def recorded(name: str) -> dict:
    """`results/NAME.json` as `write` left it, each row with the date it was recorded (its
    own `recorded`, else the file's date: the file's is that of its last run), or `{}` where
    there is none: a run of some rows keeps the others from it."""
    path = RESULTS / f"{name}.json"
    if not path.exists():
        return {}
    old = json.loads(path.read_text())
    return old | {"rows": [{"recorded": old["date"], **r} for r in old["rows"]]}


def write(name: str, rows: list[dict], table: str, extra: dict | None = None) -> None:
    """`results/NAME.json` (the date it was recorded, UTC; the machine; `rows`; `extra`) and
    `results/NAME.md` (`table`, printed too). docs/performance.md is generated from the JSON:
    `python benchmarks/performance.py`."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    payload = {"date": today(), "machine": machine(), "rows": rows, **(extra or {})}
    (RESULTS / f"{name}.json").write_text(json.dumps(payload, indent=2, default=str) + "\n")
    (RESULTS / f"{name}.md").write_text(table)
    print(table)


def set_threads(n: int | None = None) -> int:
    """torch uses as many threads as JAX's CPU client has cores to use."""
    import torch

    n = n or os.cpu_count() or 1
    torch.set_num_threads(n)
    return n


def add_keep_freed_memory(parser) -> None:
    """The `--keep-freed-memory` option; `keep_freed_memory(args)` applies it."""
    parser.add_argument(
        "--keep-freed-memory",
        action="store_true",
        help="set glibc's malloc to keep freed memory for reuse (mmap and trim thresholds at "
        "2 GB) before either framework runs, so neither pays page faults for its working set "
        "on every call; results go to <name>-keep-freed-memory.{json,md}, without plots",
    )


def keep_freed_memory(args) -> str:
    """With `--keep-freed-memory`, keep freed memory in this process's heap instead of
    returning it to the OS; returns the suffix for result names ("" without the option).

    Both frameworks allocate each call's working memory with malloc. glibc serves requests over
    32 MiB with fresh mappings and trims the heap's free top, so a call touching hundreds of MB
    of temporaries takes a page fault for every 4 KiB page of them, every call. Raising both
    thresholds makes freed blocks reusable. Process-wide, so it applies to JAX and torch
    alike."""
    if not args.keep_freed_memory:
        return ""
    import ctypes

    libc = ctypes.CDLL("libc.so.6")
    m_trim_threshold, m_mmap_threshold = -1, -3
    for option in (m_mmap_threshold, m_trim_threshold):
        if libc.mallopt(option, ctypes.c_int(2_000_000_000)) != 1:
            raise RuntimeError(f"mallopt({option}) was refused; is this glibc?")
    return "-keep-freed-memory"


@jax.jit
def fast_matmul(a, b):
    """`a @ b` in XLA:CPU's fastest form, the one `equinox_dsv4`'s layers use: for bf16
    operands a float32 result, cast after (a bf16 result converts both operands to float32
    first; archive/NOTES.md, item 18)."""
    return jnp.matmul(a, b, preferred_element_type=jnp.float32).astype(a.dtype)


def block(x):
    return jax.block_until_ready(x)


def random_ids(batch: int, length: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(2, 129280, (batch, length)).astype(np.int32)
