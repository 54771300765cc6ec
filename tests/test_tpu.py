"""Compiling for TPUs without one: the prefill, decode step and train step of a 5-layer model
at the tiny model's widths are compiled ahead of time for a TPU v5p 2x2x1 topology (libtpu is
a test dependency) on a mesh of its four chips. The traces take the forms meant for the TPU,
not XLA:CPU's, because the execution `Policy` is decided from the platform of the mesh being
compiled for."""

import dataclasses
import importlib.util
import json
import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import COMPILE_REPORT_KEYS, ROOT, short_tiny
from jax.experimental import topologies
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

import equinox_dsv4 as ed
from equinox_dsv4.execution import platform_of, resolve
from equinox_dsv4.parallel import cache_shardings


AXES = ("data", "fsdp", "tensor", "expert")
# `helpers.short_tiny`: every kind of layer and both drivers in the fewest blocks to compile
# (TPU compiles of the 9-layer default took most of this file's time).
CONFIG = short_tiny(num_nextn_predict_layers=0)


def _mesh(devices) -> Mesh:
    # (data, fsdp, tensor, expert) = (1, 2, 1, 2); `jax.make_mesh` refuses to split a torus axis.
    return Mesh(np.array(devices).reshape(1, 2, 1, 2), AXES, axis_types=(AxisType.Auto,) * 4)


@pytest.fixture(scope="module")
def tpu_mesh() -> Mesh:
    devices = topologies.get_topology_desc(platform="tpu", topology_name="v5p:2x2x1").devices
    assert len(devices) == 4 and devices[0].platform == "tpu"
    return _mesh(devices)


def _placed(tree, shardings):
    return jax.tree.map(
        lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), tree, shardings
    )


def _model(mesh: Mesh, dtype=jnp.bfloat16):
    model = eqx.filter_eval_shape(ed.DeepseekV4, CONFIG, key=jax.random.key(0), dtype=dtype)
    return _placed(model, ed.parallel.named_shardings(model, mesh))


def _cache(model, mesh: Mesh, batch: int, max_len: int):
    # `model`'s cache, abstract and placed on `mesh` as decoding places it.
    cache = eqx.filter_eval_shape(lambda m: m.init_cache(batch, max_len), model)
    return _placed(cache, cache_shardings(cache, mesh))


def _decode_step(mesh: Mesh, max_len: int, batch: int = 2):
    model = _model(mesh)
    cache = _cache(model, mesh, batch, max_len)
    ids = jax.ShapeDtypeStruct((batch, 1), jnp.int32, sharding=NamedSharding(mesh, P(AXES[:2])))
    with jax.set_mesh(mesh):
        return jax.jit(lambda m, i, c: m.decode(i, c), donate_argnums=2).lower(model, ids, cache)


def test_target_platform_follows_the_mesh(tpu_mesh):
    # With no policy and no arrays to go by (a primitive called on its own), the policy is
    # the context mesh's platform's, else the default backend's.
    bf16 = jnp.zeros((2,), jnp.bfloat16)
    assert platform_of() == jax.default_backend() == "cpu"
    assert resolve(None).narrow(bf16) and not resolve(None).narrow(bf16.astype(jnp.float32))
    with jax.set_mesh(tpu_mesh):
        assert platform_of() == "tpu" and not resolve(None).narrow(bf16)
    with jax.set_mesh(_mesh(jax.devices()[:4])):
        assert platform_of() == "cpu" and resolve(None).narrow(bf16)
    # The policy of an ahead-of-time compile follows the arrays' placement, mesh set or not.
    assert (
        ed.execution.Policy.for_arrays(_model(tpu_mesh))
        == ed.execution.Policy.for_platform("tpu")
        == ed.execution.Policy(
            "tpu",
            experts="ragged",
            expert_buffer=2,
            experts_stay=True,
            barrier_slices=False,
            stationary_tokens=64,
            stationary_rows=512,
            split_chunks=1024,
            experts_in_place=True,
            attention_kernel=True,
            gather_in_steps=64,
        )
    )
    assert (
        ed.execution.Policy.for_arrays(bf16).widen_16bit
        and ed.execution.Policy.for_arrays(bf16).platform == "cpu"
    )


def test_tpu_meshes_split_dense_weights_over_expert(tpu_mesh):
    # The default placement on a TPU mesh with `expert` and no fsdp (QLoRA's): the dense weights
    # over `expert` too; on the same mesh of CPU devices (other platforms) they stay whole.
    tpu = Mesh(tpu_mesh.devices.reshape(1, 1, 1, 4), AXES, axis_types=(AxisType.Auto,) * 4)
    cpu = Mesh(np.array(jax.devices()[:4]).reshape(1, 1, 1, 4), AXES, axis_types=tpu.axis_types)
    assert ed.parallel.ShardingRules.for_mesh(tpu).changes() == ed.parallel.FSDP_EXPERT_RULES
    assert ed.parallel.ShardingRules.for_mesh(cpu).changes() == {}
    model = eqx.filter_eval_shape(ed.DeepseekV4, CONFIG, key=jax.random.key(0))
    (_, stack) = ed.parallel.partition_specs(model, tpu).layers
    assert stack.blocks[0].attn.wq_a.weight == P(None, None, "expert")  # fsdp (size 1) left out


def test_default_placement_is_near_the_perfect_split(tpu_mesh):
    # V4-Flash with the release's FP8/FP4 weights on v5p:4x4x4, fsdp 8 x expert 8: each chip's
    # bytes of weights by the default rules, against the whole divided by 64. 1.15x is the
    # bound asked of the default (padding and the blocks of quantised weights that cannot
    # split further account for the rest), which `DEFAULT_RULES` alone does not meet.
    del tpu_mesh  # the topology is held by this process already
    devices = topologies.get_topology_desc(platform="tpu", topology_name="v5p:4x4x4").devices
    mesh = Mesh(np.array(devices).reshape(1, 8, 1, 8), AXES, axis_types=(AxisType.Auto,) * 4)
    config = ed.Config.v4_flash().trunk_only()
    model = eqx.filter_eval_shape(ed.DeepseekV4, config, key=jax.random.key(0), dtype=jnp.bfloat16)
    model = ed.quant.abstract_quantized(model)

    def per_chip(rules):
        specs = ed.parallel.partition_specs(model, mesh, rules)
        leaves = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))
        total = held = 0
        for leaf, spec in zip(jax.tree.leaves(model), leaves, strict=True):
            axes = [a for e in spec if e for a in ((e,) if isinstance(e, str) else e)]
            size = int(np.prod(leaf.shape)) * leaf.dtype.itemsize
            total += size
            held += size / int(np.prod([mesh.shape[a] for a in axes]))
        return held / (total / 64)

    assert per_chip(None) <= 1.15
    assert per_chip(ed.parallel.ShardingRules()) > 1.15


def test_tpu_trace_takes_the_generic_forms(tpu_mesh):
    # XLA:CPU's forms carry bf16 layer stacks through optimization barriers (and more);
    # traced for the TPU mesh the same bf16 decode step has fewer of them.
    def barriers(lowered) -> int:
        return len(re.findall(r"optimization_barrier", lowered.as_text()))

    on_tpu = barriers(_decode_step(tpu_mesh, 256))
    on_cpu = barriers(_decode_step(_mesh(jax.devices()[:4]), 256))
    print(f"optimization barriers in the bf16 decode step: TPU {on_tpu}, CPU {on_cpu}")
    assert on_tpu < on_cpu, (on_tpu, on_cpu)


def _cache_bytes_per_chip(mesh: Mesh, max_len: int, batch: int = 2) -> int:
    cache = _cache(_model(mesh), mesh, batch, max_len)
    return sum(
        int(np.prod(x.sharding.shard_shape(x.shape))) * x.dtype.itemsize
        for x in jax.tree.leaves(cache)
    )


def test_decode_step_compiles_for_tpu(tpu_mesh):
    memory = _decode_step(tpu_mesh, 4096).compile().memory_analysis()
    # The per-chip bytes of the cache's entries, which grow with its length (from the shapes
    # alone: one program compiled).
    cache_growth = _cache_bytes_per_chip(tpu_mesh, 4096) - _cache_bytes_per_chip(tpu_mesh, 256)
    assert 0 < cache_growth < memory.argument_size_in_bytes
    # The donated cache is updated in place: its buffers are aliased to the outputs.
    assert memory.alias_size_in_bytes >= cache_growth
    print(
        f"TPU v5p decode step, per chip, 4096-token cache: temporaries "
        f"{memory.temp_size_in_bytes / 2**20:.2f} MiB, aliased "
        f"{memory.alias_size_in_bytes / 2**20:.2f} MiB (cache +{cache_growth / 2**20:.2f} MiB "
        f"from 256 tokens)"
    )


def test_prefill_compiles_for_tpu(tpu_mesh):
    # (The train step, forward and backward, compiles in test_compile_command_train_step_...)
    model = _model(tpu_mesh)
    rows = NamedSharding(tpu_mesh, P(AXES[:2]))
    cache = _cache(model, tpu_mesh, 2, 128)
    ids = jax.ShapeDtypeStruct((2, 64), jnp.int32, sharding=rows)
    with jax.set_mesh(tpu_mesh):
        prefill = jax.jit(lambda m, i, c: m.decode(i, c, last_only=True)).lower(model, ids, cache)
    compiled = prefill.compile()
    assert compiled.memory_analysis().temp_size_in_bytes > 0
    # The attention of its 64-token chunk is the Pallas kernel (`Policy.attention_kernel`),
    # compiled by Mosaic: in every layer, as each layer's kind of attention differs.
    # Their own cost estimates charge at least their operands and results, so the roofline
    # adds nothing to them (`hlo.pallas_shortfall`).
    kernels = [
        k
        for k in _hlo_module().pallas_kernels(compiled.as_text())
        if k["name"].startswith("window_and_entries_attention")
    ]
    assert len(kernels) >= len(set(CONFIG.layer_types)), kernels
    for k in kernels:
        assert k["estimate_bytes"] >= k["operand_and_result_bytes"], k


def test_compile_command_for_a_topology_quantized(tmp_path, tpu_mesh):
    # In this process (libtpu allows one process at a time): the CLI's TPU path with the
    # release's weights kept quantised, compiled for the topology's four chips.
    from equinox_dsv4 import compile as compile_cli

    del tpu_mesh  # the topology is held by this process already
    out = tmp_path / "compile.json"
    args = ["--model", "tiny", "--topology", "v5p:2x2x1", "--mesh", "fsdp=2,expert=2"]
    args += ["--quantized", "--phases", "decode", "--prefill", "32", "--json", str(out)]
    args += ["--rule", "vocab=fsdp+expert"]
    assert compile_cli.main(args) == 0
    report = json.loads(out.read_text())
    assert sorted(report) == COMPILE_REPORT_KEYS  # as for GPUs (test_gpu.py)
    assert report["platform"] == "tpu" and report["devices"] == 4 and report["quantized"]
    assert report["device"] == "TPU v5" and report["device_memory_bytes"] is None
    # The mesh's default (`ShardingRules.for_mesh`) and the override, recorded.
    default = {k: list(v) for k, v in ed.parallel.FSDP_EXPERT_RULES.items()}
    assert report["rules"] == {**default, "vocab": ["fsdp", "expert"]}
    decode = report["phases"]["decode"]
    assert decode["argument_bytes"] > 0 and decode["temp_bytes"] > 0
    # Arguments: the weights (quantised ones at the release's size) split over the chips,
    # plus the cache.
    ideal = report["parameter_bytes"] / 4 + report["cache_bytes"] / 2
    assert decode["argument_bytes"] < 1.5 * ideal


def test_compile_command_qlora_train_step_for_a_topology(tmp_path, tpu_mesh):
    # QLoRA on a v5p:2x2x1: the release's FP8/FP4 base frozen, rank-4 adapters trained, the
    # optimizer's moments of the adapters only (so the arguments are about the placed weights,
    # not three times them as in a full fine-tune), the useful FLOPs those of the forward and
    # the activations' backward.
    from equinox_dsv4 import compile as compile_cli

    del tpu_mesh  # the topology is held by this process already
    out = tmp_path / "qlora.json"
    args = ["--model", "tiny", "--topology", "v5p:2x2x1", "--mesh", "fsdp=2,expert=2"]
    args += ["--train", "--lora", "4", "--quantized", "--seq-len", "64", "--batch", "2"]
    args += ["--layers", "2", "--json", str(out)]
    assert compile_cli.main(args) == 0
    report = json.loads(out.read_text())
    assert report["lora"] == 4 and report["quantized"] and list(report["phases"]) == ["train"]
    train = report["phases"]["train"]
    config = ed.Config.tiny(num_nextn_predict_layers=0).first_layers(2)
    assert train["useful_flops"] == 2 * ed.train.forward_flops(config, 64, logits="all") * 2 / 4
    assert train["argument_bytes"] < 0.8 * report["parameter_bytes"], train


def test_compile_command_train_step_for_a_topology(tmp_path, tpu_mesh):
    # The CLI's train step: AdamW's moments placed as the parameters (arguments near the
    # ideal split), two micro-batches, and the roofline's MFU bound from an unrolled program.
    from equinox_dsv4 import compile as compile_cli

    del tpu_mesh  # the topology is held by this process already
    out = tmp_path / "train.json"
    args = ["--model", "tiny", "--topology", "v5p:2x2x1", "--mesh", "fsdp=2,expert=2"]
    args += ["--train", "--seq-len", "64", "--batch", "4", "--micro-batches", "2"]
    args += ["--layers", "2", "--unrolled", "--json", str(out)]
    assert compile_cli.main(args) == 0
    report = json.loads(out.read_text())
    assert list(report["phases"]) == ["train"] and report["micro_batches"] == 2
    assert report["layers"] == 2 and report["peak"]["chip"] == "v5p"
    train = report["phases"]["train"]
    config = ed.Config.tiny(num_nextn_predict_layers=0).first_layers(2)
    assert train["useful_flops"] == ed.train.train_flops(config, 64) * 4 / 4
    assert 0 < train["mfu_estimate"] <= 1 and train["estimate_seconds"] > 0
    # Parameters and Adam's two moments (in the parameters' dtype) split as the parameters
    # are: on fsdp x expert the default rules split the tiny model's largest weights
    # (embedding, head) over all four chips, so about 3 x weights / 4 per chip (the small
    # weights that do not split add some); moments replicated would be over 2 x weights.
    weights = report["parameter_bytes"]
    assert 0.7 * weights < train["argument_bytes"] < 0.9 * weights
    # The incoming state is donated: its buffers are the new state's.
    assert train["alias_bytes"] > 0.9 * train["output_bytes"] > 0


def test_exchanged_experts_compile_for_tpu(tpu_mesh):
    # The routed experts whole on each chip and their rows exchanged (`Policy.expert_exchange`,
    # `EXCHANGE_RULES`): libtpu's compiler takes the rounds' all-to-alls and their custom
    # backward (a train step's gradients of the weights, rows and routing weights), and no
    # expert's weights are gathered.
    rules = ed.parallel.ShardingRules.for_mesh(tpu_mesh).replace(**ed.parallel.EXCHANGE_RULES)
    experts = eqx.filter_eval_shape(
        ed.nn.Experts, CONFIG, key=jax.random.key(0), dtype=jnp.bfloat16
    )
    experts = _placed(experts, ed.parallel.named_shardings(experts, tpu_mesh, rules))
    # More assignments than the TPU policy's `stationary_rows`, split over every chip.
    tokens, top_k = 1024, CONFIG.num_experts_per_tok
    rows = NamedSharding(tpu_mesh, P(AXES[:2]))
    x = jax.ShapeDtypeStruct((tokens, CONFIG.hidden_size), jnp.bfloat16, sharding=rows)
    ids = jax.ShapeDtypeStruct((tokens, top_k), jnp.int32, sharding=rows)
    w = jax.ShapeDtypeStruct((tokens, top_k), jnp.float32, sharding=rows)

    def gradients(experts, x, ids, w):
        def loss(diff):
            experts, x, w = diff
            return jnp.sum(experts(x, ids, w).astype(jnp.float32))

        return eqx.filter_grad(loss)((experts, x, w))

    with jax.set_mesh(tpu_mesh):  # the TPU's policy, with the exchange
        policy = dataclasses.replace(resolve(None), expert_exchange=True)
        experts = ed.execution.with_policy(experts, policy)
        lowered = jax.jit(gradients).lower(experts, x, ids, w)
    text = lowered.as_text()
    assert "all_to_all" in text and "all_gather" not in text
    assert lowered.compile().memory_analysis().temp_size_in_bytes > 0


# A decode step's cache write into a stack, as XLA's TPU backend fuses it: the stack's four
# rows [layer 0, sequence b, entry i] set to the converted updates, in place.
_SCATTER_HLO = """
%fused_scatter (p0: bf16[8,4,1024,64], p1: s32[4,3], p2: f32[4,64]) -> bf16[8,4,1024,64] {
  %p0 = bf16[8,4,1024,64]{3,2,1,0} parameter(0)
  %p1 = s32[4,3]{1,0} parameter(1)
  %p2 = f32[4,64]{1,0} parameter(2)
  %convert.1 = bf16[4,64]{1,0} convert(%p2)
  ROOT %scatter.1 = bf16[8,4,1024,64]{3,2,1,0} scatter(%p0, %p1, %convert.1), {WINDOWS}
}

ENTRY %main (stack: bf16[8,4,1024,64], index: s32[4,3], rows: f32[4,64]) -> bf16[8,4,1024,64] {
  %stack = bf16[8,4,1024,64]{3,2,1,0} parameter(0)
  %index = s32[4,3]{1,0} parameter(1)
  %rows = f32[4,64]{1,0} parameter(2)
  %rows.1 = bf16[4,64]{1,0} convert(%rows)
  %scatter.2 = bf16[8,4,1024,64]{3,2,1,0} scatter(%stack, %index, %rows.1), {WINDOWS}
  ROOT %fusion = bf16[8,4,1024,64]{3,2,1,0} fusion(%scatter.2, %index, %rows), calls=%fused_scatter
}
""".replace(
    "{WINDOWS}",
    "update_window_dims={1}, inserted_window_dims={0,1,2}, "
    "scatter_dims_to_operand_dims={0,1,2}, index_vector_dim=1",
)


def _hlo_module():
    spec = importlib.util.spec_from_file_location("hlo", ROOT / "benchmarks" / "hlo.py")
    hlo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hlo)
    return hlo


def test_roofline_charges_a_scatter_its_updates():
    # benchmarks/tpu_roofline.py's traffic by part charges a buffer updated in place its
    # updates, as XLA's cost analysis counts it; charged the whole stack (read and written),
    # the compressors' entry writes were 207 GiB per chip of a decode step XLA counts at
    # 27.5 GiB in all (V4-Flash, 1M-token cache).
    hlo = _hlo_module()
    table, computations = hlo.parse(_SCATTER_HLO)
    index, rows = 4 * 3 * 4, 4 * 64 * 2
    assert hlo.kernel_bytes("scatter.2", table, computations) == index + 2 * rows
    # The fusion reads the index and the float32 rows, and writes the bf16 rows.
    assert hlo.kernel_bytes("fusion", table, computations) == index + 2 * rows + rows


# A Pallas kernel as XLA's TPU dump prints it: seven operands (the sixth and seventh after an
# `/*index=5*/` comment), metadata over three lines, its own cost estimate in its backend
# config on the last.
_SIZES = (("b", 9), ("c", 15), ("d", 15), ("e", 1))
_KERNEL_HLO = "\n".join(
    [
        "ENTRY %main () -> bf16[1024,256] {",
        "  %a = s32[]{:T(128)} parameter(0)",
        *(f"  %{n} = s32[{d}]{{0}} parameter({i + 1})" for i, (n, d) in enumerate(_SIZES)),
        "  %lhs = bf16[1024,512]{1,0} parameter(5)",
        "  %rhs = bf16[8,512,256]{2,1,0} parameter(6)",
        "  ROOT %gmm.1 = bf16[1024,256]{1,0} custom-call(%a, %b, %c, %d, %e, /*index=5*/%lhs, "
        '%rhs), custom_call_target="tpu_custom_call", frontend_attributes={kernel_metadata={',
        '"xprof_metadata":"{\\"tile_m\\": 512}"',
        '}}, metadata={op_name="jit(step)/gmm/pallas_call"}, backend_config={"custom_call_config":'
        '{"cost_estimate":{"bytes_accessed":"ESTIMATE","flops":"268435456"}}}',
        "}",
    ]
)


@pytest.mark.parametrize("estimate", [6553600, 1000000])
def test_pallas_kernels_are_charged_at_least_their_operands(estimate):
    # tpu_maxtext.py adds to XLA's bytes what a Pallas kernel's own estimate leaves out of its
    # operands and result. Operands past the fifth follow an `/*index=5*/` comment, which the
    # parser once took into their names, charging them nothing; an instruction's lines after
    # its first it once dropped (MaxText's kernels' estimates: none read, all charged again).
    hlo = _hlo_module()
    kernels = hlo.pallas_kernels(_KERNEL_HLO.replace("ESTIMATE", str(estimate)))
    needed = 4 * (1 + 9 + 15 + 15 + 1) + (1024 * 512 + 8 * 512 * 256 + 1024 * 256) * 2
    assert kernels == [
        {"name": "gmm.1", "estimate_bytes": estimate, "operand_and_result_bytes": needed}
    ]
    count, short = hlo.pallas_shortfall(_KERNEL_HLO.replace("ESTIMATE", str(estimate)))
    assert (count, short) == (1, max(0, needed - estimate))


def test_attention_kernels_fit_a_chip_at_v4_shapes():
    # The attention kernels (`Policy.attention_kernel`), forward and backward, compiled by
    # Mosaic for one v5p chip at a V4-Flash prefill's per-chip attention (512 queries, 64
    # heads of 512, a 128-token window, 1024 compressed entries): with eight heads per
    # program the backward kernel's blocks exceeded the compiler's scoped on-core memory
    # (`CompileTimeScopedVmemOom`), which the tiny model's compiles never reach.
    devices = topologies.get_topology_desc(platform="tpu", topology_name="v5p:2x2x1").devices
    mesh = Mesh(np.array(devices[:1]).reshape(1, 1, 1, 1), AXES, axis_types=(AxisType.Auto,) * 4)
    b, t, h, k, w, m = 1, 512, 64, 512, 128, 1024

    def spec(shape, dtype=jnp.bfloat16):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, P()))

    args = (spec((b, t, h, k)), spec((b, t, k)), spec((h,), jnp.float32), spec((b, m, k)))
    mask = spec((b, t, m), jnp.bool_)
    policy = ed.execution.Policy.for_platform("tpu")

    def loss(q, kv, sinks, entries, mask):
        out = ed.nn.attend(q, kv, sinks, w, compressed=entries, compressed_mask=mask, policy=policy)
        return jnp.sum(out.astype(jnp.float32))

    with jax.set_mesh(mesh):
        compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3))).lower(*args, mask).compile()
    kernels = re.findall(r'op_name="[^"]*(window_and_entries_attention\w*)', compiled.as_text())
    assert set(kernels) == {"window_and_entries_attention", "window_and_entries_attention_grad"}


@pytest.mark.parametrize(
    "shape, spec",
    [
        ((8192, 1024), P("expert", "fsdp")),  # wq_b, wo_a, the shared experts' w1 and w3
        ((1024, 4096), P(None, ("fsdp", "expert"))),  # wq_a, wkv, the router, ...
        ((4096, 2048), P(("fsdp", "expert"), None)),  # wo_b, the shared experts' w2
    ],
)
def test_weights_gathered_axis_by_axis_on_64_chips(shape, spec):
    # `Policy.gather_in_steps` (the TPU policy's, from 64 chips): on v5p:4x4x4 (fsdp 8 x
    # expert 8) the TPU compiler gathers a prefill's dense weight, split over every chip, as
    # an all-reduce of a zero-filled whole weight; one mesh axis at a time, as all-gathers,
    # and fewer bytes in all. The weights' three placements under the default TPU rules.
    devices = topologies.get_topology_desc(platform="tpu", topology_name="v5p:4x4x4").devices
    mesh = Mesh(np.array(devices).reshape(1, 8, 1, 8), AXES, axis_types=(AxisType.Auto,) * 4)
    weight = jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=NamedSharding(mesh, spec))
    x = jax.ShapeDtypeStruct(
        (8, 1024, shape[1]), jnp.bfloat16, sharding=NamedSharding(mesh, P("fsdp", "expert"))
    )
    tpu = ed.execution.Policy.for_platform("tpu")
    assert tpu.gather_in_steps == 64
    compiled = {}
    for steps in (0, 64):
        policy = dataclasses.replace(tpu, gather_in_steps=steps)
        with jax.set_mesh(mesh):
            product = jax.jit(lambda x, w, p=policy: ed.execution.linear(x, w, p))
            compiled[steps] = product.lower(x, weight).compile()
    collectives = {
        steps: re.findall(r" (all-reduce|all-gather)(?:-start)?\(", c.as_text())
        for steps, c in compiled.items()
    }
    assert "all-reduce" in collectives[0] and "all-reduce" not in collectives[64], collectives
    size = {steps: c.cost_analysis()["bytes accessed"] for steps, c in compiled.items()}
    assert size[64] < size[0], size
