"""LoRA / QLoRA: fresh adapters change nothing (float32, bf16, FP8/FP4 bases), adapted products
and their adapter gradients against autograd through the merged weights (every routed-expert
form, one device and fsdp x expert), training that leaves the base bit-identical, no cotangent
of a frozen expert stack in the backward pass, and PEFT round trips with transformers."""

import json
import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from helpers import (
    COMPONENT,
    LOGITS,
    adapted_weights,
    assert_close,
    equations,
    lowered,
    random_adapters,
    run_python,
)
from hf_reference import C, H, S, abstract, our_model, random_fill, reference_model, tiny_config

import equinox_dsv4 as ed
from equinox_dsv4.execution import Policy, routed_experts
from equinox_dsv4.quant import FP4, LoraWeight, quantize


L = LoraWeight


def _is_lora(x):
    return isinstance(x, L)


@pytest.fixture(scope="module")
def small():
    config = tiny_config(layer_types=(S, C, H), num_hash_layers=1)
    return config, random_fill(abstract(ed.DeepseekV4, config), seed=3)


IDS = np.random.default_rng(0).integers(0, 97, (2, 12)).astype(np.int32)


@eqx.filter_jit
def _logits(model, ids):
    return model(ids)


@pytest.mark.parametrize("base", ["float32", "bfloat16", "fp8/fp4"])
def test_fresh_adapters_change_nothing(small, base):
    config, model = small
    if base == "bfloat16":
        model = random_fill(abstract(ed.DeepseekV4, config, dtype=jnp.bfloat16), seed=3)
    elif base == "fp8/fp4":
        model = ed.quant.quantize_model(model)
    adapted = ed.lora.add(model, rank=4, alpha=8.0, key=jax.random.key(1))
    n = len(adapted_weights(adapted))
    assert n == 3 * 11 + 11  # every default target of the three layers and the MTP block
    expected = _logits(model, IDS)
    got = _logits(adapted, IDS)
    assert got.dtype == expected.dtype
    assert np.array_equal(np.asarray(got), np.asarray(expected))


def test_adding_adapters_is_one_program(small):
    # Every factor in one program, kept: not a few small programs per weight shape (rank 7:
    # shapes no other test makes), and none but the key split the second time.
    _, model = small
    start = len(lowered())
    first = ed.lora.add(model, rank=7, key=jax.random.key(1))
    assert len(lowered()) - start <= 2, lowered()[start:]  # the key split, the factors
    start = len(lowered())
    again = ed.lora.add(model, rank=7, key=jax.random.key(1))
    assert len(lowered()) - start == 0, lowered()[start:]
    for a, b in zip(adapted_weights(first), adapted_weights(again), strict=True):
        assert a.a.shape[-2] == 7 and np.array_equal(a.a, b.a) and not np.any(b.b)
    # On a mesh: one program placing every factor beside its weight, kept too.
    sharded = ed.shard(model, ed.make_mesh(fsdp=4, expert=2))
    start = len(lowered())
    placed = ed.lora.add(sharded, rank=7, key=jax.random.key(1))
    assert len(lowered()) - start <= 1, lowered()[start:]
    ed.lora.add(sharded, rank=7, key=jax.random.key(1))
    assert len(lowered()) - start <= 1, lowered()[start:]
    for a, b in zip(adapted_weights(first), adapted_weights(placed), strict=True):
        assert np.array_equal(a.a, b.a)
        a_spec, b_spec = ed.quant.factor_specs(b.base.sharding.spec, b.base.ndim)
        assert b.a.sharding.spec == a_spec and b.b.sharding.spec == b_spec


def test_adapted_model_equals_merged(small):
    _, model = small
    adapted = random_adapters(ed.lora.add(model, rank=4, alpha=8.0, key=jax.random.key(1)), 2)
    merged = ed.lora.merge(adapted)
    assert not ed.lora.has_adapters(merged)
    got, want = _logits(adapted, IDS), _logits(merged, IDS)
    assert float(jnp.max(jnp.abs(got - _logits(model, IDS)))) > 0.1  # the adapters matter
    assert_close(got, want, COMPONENT)


def _objective(m):
    y = m(jnp.asarray(IDS))
    return jnp.sum(y * jnp.cos(y))


@eqx.filter_jit
def _factor_grads(adapted):
    params, frozen = eqx.partition(adapted, ed.train.trainable(adapted))
    return jax.grad(lambda p: _objective(eqx.combine(p, frozen)))(params)


@pytest.fixture(scope="module")
def one_device_grads(small):
    """The adapted model below and its adapters' gradients on one device, computed once for
    both cases of the next test (the chain rule's, and the mesh's reference)."""
    _, model = small
    adapted = random_adapters(ed.lora.add(model, rank=3, alpha=6.0, key=jax.random.key(5)), 8)
    return adapted, adapted_weights(_factor_grads(adapted))


@pytest.mark.parametrize("mesh", [None, "fsdp2-expert2"])
def test_adapter_gradients_equal_autograd_of_merged(one_device_grads, mesh):
    # Every target (attention, shared and routed experts, the MTP block): the adapters'
    # gradients against the chain rule through autograd of the merged weights, on one
    # device; sharded on fsdp x expert, the outputs and gradients equal one device's.
    adapted, got = one_device_grads
    if mesh is None:

        def where(m):
            return adapted_weights(m)

        @jax.jit
        def merged_grads(ws):
            return jax.grad(lambda ws: _objective(eqx.tree_at(where, adapted, ws)))(ws)

        weights = adapted_weights(adapted)
        grads = merged_grads([w.merged(jnp.float32) for w in weights])
        for g, w, gw in zip(got, weights, grads, strict=True):
            want_a = w.scale * jnp.einsum("...or,...oi->...ri", w.b, gw)
            want_b = w.scale * jnp.einsum("...oi,...ri->...or", gw, w.a)
            # Relative to each gradient's norm: through three layers and the MTP block the
            # two association orders' float32 roundings grow past 1e-5 elementwise (each
            # product alone is held to 1e-5 in the component tests here).
            _close_in_norm(g.a, want_a)
            _close_in_norm(g.b, want_b)
        return
    mesh = ed.make_mesh(fsdp=4, expert=2)
    sharded = ed.shard(adapted, mesh)
    with jax.set_mesh(mesh):
        on_mesh = adapted_weights(_factor_grads(sharded))
    for g, h in zip(got, on_mesh, strict=True):
        _close_in_norm(h.a, g.a)
        _close_in_norm(h.b, g.b)


def _close_in_norm(actual, expected, tol: float = 1e-5):
    err, norm = float(jnp.linalg.norm(actual - expected)), float(jnp.linalg.norm(expected))
    assert err <= tol * norm, (err, norm)


def _expert_case(fmt=None, d=32, inter=24, e=8, tokens=40, rank=4):
    rng = np.random.default_rng(7)

    def w(shape):
        return jnp.asarray(rng.standard_normal(shape) / np.sqrt(shape[-1]), jnp.float32)

    weights = []
    for shape in ((e, inter, d), (e, d, inter), (e, inter, d)):
        b = w(shape) if fmt is None else quantize(w(shape), fmt)
        a = w((e, rank, shape[-1]))
        up = w((e, shape[-2], rank)) * 0.5
        weights.append(L(b, a, up, 2.0))
    x = w((tokens, d))
    ids = jnp.asarray(np.stack([rng.permutation(e)[:2] for _ in range(tokens)]), jnp.int32)
    route = jnp.asarray(rng.uniform(0.1, 1.0, (tokens, 2)), jnp.float32)
    return weights, x, ids, route


def _merged_grads(loss_of, weights):
    # The adapters' gradients by the chain rule through autograd of the merged weights:
    # d/dA = s B^T G, d/dB = s G A^T for G the gradient of the merged weight.
    merged = [w.merged(jnp.float32) for w in weights]
    gs = jax.grad(loss_of)(merged)
    return [
        (
            w.scale * jnp.einsum("...or,...oi->...ri", w.b, g),
            w.scale * jnp.einsum("...oi,...ri->...or", g, w.a),
        )
        for w, g in zip(weights, gs, strict=True)
    ]


@pytest.mark.parametrize("form", ["loop", "ragged", "one_by_one", "gathered", "loop-fp4"])
def test_routed_expert_adapters_equal_merged(form):
    weights, x, ids, route = _expert_case(FP4 if form.endswith("fp4") else None)
    policy = Policy("cpu", experts="ragged" if form == "ragged" else "loop")
    if form in ("one_by_one", "gathered"):  # decoding: fewer assignments than experts
        x, ids, route = x[:2], ids[:2], route[:2]
        policy = Policy("cpu", gather_experts=form == "gathered")

    def run(ws):
        return routed_experts(x, ids, route, *ws, 10.0, "exact", policy)

    def loss_of(ws):
        y = run(ws)
        return jnp.sum(y * jnp.cos(y))

    def adapted_loss(factors):
        ws = [L(w.base, a, b, w.scale) for w, (a, b) in zip(weights, factors, strict=True)]
        return loss_of(ws)

    merged = [w.merged(jnp.float32) for w in weights]
    assert_close(jax.jit(run)(weights), jax.jit(run)(merged))
    factors = [(w.a, w.b) for w in weights]
    got = jax.jit(jax.grad(adapted_loss))(factors)
    want = _merged_grads(loss_of, weights)
    for (ga, gb), (wa, wb) in zip(got, want, strict=True):
        assert_close(ga, wa)
        assert_close(gb, wb)


def _dots(jaxpr):
    # Output shapes of every dot_general in a jaxpr and the jaxprs inside it.
    return [
        tuple(e.outvars[0].aval.shape)
        for e in equations(jaxpr)
        if e.primitive.name == "dot_general"
    ]


def test_no_cotangent_of_frozen_expert_stacks():
    # The backward pass of the expert loop with adapters computes no product shaped like an
    # expert's weight ([inter, d_model] or [d_model, inter]): the frozen stacks get no
    # cotangent. Differentiating the stacks themselves does compute them (the check can fail).
    weights, x, ids, route = _expert_case(inter=24, d=32)
    policy = Policy("cpu")

    def loss(ws):
        return jnp.sum(routed_experts(x, ids, route, *ws, 10.0, "exact", policy))

    def adapters_only(factors):
        return loss([L(w.base, a, b, w.scale) for w, (a, b) in zip(weights, factors, strict=True)])

    def stacks_too(bases):
        return loss([L(b, w.a, w.b, w.scale) for w, b in zip(weights, bases, strict=True)])

    expert_shaped = {(24, 32), (32, 24)}
    lora = _dots(jax.make_jaxpr(jax.grad(adapters_only))([(w.a, w.b) for w in weights]).jaxpr)
    full = _dots(jax.make_jaxpr(jax.grad(stacks_too))([w.base for w in weights]).jaxpr)
    assert not expert_shaped & set(lora)
    assert expert_shaped <= set(full)


def test_training_changes_only_the_adapters():
    # On the embedded default (its first layer and MTP block): a float32 base and the FP8/FP4 one.
    config = ed.Config.tiny().first_layers(1)
    # Its own initialisation in one program (eagerly, each weight's shape compiles its own).
    model = eqx.filter_jit(lambda key: ed.DeepseekV4(config, key=key))(jax.random.key(0))
    rng = np.random.default_rng(4)
    batch = ed.Batch.from_tokens(rng.integers(0, config.vocab_size, (2, 17)).astype(np.int32))
    opt = ed.make_optimizer(1e-2, warmup_steps=0, total_steps=20)
    step = ed.make_train_step(opt, donate=False)
    for base in ("float32", "fp8/fp4"):
        start = ed.quant.quantize_model(model) if base == "fp8/fp4" else model
        adapted = ed.lora.add(start, rank=4, key=jax.random.key(2))
        state = ed.init_train_state(adapted, opt)
        # The optimizer state holds adapter-sized leaves only (Adam's two moments).
        moments = sum(x.size for x in jax.tree.leaves(eqx.filter(state.opt_state, eqx.is_array)))
        factors = sum(w.a.size + w.b.size for w in adapted_weights(adapted))
        assert factors < moments <= 2 * factors + 16
        losses, after = [], state
        for _ in range(4):
            after, metrics = step(after, batch)
            losses.append(float(metrics["loss"]))
        assert losses[-1] < losses[0], losses
        base_before = jax.tree.leaves(ed.lora.base(state.model))
        base_after = jax.tree.leaves(ed.lora.base(after.model))
        assert all(np.array_equal(a, b) for a, b in zip(base_before, base_after, strict=True))
        pairs = zip(adapted_weights(state.model), adapted_weights(after.model), strict=True)
        assert all(not np.array_equal(w0.b, w1.b) for w0, w1 in pairs)
        if base == "fp8/fp4":
            kept = adapted_weights(after.model)
            assert all(isinstance(w.base, ed.quant.QuantizedWeight) for w in kept)
            assert ed.quant.weight_bytes(ed.lora.base(after.model)) == ed.quant.weight_bytes(start)


def test_trainable_overrides_the_adapters_only_default(small):
    # `trainable=` picks what trains: here the adapters and the norms; the step and the state
    # take the same filter, the norms change, the other base weights do not.
    _, model = small
    adapted = ed.lora.add(model, rank=2, key=jax.random.key(7))

    def adapters_and_norms(m):
        def visit(path, leaf):
            if isinstance(leaf, L):
                return L(jax.tree.map(lambda _: False, leaf.base), True, True, leaf.scale)
            return jax.tree_util.keystr(path).endswith("norm.weight")

        return jax.tree_util.tree_map_with_path(visit, m, is_leaf=_is_lora)

    opt = ed.make_optimizer(1e-2, warmup_steps=0, total_steps=10)
    state = ed.init_train_state(adapted, opt, trainable=adapters_and_norms)
    # Without remat: what trains does not depend on it, and the step compiles faster (steps
    # with it: test_training_changes_only_the_adapters).
    step = ed.make_train_step(opt, trainable=adapters_and_norms, donate=False, remat=None)
    batch = ed.Batch.from_tokens(np.random.default_rng(5).integers(0, 97, (2, 13)).astype(np.int32))
    after, _ = step(state, batch)
    before = jax.tree_util.tree_flatten_with_path(ed.lora.base(state.model))[0]
    now = jax.tree.leaves(ed.lora.base(after.model))
    changed = {
        jax.tree_util.keystr(p)
        for (p, a), b in zip(before, now, strict=True)
        if not np.array_equal(a, b)
    }
    assert changed and all(name.endswith("norm.weight") for name in changed), sorted(changed)


def test_quantized_lora_step_has_no_frozen_cotangents():
    # The train step of a QLoRA model (FP8/FP4 base): no product in its program has the shape
    # of a routed expert's weight (256 x 32 or 32 x 256 here: its cotangent), which the full
    # fine-tune of the same model computes; and with the state donated, as a step runs, its
    # temporaries are below that one's (experts hold most of the weights, as in V4).
    config = tiny_config(
        layer_types=(S, C),
        num_hash_layers=1,
        moe_intermediate_size=256,
        n_routed_experts=16,
        num_nextn_predict_layers=0,
    )
    model = random_fill(abstract(ed.DeepseekV4, config), seed=3, n_experts=16)
    opt = ed.make_optimizer(1e-3, warmup_steps=0, total_steps=10)
    step = ed.make_train_step(opt)
    rng = np.random.default_rng(9)
    batch = ed.Batch.from_tokens(rng.integers(0, 97, (2, 13)).astype(np.int32))
    qlora = ed.lora.add(ed.quant.quantize_model(model), rank=4, key=jax.random.key(6))
    lowered = {
        "qlora": step.lower(ed.init_train_state(qlora, opt), batch),
        "full": step.lower(ed.init_train_state(model, opt), batch),
    }
    shape = re.compile(r"stablehlo\.dot_general.*-> tensor<(256x32|32x256)xf32>")
    found = {k: len(shape.findall(v.as_text())) for k, v in lowered.items()}
    assert found["qlora"] == 0 and found["full"] > 0, found
    temporaries = {k: v.compile().memory_analysis().temp_size_in_bytes for k, v in lowered.items()}
    assert temporaries["qlora"] < temporaries["full"], temporaries


# PEFT's LoRA layer cannot wrap transformers' grouped `o_a_proj`: every other target.
PEFT_TARGETS = [t for t in ed.lora.DEFAULT_TARGETS if t != "wo_a"]


def test_adapter_trained_here_loads_into_peft(tmp_path):
    peft = pytest.importorskip("peft")
    config = tiny_config(layer_types=(S, C, H), num_hash_layers=1)
    reference = reference_model(config, seed=11)
    ours = our_model(config, reference)
    adapted = random_adapters(
        ed.lora.add(ours, rank=3, alpha=6.0, targets=PEFT_TARGETS, key=jax.random.key(3)), 5
    )
    ids = IDS[:1]
    assert float(jnp.max(jnp.abs(_logits(adapted, ids) - _logits(ours, ids)))) > 0.05
    ed.lora.save(adapted, tmp_path / "adapter", peft_only=True)
    with_peft = peft.PeftModel.from_pretrained(reference, tmp_path / "adapter").eval()
    with torch.no_grad():
        want = with_peft(
            torch.tensor(ids, dtype=torch.long),
            attention_mask=torch.ones(ids.shape, dtype=torch.long),
        ).logits.numpy()
    assert_close(_logits(adapted, ids), want, LOGITS)


def test_adapter_made_with_peft_loads_here(tmp_path):
    peft = pytest.importorskip("peft")
    config = tiny_config(layer_types=(S, C, H), num_hash_layers=1)
    reference = reference_model(config, seed=12)
    ours = our_model(config, reference)
    ids = IDS[:1]
    mask = torch.ones(ids.shape, dtype=torch.long)
    with torch.no_grad():
        plain = reference(torch.tensor(ids, dtype=torch.long), attention_mask=mask).logits.numpy()
    lora_config = peft.LoraConfig(
        r=2,
        lora_alpha=5,
        target_modules=[
            f"model.layers.{i}.self_attn.{m}"
            for i in range(3)
            for m in ("q_a_proj", "kv_proj", "o_b_proj")
        ]
        + ["model.layers.1.mlp.shared_experts.down_proj"],
        # By suffix (every layer's, as PEFT's docs write it) and in full (one layer's, where
        # its wrapper nests around gate_up_proj's).
        target_parameters=["mlp.experts.gate_up_proj", "model.layers.2.mlp.experts.down_proj"],
        init_lora_weights=False,  # random B: the adapter changes the logits
    )
    with_peft = peft.get_peft_model(reference, lora_config).eval()
    with_peft.save_pretrained(tmp_path / "adapter")
    loaded = ed.lora.load(ours, tmp_path / "adapter")
    with torch.no_grad():
        want = with_peft(torch.tensor(ids, dtype=torch.long), attention_mask=mask).logits.numpy()
    assert np.abs(want - plain).max() > 0.05  # the adapter matters
    assert_close(_logits(loaded, ids), want, LOGITS)


def test_save_and_load_keep_every_adapter(small, tmp_path):
    # Our own round trip, adapters PEFT has no form for (wo_a, the MTP block) included.
    _, model = small
    adapted = random_adapters(ed.lora.add(model, rank=2, alpha=3.0, key=jax.random.key(4)), 6)
    ed.lora.save(adapted, tmp_path / "a")
    config = json.loads((tmp_path / "a" / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA"
    assert (tmp_path / "a" / "equinox_dsv4_adapter.safetensors").is_file()
    loaded = ed.lora.load(model, tmp_path / "a")
    want, got = adapted_weights(adapted), adapted_weights(loaded)
    assert len(got) == len(want)
    # The same updates; the routed experts' w1/w3 come back through transformers' packed
    # gate_up form (a shared A of twice the rank, the scale folded into B).
    for g, w in zip(got, want, strict=True):
        assert_close(g.merged(), w.merged())
    with pytest.raises(ValueError, match="wo_a"):
        ed.lora.save(adapted, tmp_path / "b", peft_only=True)
    assert not (tmp_path / "b").exists()


def test_clear_errors(small, tmp_path):
    _, model = small
    with pytest.raises(ValueError, match="unknown target"):
        ed.lora.add(model, rank=2, targets=["wq_a", "indexer"], key=jax.random.key(0))
    with pytest.raises(ValueError, match="rank"):
        ed.lora.add(model, rank=0, key=jax.random.key(0))
    adapted = ed.lora.add(model, rank=2, key=jax.random.key(0))
    with pytest.raises(ValueError, match="already has adapters"):
        ed.lora.add(adapted, rank=2, key=jax.random.key(0))
    with pytest.raises(ValueError, match="no adapters"):
        ed.lora.save(model, tmp_path / "none")
    with pytest.raises(ValueError, match="ed.lora.save"):  # a whole-model save would mix them in
        ed.save(tmp_path / "model", adapted)
    assert not (tmp_path / "model").exists()
    # A merged QLoRA model holds its adapted weights dense beside FP8/FP4 ones, which a saved
    # model cannot be read back as: refused at the save, naming the first.
    merged = ed.lora.merge(
        ed.lora.add(ed.quant.quantize_model(model), rank=2, key=jax.random.key(0))
    )
    with pytest.raises(ValueError, match=r"attn\.wq_a\.weight is dense"):
        ed.save(tmp_path / "merged", merged)
    assert not (tmp_path / "merged").exists()
    ed.lora.save(adapted, tmp_path / "dora")
    path = tmp_path / "dora" / "adapter_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "use_dora": True}))
    with pytest.raises(ValueError, match="use_dora"):
        ed.lora.load(model, tmp_path / "dora")


# The TPUs' forms for many assignments: `ragged_dot` in rounds, the tokens travelling to the
# weights' hidden units (`Policy.experts_stay`).
STAY = Policy("tpu", experts="ragged", expert_buffer=1, experts_stay=True)


@pytest.mark.parametrize(
    "fmt, d_model, inter, tokens, policy",
    # Many assignments on dense weights split along d_model (the weights gathered), or along
    # their hidden units in rounds (the tokens travel); few on the release's FP4 experts split
    # along their hidden units (the tokens travel).
    [(None, 32, 6, 64, None), (None, 32, 64, 64, STAY), (FP4, 128, 128, 4, None)],
)
def test_routed_expert_adapters_on_a_mesh(fmt, d_model, inter, tokens, policy):
    weights, x, ids, route = _expert_case(fmt, d=d_model, inter=inter, tokens=tokens)
    experts = eqx.filter_eval_shape(
        ed.nn.Experts,
        tiny_config(hidden_size=d_model, moe_intermediate_size=inter),
        key=jax.random.key(0),
    )
    experts = eqx.tree_at(lambda e: (e.w1, e.w2, e.w3), experts, tuple(weights))
    experts = ed.execution.with_policy(experts, policy)

    @eqx.filter_jit
    def value_and_grad(experts):
        params, frozen = eqx.partition(experts, ed.quant.factors_only(experts))

        def loss(params):
            y = eqx.combine(params, frozen)(x, ids, route)
            return jnp.sum(y * jnp.cos(y)), y

        return jax.value_and_grad(loss, has_aux=True)(params)

    (_, y1), g1 = value_and_grad(experts)
    mesh = ed.make_mesh(fsdp=4, expert=2)
    sharded = ed.shard(experts, mesh)
    assert sharded.w1.a.sharding.spec[0] == "expert"
    with jax.set_mesh(mesh):
        (_, y2), g2 = value_and_grad(sharded)
        jaxpr = str(jax.make_jaxpr(value_and_grad)(sharded))
    travels = policy is STAY or fmt is not None
    assert ("all_to_all" in jaxpr) == travels  # the tokens' way back to their devices
    assert_close(y2, y1)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2), strict=True):
        assert_close(b, a)


def test_example_lora_options_are_checked():
    # The script trains with adapters in tests/test_train.py::test_example_train_script
    # (through its `main`); here it runs as a process, as users start it.
    refused = run_python("examples/train.py", "--lora-alpha", "8", "--steps", "1")
    assert refused.returncode != 0 and "need --lora RANK" in refused.stderr
