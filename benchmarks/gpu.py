"""V4-Flash at full width on one GPU against that GPU's floors, measured in one unattended run.

Run it on a machine with an NVIDIA GPU and the `cuda` extra installed
(`pip install -e ".[cuda]"`):

    python benchmarks/gpu.py [--time-limit 480] [--json benchmarks/results/gpu.json]

The model is V4-Flash's config cut to as many layers as fit the GPU beside the 4k caches
of the largest batch (`--layers` to choose), with random weights in two forms: the release's
(FP8 dense projections, FP4 experts, kept quantised: `--forms quantized`) and bfloat16
(`--forms bf16`). For each form: one decode step at batch 1 / 8 / 64 with a cache of 4096
tokens holding 4000 (`--batches`, `--cache`), and a 4096-token prefill at batch 1
(`--prefill`); each the median of `--repeats` runs after a compile and a warm-up run.

Each figure stands beside floors measured on the same GPU in the same run: the bandwidth of a
device-to-device copy of 1 GiB (read + write bytes per second) and the rate of a bf16 matmul
of 8192 x 8192 x 8192. A decode step's floor is its weights' and caches' bytes at that
bandwidth; a prefill's, the larger of its weights' bytes at that bandwidth and its useful
FLOPs (`ed.train.forward_flops`) at that matmul rate.

One JSON document is printed (and written with `--json`). The run stops itself at
`--time-limit` seconds: cases not reached are listed under `skipped`. On a machine without a
GPU it runs on the CPU (tests/test_gpu.py runs it with `--config tiny` so it cannot rot);
figures from a CPU say nothing about a GPU.
"""

import argparse
import datetime
import functools
import json
import signal
import statistics
import sys
import time

import equinox as eqx
import jax
import jax.numpy as jnp

import equinox_dsv4 as ed


GIB = 2**30


def parse_args(argv):
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", choices=("v4-flash", "tiny"), default="v4-flash")
    parser.add_argument("--layers", type=int, help="decoder layers (default: as many as fit)")
    parser.add_argument("--forms", default="quantized,bf16", help="comma-separated")
    parser.add_argument("--batches", default="1,8,64", help="decode batch sizes")
    parser.add_argument("--cache", type=int, default=4096, help="cache length of the decodes")
    parser.add_argument("--prefill", type=int, default=4096, help="prefill tokens (0: none)")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--time-limit", type=float, default=480.0, help="seconds")
    parser.add_argument("--copy-bytes", type=int, default=GIB, help="the copy floor's size")
    parser.add_argument("--matmul", type=int, default=8192, help="the matmul floor's size")
    parser.add_argument("--json", help="also write the JSON here")
    args = parser.parse_args(argv)
    args.forms = [f for f in args.forms.split(",") if f]
    if not args.forms or any(f not in ("quantized", "bf16") for f in args.forms):
        parser.error(f"bad --forms: choose from quantized, bf16, got {args.forms}")
    try:
        args.batches = [int(b) for b in args.batches.split(",") if b]
    except ValueError:
        parser.error(f"bad --batches {args.batches!r}: integers, comma-separated")
    if not args.batches or min(args.batches) < 1:
        parser.error("--batches: at least one batch size, each >= 1")
    if args.cache < 2:
        parser.error("--cache must be >= 2")
    return args


def median_seconds(fn, repeats: int) -> float:
    """Median seconds of `fn()` (blocking until done) after one warm-up run."""
    jax.block_until_ready(fn())
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        runs.append(time.perf_counter() - t0)
    return statistics.median(runs)


def floors(args) -> dict:
    """The device's copy bandwidth (bytes read + written per second) and bf16 matmul rate."""
    x = jnp.ones((args.copy_bytes // 2,), jnp.bfloat16)
    copy = jax.jit(lambda a: a + jnp.bfloat16(1))  # one read and one write of every byte
    seconds = median_seconds(lambda: copy(x), args.repeats)
    n = args.matmul
    a = jnp.ones((n, n), jnp.bfloat16)
    matmul = jax.jit(lambda a, b: a @ b)
    matmul_seconds = median_seconds(lambda: matmul(a, a), args.repeats)
    return {
        "copy_bytes_per_s": 2 * x.nbytes / seconds,
        "bf16_matmul_flops_per_s": 2 * n**3 / matmul_seconds,
    }


def base_config(args) -> ed.Config:
    if args.config == "tiny":
        return ed.Config.tiny().trunk_only()
    return ed.Config.v4_flash().trunk_only()


def abstract_model(config: ed.Config, form: str):
    model = eqx.filter_eval_shape(ed.DeepseekV4, config, key=jax.random.key(0), dtype=jnp.bfloat16)
    return ed.quant.abstract_quantized(model) if form == "quantized" else model


def layers_that_fit(args, form: str, memory: int | None) -> int:
    """The most layers whose weights, with the largest batch's caches and a fifth of the
    memory for activations and the compiler, fit `memory` bytes (all of them without one)."""
    full = base_config(args)
    if args.layers:
        return min(args.layers, full.num_hidden_layers)
    if memory is None:
        return full.num_hidden_layers
    for n in range(full.num_hidden_layers, 0, -1):
        config = full.first_layers(n)
        weights = ed.quant.weight_bytes(abstract_model(config, form))["total"]
        caches = ed.inference.cache_bytes(config, args.cache, max(args.batches))["compressed"]
        if weights + caches <= 0.8 * memory:
            return n
    raise SystemExit(f"not even one layer of {args.config} fits {memory / GIB:.1f} GiB")


def random_model(config: ed.Config, form: str, seed: int = 0):
    """A model of random weights made on the device, leaf by leaf: normal values for float
    leaves; for quantised ones random bytes (FP4) or normal values cast to e4m3 (FP8), with
    ue8m0 scales of 2^-6; expert ids for the hash layers' tables."""
    skeleton = abstract_model(config, form)
    weights = jax.tree.leaves(skeleton, is_leaf=lambda x: isinstance(x, ed.quant.QuantizedWeight))
    scales = {id(w.scale) for w in weights if isinstance(w, ed.quant.QuantizedWeight)}
    leaves, treedef = jax.tree.flatten(skeleton)
    out = []
    for i, leaf in enumerate(leaves):
        key = jax.random.fold_in(jax.random.key(seed), i)
        kind = "scale" if id(leaf) in scales else "value"
        out.append(_fill(key, leaf.shape, jnp.dtype(leaf.dtype), kind, config.n_routed_experts))
    return jax.tree.unflatten(treedef, out)


@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4))
def _fill(key, shape, dtype, kind, experts):
    if kind == "scale":
        return jnp.full(shape, 127 - 6, dtype)
    if dtype == jnp.uint8:
        return jax.random.bits(key, shape, jnp.uint8)
    if jnp.issubdtype(dtype, jnp.integer):
        return jax.random.randint(key, shape, 0, experts, dtype)
    x = 0.02 * jax.random.normal(key, shape, jnp.float32)
    if dtype == jnp.float8_e4m3fn:
        x = 50 * x  # the release's FP8 values span the format's range under their scales
    return x.astype(dtype)


def decode_case(model, config: ed.Config, batch: int, length: int, repeats: int) -> dict:
    """One decode step at `batch` rows with caches of `length` tokens, `length - 96` of them
    counted as held (their contents random: a step's work does not depend on them)."""
    cache = model.init_cache(batch, length)
    cache = eqx.tree_at(lambda c: c.positions, cache, jnp.full((batch,), length - 96, jnp.int32))
    ids = jnp.ones((batch, 1), jnp.int32)
    step = eqx.filter_jit(lambda m, i, c: m.decode(i, c))
    t0 = time.perf_counter()
    jax.block_until_ready(step(model, ids, cache))
    compile_seconds = time.perf_counter() - t0
    seconds = median_seconds(lambda: step(model, ids, cache), repeats)
    weights = ed.quant.weight_bytes(model)["total"]
    held = sum(x.nbytes for x in jax.tree.leaves(cache))
    return {
        "batch": batch,
        "cache_tokens": length,
        "seconds": seconds,
        "compile_seconds": compile_seconds,
        "weight_bytes": weights,
        "cache_bytes": held,
        "tokens_per_s": batch / seconds,
    }


def prefill_case(model, config: ed.Config, tokens: int, repeats: int) -> dict:
    cache = model.init_cache(1, tokens)
    ids = jnp.ones((1, tokens), jnp.int32)
    step = eqx.filter_jit(lambda m, i, c: m.decode(i, c, last_only=True))
    t0 = time.perf_counter()
    jax.block_until_ready(step(model, ids, cache))
    compile_seconds = time.perf_counter() - t0
    seconds = median_seconds(lambda: step(model, ids, cache), repeats)
    return {
        "tokens": tokens,
        "seconds": seconds,
        "compile_seconds": compile_seconds,
        "weight_bytes": ed.quant.weight_bytes(model)["total"],
        "useful_flops": ed.train.forward_flops(config, tokens),
        "tokens_per_s": tokens / seconds,
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    report: dict = {}

    def stop(*_):  # a compile or step that outlasts the limit: what was measured, then exit
        report["timed_out"] = True
        print(json.dumps(report, indent=2), flush=True)
        sys.exit(2)

    signal.signal(signal.SIGALRM, stop)
    signal.alarm(int(args.time_limit * 1.25) + 30)
    device = jax.devices()[0]
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    memory = (stats or {}).get("bytes_limit")
    report |= {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": device.device_kind,
        "platform": device.platform,
        "device_count": jax.device_count(),
        "memory_bytes": memory,
        "jax": jax.__version__,
        "config": args.config,
        "floors": floors(args),
        "forms": {},
        "skipped": [],
    }
    floor = report["floors"]

    def late() -> bool:
        return time.perf_counter() - started > args.time_limit

    for form in args.forms:
        if late():
            report["skipped"].append(f"{form}: all")
            continue
        layers = layers_that_fit(args, form, memory)
        config = base_config(args).first_layers(layers)
        model = random_model(config, form)
        jax.block_until_ready(jax.tree.leaves(model))
        entry = {"layers": layers, "weight_bytes": ed.quant.weight_bytes(model)["total"]}
        entry["decode"] = []
        for batch in args.batches:
            if late():
                report["skipped"].append(f"{form}: decode batch {batch}")
                continue
            row = decode_case(model, config, batch, args.cache, args.repeats)
            row["floor_seconds"] = (row["weight_bytes"] + row["cache_bytes"]) / floor[
                "copy_bytes_per_s"
            ]
            row["floor_fraction"] = row["floor_seconds"] / row["seconds"]
            entry["decode"].append(row)
        if args.prefill and not late():
            row = prefill_case(model, config, args.prefill, max(1, args.repeats // 3))
            row["floor_seconds"] = max(
                row["weight_bytes"] / floor["copy_bytes_per_s"],
                row["useful_flops"] / floor["bf16_matmul_flops_per_s"],
            )
            row["floor_fraction"] = row["floor_seconds"] / row["seconds"]
            entry["prefill"] = row
        elif args.prefill:
            report["skipped"].append(f"{form}: prefill")
        report["forms"][form] = entry
        del model
    signal.alarm(0)
    report["seconds"] = time.perf_counter() - started
    report["timed_out"] = False
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
