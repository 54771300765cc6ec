"""The full model against transformers on three tiny configs, the MTP block against a reference
built from transformers' components, the scan / unrolled paths, and the full-size shapes."""

import dataclasses
import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from helpers import COMPONENT, LOGITS, SAME
from hf_reference import (
    FIVE_LAYERS,
    C,
    H,
    S,
    abstract,
    decode_temporaries,
    hf_config,
    load_component,
    our_model,
    random_fill,
    randomize,
    reference_logits,
    reference_model,
    tiny_config,
    to_numpy,
    to_torch,
    window_mask,
)
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf

import equinox_dsv4 as ed
from equinox_dsv4.nn import LayerStack


# Together: hc_mult 4 and 2; YaRN and plain compress rope; hash layers followed by learned ones;
# lengths that are not multiples of the ratios, shorter than one block, and with more visible
# CSA blocks than index_topk; batch 1 and 2; a scanned (HCA, CSA) period and a scanned run of
# one kind.
CONFIGS = {
    # 9 layers, Flash pattern: S S C | (H C) x 3, first three hash-routed. The released 20
    # Sinkhorn iterations are held to the reference per component
    # (tests/test_hyper.py::test_hyper_connection_matches_reference): unrolled, they would
    # make each whole-model program here costlier to compile.
    "flash_like": tiny_config(),
    # 7 layers, Pro pattern: H H C H C H C, two hash layers, hc_mult 2, no YaRN, ratio 16.
    "pro_like": tiny_config(
        layer_types=(H, H, C, H, C, H, C),
        num_hash_layers=2,
        hc_mult=2,
        rope_scaling=None,
        compress_rate_hca=16,
        sliding_window=16,
        num_attention_heads=8,
        o_groups=4,
        index_topk=4,
        scan_min_repeats=2,
    ),
    # S | C x 4 | H: a period-1 scan, wider heads, three experts per token, active clamps.
    "wide_heads": tiny_config(
        layer_types=(S, C, C, C, C, H),
        num_hash_layers=1,
        head_dim=64,
        qk_rope_head_dim=16,
        index_head_dim=32,
        sliding_window=4,
        index_topk=2,
        n_routed_experts=6,
        num_experts_per_tok=3,
        swiglu_limit=1.0,
        rope_scaling=ed.config.YarnScaling(factor=8.0, original_max_position_embeddings=16),
    ),
}
CASES = [
    ("flash_like", 2, 37),
    ("flash_like", 1, 5),
    ("flash_like", 2, 3),
    ("pro_like", 2, 70),
    ("pro_like", 1, 9),
    ("wide_heads", 2, 29),
]


# A layer on its own, then an unrolled stack of two (CSA, HCA) periods: the model of
# `test_every_policy_computes_the_same_model` and `test_scan_and_unrolled_give_identical_logits`.
POLICY_CONFIG = tiny_config(
    **FIVE_LAYERS,
    scan_layers=False,
    index_n_heads=8,
    num_nextn_predict_layers=0,
)
POLICY_IDS = np.random.default_rng(2).integers(0, 97, (2, 30)).astype(np.int32)


@pytest.fixture(scope="module")
def models():
    cache = {}

    def get(name):
        if name not in cache:
            reference = reference_model(CONFIGS[name], seed=len(cache) + 1)
            cache[name] = reference, our_model(CONFIGS[name], reference)
        return cache[name]

    return get


@pytest.mark.parametrize("name,batch,seq", CASES)
def test_logits_match_reference(models, name, batch, seq):
    reference, ours = models(name)
    ids = np.random.default_rng(seq).integers(0, ours.config.vocab_size, (batch, seq))
    expected = reference_logits(reference, ids)
    logits = eqx.filter_jit(ours)(jnp.asarray(ids, jnp.int32))
    assert logits.dtype == jnp.float32 and logits.shape == (batch, seq, ours.config.vocab_size)
    np.testing.assert_allclose(logits, expected, **LOGITS)


def test_plans_of_the_test_configs():
    plans = {name: ed.config.LayerPlan.from_config(cfg) for name, cfg in CONFIGS.items()}
    assert [s.repeats for s in plans["flash_like"].segments] == [1, 1, 1, 3]
    assert plans["flash_like"].segments[-1].period == ((H, ed.config.MOE), (C, ed.config.MOE))
    assert [s.repeats for s in plans["pro_like"].segments] == [2, 1, 2]
    assert [(s.start, s.repeats, len(s.period)) for s in plans["wide_heads"].segments] == [
        (0, 1, 1),
        (1, 4, 1),
        (5, 1, 1),
    ]


def test_scan_and_unrolled_give_identical_logits():
    # Same weights, different static config (`scan_layers`). The unrolled model and its
    # forward are `test_every_policy_computes_the_same_model`'s (one program for both tests,
    # from the jit or the persistent compilation cache): a layer on its own, then a stack of
    # two (CSA, HCA) periods, scanned or run by the Python loop.
    unrolled = random_fill(abstract(ed.DeepseekV4, POLICY_CONFIG), 5)
    skeleton = abstract(ed.DeepseekV4, dataclasses.replace(POLICY_CONFIG, scan_layers=True))
    scanned = jax.tree.unflatten(jax.tree.structure(skeleton), jax.tree.leaves(unrolled))
    assert scanned.layers[1].scan and not unrolled.layers[1].scan
    assert scanned.layers[1].repeats == 2
    cpu = ed.execution.Policy.for_platform("cpu")
    ids = jnp.asarray(POLICY_IDS)
    a = ed.execution.with_policy(scanned, cpu)(ids)
    b = ed.execution.with_policy(unrolled, cpu)(ids)
    np.testing.assert_allclose(a, b, **SAME)


def test_unrolled_stack_gradient_equals_the_scanned_one():
    # Unrolled, each layer's slice of the stacked weights has a hand-written derivative (the
    # static slice's, `execution.take_layer`); the scan's is JAX's own.
    config = tiny_config(layer_types=(S, S, S), num_hash_layers=0, scan_min_repeats=2)
    scanned = random_fill(abstract(ed.DeepseekV4, config), 1)
    assert isinstance(scanned.layers[0], LayerStack) and scanned.layers[0].repeats == 3
    skeleton = abstract(ed.DeepseekV4, dataclasses.replace(config, scan_layers=False))
    unrolled = jax.tree.unflatten(jax.tree.structure(skeleton), jax.tree.leaves(scanned))
    # The drivers: `lax.scan` over the repeats, and the Python loop over the same weights.
    assert scanned.layers[0].scan and not unrolled.layers[0].scan
    ids = jnp.asarray(np.random.default_rng(1).integers(0, 97, (1, 12)), jnp.int32)

    @eqx.filter_jit
    @eqx.filter_grad
    def grad(model):
        return jnp.sum(jnp.sin(model(ids)))

    # In NumPy from here: op by op, JAX would compile a program for each leaf's shape.
    a = jax.tree.map(np.asarray, grad(scanned).layers[0])
    b = jax.tree.map(np.asarray, grad(unrolled).layers[0])
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(x, y, atol=1e-6 * float(np.max(np.abs(x))), rtol=1e-5)
    # Every layer of the stack has its own gradient, in its own place.
    w = b.blocks[0].attn.wq_a.weight
    assert w.shape[0] == 3 and all(np.any(w[r]) for r in range(3))


def test_unrolled_layer_slice_derivatives_are_a_static_slices():
    stack = jax.random.normal(jax.random.key(0), (3, 2, 4))
    after = jnp.ones((2, 5))
    for r in range(3):

        def ours(a, r=r):
            return jnp.sin(ed.execution.take_layer(a, ed.execution.index_after(r, after), r))

        def static(a, r=r):
            return jnp.sin(a[r])

        np.testing.assert_array_equal(ours(stack), static(stack))
        loss = [lambda a, f=f: jnp.sum(f(a) ** 2) for f in (ours, static)]
        np.testing.assert_array_equal(jax.grad(loss[0])(stack), jax.grad(loss[1])(stack))
        tangent = jnp.ones_like(stack)
        np.testing.assert_array_equal(
            jax.jvp(ours, (stack,), (tangent,))[1], jax.jvp(static, (stack,), (tangent,))[1]
        )


def test_layer_weights_do_not_depend_on_the_plan():
    config = tiny_config(layer_types=(S, C, H, C, H), num_hash_layers=1, num_nextn_predict_layers=0)
    scanned = ed.DeepseekV4(dataclasses.replace(config, scan_min_repeats=2), key=jax.random.key(3))
    flat = ed.DeepseekV4(config, key=jax.random.key(3))
    assert scanned.layers[1].repeats == 2
    assert all(not s.scanned for s in flat.plan.segments)
    np.testing.assert_array_equal(
        scanned.layers[1].blocks[0].attn.wq_a.weight[1],
        flat.layers[3].blocks[0].attn.wq_a.weight[0],
    )


def _top_level_scan_lengths(config):
    model = eqx.filter_eval_shape(ed.DeepseekV4, config, key=jax.random.key(0))
    ids = jax.ShapeDtypeStruct((1, 8), jnp.int32)
    jaxpr = eqx.filter_make_jaxpr(lambda m, i: m(i))(model, ids)[0].jaxpr
    # `__call__` runs through its own jit: the forward pass is inside that one call.
    (call,) = [e for e in jaxpr.eqns if e.primitive.name in ("jit", "pjit")]
    jaxpr = call.params["jaxpr"].jaxpr
    return [e.params["length"] for e in jaxpr.eqns if e.primitive.name == "scan"]


def flash_shaped_tiny():
    """V4-Flash's 43-layer schedule with tiny widths."""
    flash = ed.Config.v4_flash()
    return dataclasses.replace(
        tiny_config(layer_types=flash.layer_types, num_hash_layers=3),
        num_nextn_predict_layers=0,
    )


def test_flash_plan_is_three_unrolled_then_one_scan_of_twenty():
    for config in (ed.Config.v4_flash(), flash_shaped_tiny()):
        plan = ed.config.LayerPlan.from_config(config)
        assert [(s.start, s.repeats, s.period) for s in plan.segments] == [
            (0, 1, ((S, ed.config.HASH_MOE),)),
            (1, 1, ((S, ed.config.HASH_MOE),)),
            (2, 1, ((C, ed.config.HASH_MOE),)),
            (3, 20, ((H, ed.config.MOE), (C, ed.config.MOE))),
        ]
    # In the program: one scan of length 20 over the layers (the other scans are the expert
    # dispatch loops inside the three unrolled layers), and none when scan_layers is off.
    lengths = _top_level_scan_lengths(flash_shaped_tiny())
    assert lengths.count(20) == 1
    # The unrolled check on the schedule's first 17 layers (three, then a scan of 7 periods):
    # tracing 43 unrolled layers took most of this test, and the depth is not what it checks.
    flash = ed.Config.v4_flash()
    shorter = dataclasses.replace(
        tiny_config(layer_types=flash.layer_types[:17], num_hash_layers=3),
        num_nextn_predict_layers=0,
    )
    assert _top_level_scan_lengths(shorter).count(7) == 1
    unrolled = dataclasses.replace(shorter, scan_layers=False)
    assert 7 not in _top_level_scan_lengths(unrolled)


def test_pro_plan():
    plan = ed.config.LayerPlan.from_config(ed.Config.v4_pro())
    assert [(s.start, s.repeats, s.period) for s in plan.segments] == [
        (0, 1, ((H, ed.config.HASH_MOE),)),
        (1, 1, ((H, ed.config.HASH_MOE),)),
        (2, 1, ((C, ed.config.HASH_MOE),)),
        (3, 29, ((H, ed.config.MOE), (C, ed.config.MOE))),
    ]


def _parameter_count(model) -> int:
    # transformers counts parameters, not buffers: tid2eid and the router bias are buffers.
    total = 0
    for path, leaf in jax.tree_util.tree_flatten_with_path(model)[0]:
        key = jax.tree_util.keystr(path)
        assert isinstance(leaf, jax.ShapeDtypeStruct), f"{key} was allocated"
        if key.startswith(".mtp") or key.endswith("gate.bias"):
            continue
        if jnp.issubdtype(leaf.dtype, jnp.floating):
            total += int(np.prod(leaf.shape))
    return total


@pytest.mark.parametrize("preset,billions", [("v4_flash", 284.33), ("v4_pro", 1573.00)])
def test_full_size_parameter_count_matches_transformers(preset, billions):
    config = getattr(ed.Config, preset)()
    ours = eqx.filter_eval_shape(ed.DeepseekV4, config, key=jax.random.key(0), dtype=jnp.bfloat16)
    with torch.device("meta"):
        reference = transformers.DeepseekV4ForCausalLM(hf_config(config))
    expected = sum(p.numel() for p in reference.parameters())
    assert _parameter_count(ours) == expected
    assert round(expected / 1e9, 2) == billions
    assert len(ours.mtp) == 1


def test_mtp_matches_reference_composition(getkey):
    """The MTP block per the official `MTPBlock.forward`, assembled from transformers' modules."""
    config = tiny_config()
    mtp_cfg = hf_config(
        dataclasses.replace(
            config, num_hidden_layers=1, layer_types=(S,), mlp_layer_types=(ed.config.MOE,)
        )
    )
    d = config.hidden_size
    torch.manual_seed(0)
    ref = torch.nn.ModuleDict(
        dict(
            embed=torch.nn.Embedding(config.vocab_size, d),
            enorm=hf.DeepseekV4RMSNorm(d),
            hnorm=hf.DeepseekV4RMSNorm(d),
            norm=hf.DeepseekV4RMSNorm(d),
            e_proj=torch.nn.Linear(d, d, bias=False),
            h_proj=torch.nn.Linear(d, d, bias=False),
            block=hf.DeepseekV4DecoderLayer(mtp_cfg, 0),
            hc_head=hf.DeepseekV4HyperHead(mtp_cfg),
            head=torch.nn.Linear(d, config.vocab_size, bias=False),
        )
    )
    randomize(ref, seed=7)

    model = random_fill(abstract(ed.DeepseekV4, config), 0)
    w = {name: jnp.asarray(to_numpy(p)) for name, p in ref.named_parameters()}
    mtp = model.mtp[0]
    block = load_component(mtp.block, ref["block"], "model.layers.0.", "")
    mtp = eqx.tree_at(
        lambda m: (m.block, m.e_proj.weight, m.h_proj.weight, m.enorm.weight, m.hnorm.weight),
        mtp,
        (block, w["e_proj.weight"], w["h_proj.weight"], w["enorm.weight"], w["hnorm.weight"]),
    )
    mtp = eqx.tree_at(
        lambda m: (m.norm.weight, m.hc_head.fn, m.hc_head.base, m.hc_head.scale),
        mtp,
        (w["norm.weight"], w["hc_head.hc_fn"], w["hc_head.hc_base"], w["hc_head.hc_scale"]),
    )
    model = eqx.tree_at(
        lambda m: (m.mtp, m.embed.weight, m.head.weight),
        model,
        ((mtp,), w["embed.weight"], w["head.weight"]),
    )

    b, s = 2, 19
    streams = jax.random.normal(getkey(), (b, s, config.hc_mult, d))
    next_ids = jax.random.randint(getkey(), (b, s), 0, config.vocab_size)
    out = eqx.filter_jit(lambda m, x, i: m.mtp_logits(x, i))(model, streams, next_ids)

    rotary = hf.DeepseekV4RotaryEmbedding(mtp_cfg)
    ids_t = to_torch(next_ids).long()
    with torch.no_grad():
        e = ref["e_proj"](ref["enorm"](ref["embed"](ids_t)))
        x = e.unsqueeze(2) + ref["h_proj"](ref["hnorm"](to_torch(streams)))
        positions = torch.arange(s).expand(b, s)
        x = ref["block"](
            x,
            input_ids=ids_t,
            position_embeddings={
                label: rotary(x, positions, layer_type=label) for label in ("main", "compress")
            },
            position_ids=positions,
            attention_mask=window_mask(s, config.sliding_window, b),
        )
        expected = ref["head"](ref["norm"](ref["hc_head"](x)))
    np.testing.assert_allclose(out, to_numpy(expected), **COMPONENT)


def test_eager_entry_points_compile_once_per_shape():
    # Run op by op, a layer scan is compiled afresh on every call (and XLA:CPU's executables
    # pile up memory mappings until the process dies): the model's entry points are jitted.
    config = tiny_config(layer_types=(S, C, H), num_hash_layers=1)
    model = random_fill(abstract(ed.DeepseekV4, config), 0)
    ids = jnp.zeros((1, 9), jnp.int32)
    compiles = []

    def listener(event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(duration)

    jax.monitoring.register_event_duration_secs_listener(listener)

    def call_each():
        model.mtp_logits(model.streams(ids), ids)
        model(ids)

    try:
        call_each()
        first = len(compiles)
        call_each()
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert first <= 6, f"{first} programs compiled by one eager call of each"
    assert len(compiles) == first, "the second calls compiled again"


def test_bad_inputs_are_rejected():
    model = random_fill(abstract(ed.DeepseekV4, tiny_config()), 0)
    # Under the test suite's runtime type checker the annotations reject these first
    # (TypeError); without it the model's own check raises ValueError.
    for bad in (jnp.zeros((3,), jnp.int32), jnp.zeros((1, 3), jnp.float32)):
        with pytest.raises((ValueError, TypeError)):
            model(bad)
    with pytest.raises(ValueError, match="empty"):
        model(jnp.zeros((1, 0), jnp.int32))
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        abstract(ed.DeepseekV4, tiny_config(), dtype=jnp.float16)


def test_bfloat16_logits_close_to_float32():
    # bf16 is judged by relative-norm error against float32 on the same weights (an 8-bit
    # mantissa rules out elementwise 1e-5). Top-k choices are discontinuous, so a bf16
    # perturbation may flip an expert or an indexed block; this config routes by hash and keeps
    # every visible block, leaving only the rounding: here, under either policy, less than
    # transformers' own bf16 path gives on the same weights (random weights amplify rounding
    # with depth). Every kind of layer and both drivers: a layer of its own, then a scan.
    config = tiny_config(
        **{**FIVE_LAYERS, "num_hash_layers": 5},
        index_topk=16,
        num_nextn_predict_layers=0,
    )
    reference = reference_model(config, seed=4)
    ours = our_model(config, reference)
    bf16 = _cast(ours, ours.config, jnp.bfloat16)
    # A bf16 model keeps its attention sinks in float32 and gives float32 logits. (Learned
    # routing in bf16: `test_bf16_carried_layer_scan_matches_the_plain_scan`.)
    assert bf16.layers[0].blocks[0].attn.wq_a.weight.dtype == jnp.bfloat16
    assert bf16.layers[0].blocks[0].attn.attn_sink.dtype == jnp.float32
    ids = np.random.default_rng(1).integers(0, 97, (2, 37))
    # The float32 logits of the same weights: transformers', which ours match to 1e-4
    # (`test_logits_match_reference`), far below what is asked here; ours in float32 would
    # be one more program to compile.
    b = reference_logits(reference, ids)
    ids = jnp.asarray(ids, jnp.int32)
    # This machine's policy and the generic one (GPUs, TPUs: no XLA:CPU forms).
    for policy in (None, ed.execution.Policy.for_platform("tpu")):
        a = np.asarray(ed.execution.with_policy(bf16, policy)(ids))
        assert a.dtype == np.float32 and np.isfinite(a).all(), policy
        assert np.linalg.norm(a - b) / np.linalg.norm(b) < 5e-2, policy


def _cast(model, config, dtype):
    # `model`'s weights in a skeleton of `config` in `dtype`.
    skeleton = abstract(ed.DeepseekV4, config, dtype=dtype)
    leaves = [
        a.astype(s.dtype)
        for a, s in zip(jax.tree.leaves(model), jax.tree.leaves(skeleton), strict=True)
    ]
    return jax.tree.unflatten(jax.tree.structure(skeleton), leaves)


def test_bf16_carried_layer_scan_matches_the_plain_scan():
    # With 16-bit weights on XLA:CPU the layer scan carries its stacks and caches instead of
    # scanning over them (`Policy.carry_stacks`, `Route`). It must compute what the plain scan
    # computes: a chunk from the empty cache, then single tokens, through a layer on its own
    # and a scanned (CSA, HCA) period.
    config = tiny_config(
        **FIVE_LAYERS,
        num_nextn_predict_layers=0,
    )
    model = random_fill(abstract(ed.DeepseekV4, config, dtype=jnp.bfloat16), 3)
    assert [layer.repeats for layer in model.layers] == [1, 2]
    assert model.layers[1].blocks[0].attn.wq_a.weight.dtype == jnp.bfloat16
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 97, (2, 30)), jnp.int32)

    cpu = ed.execution.Policy.for_platform("cpu")
    assert cpu.carry_stacks
    carried = _chunk_then_steps(model, ids, cpu)
    swept = _chunk_then_steps(model, ids, dataclasses.replace(cpu, carry_stacks=False))
    # Its learned routers run in bf16 too: float32 logits, all finite.
    assert carried.dtype == jnp.float32 and np.isfinite(np.asarray(carried)).all()
    np.testing.assert_allclose(carried, swept, **SAME)


def _chunk_then_steps(model, ids, policy):
    # Logits of ids[:, :28] from the empty cache, then of tokens 28 and 29 one by one: two
    # programs per policy (the chunk's, the step's), each step as it runs in a decode loop.
    model = ed.execution.with_policy(model, policy)
    cache = model.init_cache(ids.shape[0], 32)
    logits, cache = model.decode(ids[:, :28], cache)
    steps = [logits]
    for t in (28, 29):
        logits, cache = model.decode(ids[:, t : t + 1], cache)
        steps.append(logits)
    return jnp.concatenate(steps, axis=1)


def test_every_policy_computes_the_same_model():
    # The generic policy (what GPUs and TPUs run: no XLA:CPU form) against this machine's,
    # both run here, float32: the full forward, and a prefill chunk then decode steps, on a
    # layer of its own and an unrolled stack of two (CSA, HCA) periods (late slices). The
    # late slices' gradient: `test_unrolled_stack_gradient_equals_the_scanned_one`; the
    # generic train step compiles for a TPU in `test_tpu.py`. (bfloat16:
    # `test_bfloat16_logits_close_to_float32`; the forms round differently, and a rounding can
    # flip a top-k choice.)
    model = random_fill(abstract(ed.DeepseekV4, POLICY_CONFIG), 5)
    assert [layer.repeats for layer in model.layers] == [1, 2]
    ids = jnp.asarray(POLICY_IDS)
    # The generic forms with `ragged_dot` experts: what a TPU or GPU policy is (none of the
    # XLA:CPU forms; the TPU's decode steps read the chosen experts through views).
    cpu, generic = ed.execution.Policy.for_platform("cpu"), ed.execution.Policy.for_platform("tpu")
    cpu_forms = [f.name for f in dataclasses.fields(cpu) if getattr(cpu, f.name) is True]
    assert cpu.late_slices and not any(getattr(generic, name) for name in cpu_forms)
    assert generic.experts_in_place
    tol = COMPONENT
    with_policy = ed.execution.with_policy
    np.testing.assert_allclose(
        with_policy(model, cpu)(ids), with_policy(model, generic)(ids), **tol
    )
    np.testing.assert_allclose(
        _chunk_then_steps(model, ids, cpu), _chunk_then_steps(model, ids, generic), **tol
    )


def test_bf16_decode_step_does_not_widen_the_layer_stack():
    # XLA:CPU computes bf16 in float32 and hoists the conversion of a loop-invariant operand
    # out of the loop: scanning over bf16 stacks converted all of them (and the CSA caches) to
    # float32 on every token (the small config's 43-layer step: 2.3 GiB of temporaries,
    # benchmarks/archive/NOTES.md, item 17). The step's temporaries must stay well below that.
    config = dataclasses.replace(flash_shaped_tiny(), moe_intermediate_size=64)
    model = abstract(ed.DeepseekV4, config, dtype=jnp.bfloat16)
    stack = model.layers[3]
    assert isinstance(stack, LayerStack) and stack.repeats == 20
    widened = sum(4 * a.size for a in jax.tree.leaves(stack))
    assert decode_temporaries(model) < widened / 4


def test_prefill_temporaries_do_not_grow_with_unrolled_layers():
    # XLA:CPU's scheduler creates a constant where the program starts, so loops whose carry
    # began as zeros (the attention's query steps, the expert loop, the dispatch's scatter) had
    # every layer's carry alive for the whole call: the small config's 2048-token prefill held
    # 381 MiB of temporaries, which malloc maps and faults in afresh on every call
    # (benchmarks/archive/NOTES.md, item 20). Here that was ~230 KB per layer, a third of the
    # 2-layer prefill's; a layer now adds about 20 KB.
    def temporaries(layers):
        config = tiny_config(
            layer_types=(ed.config.SLIDING,) * layers, num_hash_layers=0, scan_min_repeats=100
        )
        model = abstract(ed.DeepseekV4, config)
        ids = jax.ShapeDtypeStruct((1, 256), jnp.int32)  # 8 attention steps, an expert loop

        def prefill(model, ids):
            return model.decode(ids, model.init_cache(1, 256), last_only=True)[0]

        compiled = jax.jit(prefill).lower(model, ids).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    assert temporaries(6) < 1.3 * temporaries(2)


@pytest.mark.parametrize("kind", ["prefill", "decode"])
def test_unrolled_stack_takes_each_layer_when_it_runs(kind):
    # With `scan_layers=False` a stack's layers are slices of its stacked weights, which XLA
    # copies; taken as static slices, XLA:CPU's scheduler copied every layer's at the start of
    # the program, so the temporaries held the stack's weights once more (the small config's
    # 43-layer prefill: 2.3 GiB; benchmarks/archive/NOTES.md, item 21). Here, 6 layers against 2:
    # 1.6x (prefill) and 3.0x (decode) the temporaries that way; now 1.09x and 1.01x.
    def temporaries(layers):
        config = tiny_config(
            layer_types=(ed.config.SLIDING,) * layers,
            num_hash_layers=0,
            scan_min_repeats=2,
            scan_layers=False,
        )
        model = abstract(ed.DeepseekV4, config)
        stack = model.layers[0]
        # The Python loop over the stacked weights (the unrolled path).
        assert isinstance(stack, LayerStack) and stack.repeats == layers and not stack.scan
        ids = jax.ShapeDtypeStruct((1, 256 if kind == "prefill" else 1), jnp.int32)

        def run(model, ids):
            return model.decode(ids, model.init_cache(1, 256))[0]

        compiled = jax.jit(run).lower(model, ids).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    assert temporaries(6) < 1.3 * temporaries(2)


def test_profiles_read_by_component():
    model = abstract(ed.DeepseekV4, ed.Config.tiny())
    cache = eqx.filter_eval_shape(lambda m: m.init_cache(1, 64), model)
    ids = jax.ShapeDtypeStruct((1, 1), jnp.int32)
    lowered = jax.jit(lambda m, i, c: m.decode(i, c)).lower(model, ids, cache)
    names = set(re.findall(r'loc\("([^"]+)"', lowered.as_text(debug_info=True)))
    for scope in (
        "block/attention/",
        "block/attention/compressor/",
        "block/attention/indexer/",
        "block/attention/indexer/compressor/",
        "block/moe/",
    ):
        assert any(n.startswith(scope) for n in names), scope


def test_useful_flops_against_the_parameters_they_multiply():
    # One position: every weight matrix a token's forward reads is multiplied once (2 FLOPs per
    # entry), and attention sees one key per layer. Vectors (norms, mHC bases and scales,
    # sinks, router biases, compressors' position terms) are parameters but no products.
    config = tiny_config(num_nextn_predict_layers=0)
    h, k = config.num_attention_heads, config.head_dim
    attention = 2 * 2 * h * k * config.num_hidden_layers
    model = abstract(ed.DeepseekV4, config)
    vectors = sum(
        int(np.prod(leaf.shape))
        for path, leaf in jax.tree_util.tree_leaves_with_path(model)
        if re.search(r"norm|\.ape$|\.base$|\.scale$|sink|\.bias$", jax.tree_util.keystr(path))
    )
    expected = 2 * (ed.train.active_parameters(config) - vectors) + attention
    assert ed.train.forward_flops(config, 1) == expected
    # Every position's logits: the head once more per further position.
    t = 64
    head = 2 * config.hidden_size * (config.vocab_size + config.hc_mult**2)
    all_logits = ed.train.forward_flops(config, t, logits="all")
    assert all_logits - ed.train.forward_flops(config, t) == head * (t - 1)
    assert ed.train.train_flops(config, t) == 3 * all_logits
