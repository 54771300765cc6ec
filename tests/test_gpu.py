"""Compiling for NVIDIA GPUs without one: the CUDA plugin (a test dependency, the `aot` extra)
gives compile-only GPU devices from a committed target configuration, and
`python -m equinox_dsv4.compile --topology h100:N` compiles the model's programs for them with
the per-device memory check that XLA's GPU compiler does not make. The traces take the generic
forms (the policy follows the mesh's platform), quantised experts are dequantised a layer at a
time inside the layer loop, and benchmarks/gpu.py runs (on the CPU here, so that it cannot
rot)."""

import dataclasses
import json
import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import COMPILE_REPORT_KEYS, run_python, succeeded
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

import equinox_dsv4 as ed
from equinox_dsv4 import compile as compile_cli
from equinox_dsv4.compile import GPU_CONFIGS, gpu_config_field, parse_topology, target


AXES = ("data", "fsdp", "tensor", "expert")
H100 = (GPU_CONFIGS / "h100.txtpb").read_text()


def _mesh(devices) -> Mesh:
    return Mesh(np.array(devices).reshape(1, 2, 1, 2), AXES, axis_types=(AxisType.Auto,) * 4)


@pytest.fixture(scope="module")
def gpu_mesh() -> Mesh:
    chip = target("h100:4")
    assert len(chip.devices) == 4 and chip.devices[0].platform == "gpu"
    assert chip.description == "NVIDIA H100 80GB HBM3" and chip.memory_bytes == 81559 * 2**20
    return _mesh(chip.devices)


def test_gpu_topologies_parse():
    assert parse_topology("h200:8") == ("gpu", "h200", 8)
    assert parse_topology("b200:16") == ("gpu", "b200", 16)
    assert parse_topology("v5p:4x4x4") == ("tpu", "v5p", None)
    for bad, words in [("h100:12", "whole nodes of 8"), ("h100", "NAME:COUNT"), ("h100:0", "")]:
        with pytest.raises(ValueError, match=f"bad GPU topology 'h100.*{words}"):
            parse_topology(bad)
    for name in ("h100", "h200", "b200"):
        text = (GPU_CONFIGS / f"{name}.txtpb").read_text()
        assert gpu_config_field(text, "device_description_str").startswith("NVIDIA")
        assert int(gpu_config_field(text, "device_memory_size")) > 80 * 10**9


def _decode_step(mesh: Mesh, batch: int = 2):
    config = dataclasses.replace(ed.Config.tiny().trunk_only(), scan_min_repeats=2)
    model = eqx.filter_eval_shape(ed.DeepseekV4, config, key=jax.random.key(0), dtype=jnp.bfloat16)
    model = jax.tree.map(
        lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
        model,
        ed.parallel.named_shardings(model, mesh),
    )
    cache = eqx.filter_eval_shape(lambda m: m.init_cache(batch, 256), model)
    cache = jax.tree.map(
        lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
        cache,
        ed.parallel.cache_shardings(cache, mesh),
    )
    ids = jax.ShapeDtypeStruct((batch, 1), jnp.int32, sharding=NamedSharding(mesh, P(AXES[:2])))
    with jax.set_mesh(mesh):
        lowered = jax.jit(lambda m, i, c: m.decode(i, c), donate_argnums=2).lower(model, ids, cache)
    return model, lowered


def test_gpu_trace_takes_the_generic_forms(gpu_mesh):
    # The policy of a compile for GPUs is the GPUs': the generic forms and ragged_dot, none of
    # XLA:CPU's (which carry bf16 layer stacks through optimization barriers, and more).
    model, on_gpu = _decode_step(gpu_mesh)
    assert ed.execution.Policy.for_arrays(model) == ed.execution.Policy(
        "gpu", experts="ragged", rolled_sinkhorn=True
    )
    _, on_cpu = _decode_step(_mesh(jax.devices()[:4]))

    def barriers(lowered) -> int:
        return len(re.findall(r"optimization_barrier", lowered.as_text()))

    print(f"optimization barriers in the bf16 decode step: GPU {barriers(on_gpu)}, CPU "
          f"{barriers(on_cpu)}")  # fmt: skip
    assert barriers(on_gpu) < barriers(on_cpu)
    # The Sinkhorn rounds a loop on GPUs (unrolled, XLA's GPU compiler is impractically slow
    # on V4-Flash's decode step; docs/design.md): one while loop more per mHC site.
    loops = [len(re.findall(r"stablehlo.while", x.as_text())) for x in (on_gpu, on_cpu)]
    assert loops[0] > loops[1], loops
    # The cache check (a host callback) cannot be lowered without a GPU runtime: left out.
    assert "callback" not in on_gpu.as_text() and "callback" in on_cpu.as_text()


def test_compile_command_for_gpus(tmp_path, gpu_mesh):
    # The CLI's prefill, decode step and train step for four H100s: the TPU runs' report, with
    # the GPU's name and memory, and each phase's bytes under it.
    del gpu_mesh
    out = tmp_path / "gpu.json"
    args = ["--model", "tiny", "--topology", "h100:4", "--mesh", "fsdp=2,expert=2"]
    args += ["--phases", "prefill,decode,train", "--prefill", "32", "--batch", "2"]
    args += ["--layers", "1", "--json", str(out)]
    assert compile_cli.main(args) == 0
    report = json.loads(out.read_text())
    assert sorted(report) == COMPILE_REPORT_KEYS
    assert report["platform"] == "gpu" and report["devices"] == 4
    assert report["device"] == "NVIDIA H100 80GB HBM3" and report["peak"]["chip"] == "h100"
    assert report["device_memory_bytes"] == 81559 * 2**20
    for phase in ("prefill", "decode", "train"):
        row = report["phases"][phase]
        total = row["argument_bytes"] + row["output_bytes"] + row["temp_bytes"]
        assert row["needed_bytes"] == total - row["alias_bytes"] > 0, phase
        assert row["flops"] is None and row["mfu_estimate"] is None  # no FLOP count on GPUs
    # The train step's arguments: weights and Adam's two moments split over the devices
    # (about 3 x weights / 2 per device here: the GPUs' default rules split the embedding and
    # the head over fsdp only).
    weights = report["parameter_bytes"]
    assert 1.3 * weights < report["phases"]["train"]["argument_bytes"] < 1.7 * weights


@pytest.mark.parametrize(
    "mib, what",
    [(8, r"the weights alone"), (10, r"arguments \+ outputs \+ temporaries - aliased")],
)
def test_compile_refuses_what_does_not_fit(tmp_path, capsys, gpu_mesh, mib, what):
    # GPUs of 8 and 10 MiB (the H100's configuration, its memory size changed), for one layer
    # of the tiny model whose weights take 9 MiB per device: refused before compiling, and
    # after compiling the decode step; exit 1, one line naming the phase, the bytes and the
    # device's memory; no report written.
    del gpu_mesh
    small = tmp_path / "small.txtpb"
    small.write_text(re.sub(r"device_memory_size: \d+", f"device_memory_size: {mib << 20}", H100))
    out = tmp_path / "gpu.json"
    args = ["--model", "tiny", "--topology", "h100:4", "--target-config", str(small)]
    args += ["--mesh", "fsdp=4", "--phases", "decode", "--layers", "1", "--json", str(out)]
    assert compile_cli.main(args) == 1
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error")]
    assert len(errors) == 1, errors
    expected = (
        rf"error: decode: [\d.]+ MiB per device \({what}\) exceed the NVIDIA H100 80GB HBM3's "
        rf"{mib}\.00 MiB"
    )
    assert re.fullmatch(expected, errors[0]), errors[0]
    assert not out.exists()
    with pytest.raises(ValueError, match="--target-config is for GPU topologies"):
        target("v5p:2x2x1", str(small))


def test_quantized_experts_dequantise_a_layer_at_a_time(tmp_path, gpu_mesh):
    # The tiny model kept in the release's FP8/FP4, its (HCA, CSA) pairs in a scan of 3: the
    # GPU decode step holds the FP4 stacks (u8, two codes a byte) of all 3 repeats and
    # dequantises the experts of one layer at a time inside the loop: no bf16 or f32 array of
    # a stack's shape.
    del gpu_mesh
    hlo = tmp_path / "hlo"
    args = ["--model", "tiny", "--topology", "h100:4", "--mesh", "fsdp=2,expert=2"]
    args += ["--phases", "decode", "--quantized", "--hlo", str(hlo)]
    assert compile_cli.main(args) == 0
    text = (tmp_path / "hlo.decode.txt").read_text()
    # w1 / w3 of the 4 local experts: 64 hidden units split over fsdp, 64 inputs (32 bytes).
    assert re.search(r"u8\[3,4,32,32\]", text)
    assert re.search(r"bf16\[4,32,64\]", text)  # one layer's, dequantised for the products
    assert not re.search(r"(bf16|f32)\[3,4,(32,64|64,32)\]", text)


def test_gpu_benchmark_runs(tmp_path):
    # benchmarks/gpu.py end to end on the CPU with one layer of the tiny model: every field.
    out = tmp_path / "gpu.json"
    flags = "--config tiny --layers 1 --batches 1,2 --cache 128 --prefill 16 --repeats 2"
    flags += f" --copy-bytes {1 << 20} --matmul 128 --json {out}"
    succeeded(run_python("benchmarks/gpu.py", *flags.split()))
    report = json.loads(out.read_text())
    assert report["platform"] == "cpu" and not report["timed_out"] and report["skipped"] == []
    assert report["floors"]["copy_bytes_per_s"] > 0
    assert report["floors"]["bf16_matmul_flops_per_s"] > 0
    for form in ("quantized", "bf16"):
        entry = report["forms"][form]
        assert entry["layers"] == 1 and entry["weight_bytes"] > 0
        assert [r["batch"] for r in entry["decode"]] == [1, 2]
        for row in entry["decode"] + [entry["prefill"]]:
            assert row["seconds"] > 0 and row["floor_seconds"] > 0
            assert row["floor_fraction"] == row["floor_seconds"] / row["seconds"]
    quantized, bf16 = (report["forms"][f]["weight_bytes"] for f in ("quantized", "bf16"))
    assert quantized < bf16  # the tiny model is mostly its embedding and head (bf16 in both)
    assert report["forms"]["bf16"]["prefill"]["useful_flops"] > 0
