"""Training: gradients against torch autograd through transformers, the loss terms worked out by
hand, load balancing, overfitting a fixed text, bit-exact resume, remat memory, a data x fsdp x
expert step against one device (FSDP across processes: tests/test_multihost.py)."""

import types

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
from helpers import ROOT, lowered, run_main, succeeded
from hf_reference import (
    FIVE_LAYERS,
    C,
    H,
    S,
    abstract,
    our_model,
    random_fill,
    reference_model,
    tiny_config,
)

import equinox_dsv4 as ed
from convert import fill, hf_to_canonical


def _grads_like(skeleton: ed.DeepseekV4, reference: torch.nn.Module) -> ed.DeepseekV4:
    """transformers' gradients laid out as our model (buffers keep their values; parameters
    autograd never reached, e.g. the indexer behind its top-k, count as zero)."""
    params = dict(reference.named_parameters())

    def tensors():
        for key, tensor in reference.state_dict().items():
            if key in params:
                grad = params[key].grad
                tensor = torch.zeros_like(tensor) if grad is None else grad
            for name, transform in hf_to_canonical(key):
                yield name, transform(tensor.detach().numpy())

    return fill(skeleton, tensors())


def test_gradients_match_torch_autograd():
    # Every kind of layer and both drivers: a sliding hash-routed layer, then a scan of two
    # (CSA, HCA) periods with learned routing; 8 index heads.
    config = _small(num_nextn_predict_layers=0)
    reference = reference_model(config, seed=11)
    ids = np.random.default_rng(11).integers(0, config.vocab_size, (2, 38))
    inputs, labels = torch.from_numpy(ids[:, :-1]), torch.from_numpy(ids[:, 1:])
    logits = reference(input_ids=inputs, attention_mask=torch.ones_like(inputs)).logits
    loss = torch.nn.functional.cross_entropy(
        logits.reshape(-1, config.vocab_size), labels.reshape(-1)
    )
    loss.backward()

    model = our_model(config, reference)
    expected = _grads_like(eqx.filter_eval_shape(lambda: model), reference)
    params, frozen = eqx.partition(model, ed.train.trainable(model))
    batch = ed.Batch.from_tokens(jnp.asarray(ids, jnp.int32))

    @eqx.filter_jit
    def value_and_grad(params):
        return jax.value_and_grad(
            lambda p: ed.train.loss_and_stats(eqx.combine(p, frozen), batch)[0]
        )(params)

    value, grads = value_and_grad(params)
    np.testing.assert_allclose(value, loss.item(), rtol=1e-6)
    got = jax.tree_util.tree_flatten_with_path(grads)[0]
    want = dict(jax.tree_util.tree_flatten_with_path(expected)[0])
    assert len(got) == len(jax.tree.leaves(params)) > 80
    total = float(np.sqrt(sum(np.sum(np.square(np.asarray(w, np.float64))) for w in want.values())))
    bad, nonzero = [], 0
    for path, g in got:
        g, w = np.asarray(g, np.float64), np.asarray(want[path], np.float64)
        norm = float(np.linalg.norm(w))
        err = float(np.linalg.norm(g - w))
        if norm == 0:
            # Autograd never reached it (the indexer, behind its top-k): neither may we.
            if np.any(g != 0):
                bad.append((jax.tree_util.keystr(path), err, norm))
            continue
        nonzero += 1
        # 1e-4 of the leaf's gradient norm, floored at 1e-7 of the whole gradient's: a leaf
        # whose gradient nearly cancels (hc_head.scale's can) keeps the float32 rounding of its
        # terms.
        if err > 1e-4 * max(norm, 1e-3 * total):
            bad.append((jax.tree_util.keystr(path), err, norm))
    assert not bad, bad
    assert nonzero > 0.8 * len(got)


def test_loss_terms_worked_out_by_hand():
    config = tiny_config(layer_types=(S, C, H), num_hash_layers=1)
    model = random_fill(abstract(ed.DeepseekV4, config), seed=5)
    rng = np.random.default_rng(5)
    tokens = rng.integers(0, config.vocab_size, (2, 14)).astype(np.int32)
    mask = np.ones_like(tokens, np.float32)
    mask[1, 10:] = 0  # padding at the end of row 1
    batch = ed.Batch.from_tokens(tokens, mask)
    loss, aux = eqx.filter_jit(
        lambda m, b: ed.train.loss_and_stats(m, b, mtp_weight=0.5, balance_weight=0.01)
    )(model, batch)

    def ce(logits, targets, m):
        logits = np.asarray(logits, np.float64)
        z = logits.max(-1, keepdims=True)
        lse = np.log(np.exp(logits - z).sum(-1)) + z[..., 0]
        nll = lse - np.take_along_axis(logits, targets[..., None], -1)[..., 0]
        return (nll * m).sum() / m.sum()

    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    lm_mask = mask[:, :-1] * mask[:, 1:]

    # The model's logits and MTP logits in one program (eagerly, each operation compiles alone).
    @eqx.filter_jit
    def forward(model, inputs, labels):
        streams = model.streams(inputs)
        return model.logits(streams), model.mtp_logits(streams, labels)

    logits, mtp_logits = forward(model, jnp.asarray(inputs), jnp.asarray(labels))
    lm = ce(logits, labels, lm_mask)
    # MTP: position t reads token t + 1 and predicts token t + 2.
    mtp = ce(np.asarray(mtp_logits)[:, :-1], labels[:, 1:], lm_mask[:, :-1] * lm_mask[:, 1:])
    # Per segment, per period position, stacked along the repeats.
    balance = float(sum(float(jnp.sum(s.balance)) for seg in aux["stats"] for s in seg))
    np.testing.assert_allclose(aux["lm"], lm, rtol=1e-5)
    np.testing.assert_allclose(aux["mtp"], mtp, rtol=1e-5)
    assert aux["tokens"] == lm_mask.sum() == 13 + 9
    np.testing.assert_allclose(loss, lm + 0.5 * mtp + 0.01 * balance, rtol=1e-5)
    assert float(aux["stats"][0][0].balance[0]) == 0.0  # the hash-routed layer


def test_balance_statistics_worked_out_by_hand():
    config = tiny_config(layer_types=(C,), num_hash_layers=0)
    moe = random_fill(abstract(ed.nn.MoE, config, ed.config.MOE), seed=2)
    b, s, e, k = 2, 6, config.n_routed_experts, config.num_experts_per_tok
    x = jnp.asarray(np.random.default_rng(2).normal(size=(b, s, config.hidden_size)), jnp.float32)
    # One program (eagerly, each operation of the layer compiles alone).
    _, stats = eqx.filter_jit(lambda m, x, ids: m.with_stats(x, ids))(
        moe, x, jnp.zeros((b, s), jnp.int32)
    )
    logits = np.asarray(x, np.float64) @ np.asarray(moe.gate.weight, np.float64).T
    scores = np.sqrt(np.log1p(np.exp(logits)))  # sqrtsoftplus
    chosen = np.argsort(-(scores + np.asarray(moe.gate.bias)), axis=-1)[..., :k]
    counts = np.zeros((b, e))
    for i in range(b):
        np.add.at(counts[i], chosen[i].reshape(-1), 1)
    f = counts * e / (k * s)
    p = (scores / scores.sum(-1, keepdims=True)).mean(1)
    np.testing.assert_allclose(stats.load, counts.sum(0))
    np.testing.assert_allclose(stats.balance, (f * p).sum(-1).mean(), rtol=1e-5)


def _small(**overrides) -> ed.Config:
    return tiny_config(**{**FIVE_LAYERS, "num_nextn_predict_layers": 1, **overrides})


RATE = 0.25


@pytest.fixture(scope="module")
def one_pass():
    """One step on one device, compiled once for three tests: the micro-batch test's reference,
    the bias-update test, and the resume test (which runs it ten times). Eight sequences of 20
    targets, padding unevenly spread (rows 1, 4 and 6). SGD with momentum: a first step's
    update is the gradient itself (Adam's first step, g / |g|, would magnify float32
    summation-order noise in near-zero gradient entries into full-size updates), and the state
    still carries what a resume must restore (the momentum, like Adam's moments, and the
    schedule's step count). Without remat: none of the three depends on it, and the step
    compiles faster (remat's own test: `test_remat_lowers_train_step_temporaries`; steps with
    it run in tests/test_lora.py::test_training_changes_only_the_adapters)."""
    config = _small(num_attention_heads=8, o_groups=4)
    model = random_fill(abstract(ed.DeepseekV4, config), seed=8)
    opt = optax.sgd(optax.constant_schedule(0.5), momentum=0.9)
    rng = np.random.default_rng(8)
    tokens = rng.integers(0, 97, (8, 21))
    mask = np.ones((8, 21), np.float32)
    mask[1, 9:] = mask[4, 15:] = mask[6, 3:] = 0.0
    batch = ed.Batch.from_tokens(tokens, mask)
    state = ed.init_train_state(model, opt)
    step = ed.make_train_step(opt, bias_update_rate=RATE, donate=False, remat=None)
    new, metrics = step(state, batch)
    return types.SimpleNamespace(
        config=config,
        model=model,
        opt=opt,
        step=step,
        batch=batch,
        state=state,
        new=new,
        metrics=metrics,
    )


def test_bias_update_and_frozen_leaves(one_pass):
    config, model = one_pass.config, one_pass.model
    state, new, metrics = one_pass.state, one_pass.new, one_pass.metrics
    rate = RATE
    # Plan: layer 0 (sliding, hash-routed), then a scan of two (CSA, HCA) pairs.
    old_stack, new_stack = state.model.layers[1], new.model.layers[1]
    for p, block in enumerate(old_stack.blocks):
        load = np.asarray(metrics["load"][1 + p])  # per repeat of this period position
        # Every position of the 8 x 20 is routed (padding too), to two experts each.
        assert load.shape == (2, config.n_routed_experts) and np.all(load.sum(-1) == 8 * 20 * 2)
        want = block.ffn.gate.bias + rate * np.sign(load.mean(-1, keepdims=True) - load)
        np.testing.assert_allclose(new_stack.blocks[p].ffn.gate.bias, want, rtol=1e-6)
    hashed = state.model.layers[0].blocks[0].ffn.gate
    assert hashed.bias is None
    np.testing.assert_array_equal(new.model.layers[0].blocks[0].ffn.gate.tid2eid, hashed.tid2eid)
    # The MTP block's router is balanced too; its weights train.
    assert not np.array_equal(
        new.model.mtp[0].block.ffn.gate.bias, model.mtp[0].block.ffn.gate.bias
    )
    assert not np.array_equal(
        new.model.layers[0].blocks[0].attn.wq_a.weight, model.layers[0].blocks[0].attn.wq_a.weight
    )
    assert int(new.step) == 1 and np.isfinite(float(metrics["loss"]))
    spec = ed.train.trainable(model)
    gate = spec.layers[1].blocks[0].ffn.gate
    assert (
        gate.bias is False
        and gate.weight is True
        and spec.layers[0].blocks[0].ffn.gate.tid2eid is False
    )


def test_overfits_a_fixed_text():
    """Tiny model, a fixed 1024-token text (the real tokenizer; ids renumbered densely so the
    head is small), full batch: the loss goes below 0.5 nats within 150 steps."""
    text = (ROOT / "tests" / "data" / "overfit.txt").read_text()
    ids = ed.encode_text(text)[:1025]
    assert len(ids) == 1025
    vocab = {t: i for i, t in enumerate(sorted(set(ids)))}
    dense = np.array([vocab[t] for t in ids], np.int32)
    rows = np.stack([dense[i * 256 : i * 256 + 257] for i in range(4)])  # 4 x 256 targets
    config = _small(
        vocab_size=len(vocab),
        hidden_size=64,
        num_nextn_predict_layers=0,
        max_position_embeddings=512,
        rope_scaling=None,
    )
    # The model's own initialisation (the loss starts at its scale), in one program: eagerly,
    # each weight's shape would compile kernels of its own.
    model = eqx.filter_jit(lambda key: ed.DeepseekV4(config, key=key))(jax.random.key(0))
    opt = ed.make_optimizer(1e-2, warmup_steps=10, total_steps=150, weight_decay=0.0)
    state = ed.init_train_state(model, opt)
    step = ed.make_train_step(opt, balance_weight=0.0, remat=None)
    batch = ed.Batch.from_tokens(rows)
    losses = []
    for _ in range(150):
        state, metrics = step(state, batch)
        losses.append(float(metrics["lm"]))
        if losses[-1] < 0.5:
            break
    assert losses[0] > 5.0 and losses[-1] < 0.5, losses[::10] + losses[-1:]


def test_resume_is_bit_exact(tmp_path, one_pass):
    opt, step = one_pass.opt, one_pass.step
    # Batches shaped as `one_pass`'s (its compiled step serves).
    data = np.random.default_rng(4).integers(0, 97, (10, 8, 21)).astype(np.int32)

    def fresh():
        return ed.init_train_state(one_pass.model, opt)

    def run(state, start, stop):
        for i in range(start, stop):
            state, _ = step(state, ed.Batch.from_tokens(data[i]))
        return state

    straight = run(fresh(), 0, 10)
    half = run(fresh(), 0, 5)
    ed.train.save_train_state(tmp_path / "state", half, data_position=5)
    restored, position = ed.train.restore_train_state(tmp_path / "state", fresh())
    assert position == 5 and int(restored.step) == 5
    # A fresh state is committed to its device as a restored one is, so that the resumed run
    # reuses the step compiled for the first (jit compiles the two kinds apart).
    leaves = jax.tree.leaves(eqx.filter((fresh(), restored), eqx.is_array))
    assert all(leaf.committed for leaf in leaves)
    resumed = run(restored, position, 10)
    for a, b in zip(
        jax.tree.leaves(eqx.filter(straight, eqx.is_array)),
        jax.tree.leaves(eqx.filter(resumed, eqx.is_array)),
        strict=True,
    ):
        np.testing.assert_array_equal(a, b)


def test_restore_rejects_another_model(tmp_path, one_pass):
    opt = one_pass.opt
    state = ed.init_train_state(one_pass.model, opt)
    ed.train.save_train_state(tmp_path / "s", state)
    other = ed.init_train_state(
        random_fill(abstract(ed.DeepseekV4, _small(hidden_size=48)), seed=0), opt
    )
    with pytest.raises(ValueError, match="saved as"):
        ed.train.restore_train_state(tmp_path / "s", other)
    with pytest.raises(FileNotFoundError, match="train_state.json"):
        ed.train.restore_train_state(tmp_path / "missing", state)


def _train_step_memory(remat: str | None) -> int:
    # 15 layers: one sliding (the Python-loop driver), then seven (CSA, HCA) pairs in one scan.
    layer_types = (S,) + (C, H) * 7
    config = tiny_config(
        layer_types=layer_types,
        num_hash_layers=0,
        hidden_size=128,
        num_nextn_predict_layers=0,
    )
    opt = optax.sgd(1e-3)  # the activations are what remat changes, not the optimizer's state
    # Shapes only: the program is compiled, never run.
    state = eqx.filter_eval_shape(ed.init_train_state, abstract(ed.DeepseekV4, config), opt)
    step = ed.make_train_step(opt, remat=remat, donate=False)
    batch = ed.Batch.from_tokens(np.zeros((4, 257), np.int32))
    compiled = step.lower(state, batch).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def test_remat_lowers_train_step_temporaries():
    without, dots = _train_step_memory(None), _train_step_memory("dots")
    print(f"15-layer train step temporaries: no remat {without}, 'dots' {dots}")
    assert dots < 0.5 * without


def test_micro_batches_on_a_data_fsdp_expert_mesh_equal_one_pass_on_one_device(one_pass):
    # Two micro-batches on a data x fsdp x expert mesh (each device's two sequences split
    # between them), with padding unevenly spread (so each micro-batch's losses weigh by its own
    # share of the counted tokens), the MTP and balance losses on, and the router-bias update
    # from the summed loads: the same step as one pass on one device (`one_pass`: its first
    # update is the gradient itself). The experts' custom VJP runs under shard_map: the
    # weights' cotangents must be summed over `data`, the axis that splits the tokens but not
    # the weights.
    model, opt, batch = one_pass.model, one_pass.opt, one_pass.batch
    one, m1 = one_pass.new, one_pass.metrics
    mesh = ed.make_mesh(data=2, fsdp=2, expert=2)
    step = ed.make_train_step(opt, bias_update_rate=RATE, donate=False, remat=None, micro_batches=2)
    with jax.set_mesh(mesh):
        acc, m2 = step(ed.init_train_state(ed.shard(model, mesh), opt), batch)
    for name in ("loss", "lm", "mtp", "balance", "tokens"):
        np.testing.assert_allclose(m2[name], m1[name], rtol=2e-6, err_msg=name)
    np.testing.assert_allclose(m2["grad_norm"], m1["grad_norm"], rtol=2e-6)
    assert float(m1["mtp"]) > 0 and float(m1["balance"]) > 0
    for a, b in zip(m1["load"], m2["load"], strict=True):
        np.testing.assert_array_equal(b, a)
    for a, b in zip(
        jax.tree.leaves(eqx.filter(one.model, eqx.is_array)),
        jax.tree.leaves(eqx.filter(acc.model, eqx.is_array)),
        strict=True,
    ):
        np.testing.assert_allclose(b, a, atol=1e-6, rtol=1e-5)
    # The new state comes back placed as the given one (moments beside their parameters), so
    # the next step is the same program: nothing is lowered for it. Without micro-batches too,
    # where XLA left to itself splits a replicated weight (the MTP block's norm) in the output.
    given = ed.init_train_state(ed.shard(model, mesh), opt)
    placed = jax.tree.leaves(eqx.filter(acc, eqx.is_array))
    assert [x.sharding for x in placed] == [x.sharding for x in jax.tree.leaves(given)]
    whole = ed.make_train_step(opt, bias_update_rate=RATE, donate=False, remat=None)
    with jax.set_mesh(mesh):
        new, _ = whole(given, batch)
        start = len(lowered())
        jax.block_until_ready(whole(new, batch))
    assert not lowered()[start:], lowered()[start:]
    with pytest.raises(ValueError, match="does not split into 3 micro-batches"):
        ed.make_train_step(opt, micro_batches=3)(ed.init_train_state(model, opt), batch)


def test_abstract_train_state_places_moments_like_parameters():
    config = _small(num_nextn_predict_layers=0)
    mesh = ed.make_mesh(data=2, fsdp=2, expert=2)
    opt = ed.make_optimizer(1e-3, warmup_steps=1, total_steps=10)
    model = abstract(ed.DeepseekV4, config)
    placed = jax.tree.map(
        lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
        model,
        ed.parallel.named_shardings(model, mesh),
    )
    state = ed.train.abstract_train_state(placed, opt)
    real = ed.init_train_state(ed.shard(random_fill(model, seed=1), mesh), opt)
    # `init_train_state` places the state as this one says: each moment beside its parameter
    # (left to XLA, a state of zeros would be made whole on one device).
    ours = [(x.shape, x.dtype, x.sharding) for x in jax.tree.leaves(state)]
    assert ours == [(x.shape, x.dtype, x.sharding) for x in jax.tree.leaves(real)]
    params = eqx.filter(placed, eqx.filter_eval_shape(ed.train.trainable, placed))
    by_param = jax.tree.leaves(params)

    def is_adam(node):
        return isinstance(node, optax.ScaleByAdamState)

    (adam,) = [s for s in jax.tree.leaves(state.opt_state, is_leaf=is_adam) if is_adam(s)]
    for moments in (adam.mu, adam.nu):
        leaves = jax.tree.leaves(moments)
        assert len(leaves) == len(by_param) > 50
        for m, p in zip(leaves, by_param, strict=True):
            assert m.shape == p.shape and m.dtype == p.dtype
            assert m.sharding == p.sharding
    assert sum(len(p.sharding.spec) > 0 and any(p.sharding.spec) for p in by_param) > 20
    assert state.step.sharding.spec == jax.sharding.PartitionSpec()
    with pytest.raises(ValueError, match="placed on one mesh"):
        ed.train.abstract_train_state(model, opt)


def test_example_train_script(tmp_path):
    # QLoRA on the embedded default (its weights quantised as the release stores them; the
    # full fine-tune of the script: tests/test_readme.py::test_train_example_hf), interrupted
    # and resumed; the adapter it saves alone then runs in examples/generate.py --lora.
    run = tmp_path / "run"
    cmd = ["examples/train.py", "--steps", "6", "--seq-len", "32", "--batch", "2"]
    cmd += ["--save-every", "2", "--out", run, "--layers", "1", "--lora", "4", "--quantized"]
    cmd += ["--remat", "none", "--micro-batches", "2"]  # the resume is under test, not remat
    # Interrupted after 4 of 6 steps, then the same command resumes (both through the script's
    # `main`; its process start: tests/test_lora.py::test_example_lora_options_are_checked).
    first = succeeded(run_main(*cmd, "--stop-after", "4"))
    assert (run / "train_state" / "train_state.json").is_file()
    assert "tokens/s" in first.stderr and "trained steps 0..4 of 6" in first.stderr
    assert "LoRA: rank 4" in first.stderr and f"adapter in {run / 'adapter'}" in first.stderr
    again = succeeded(run_main(*cmd))
    assert "resumed at step 4" in again.stderr and "trained steps 4..6 of 6" in again.stderr
    saved = sorted(p.name for p in (run / "adapter").iterdir())
    assert saved[:2] == ["adapter_config.json", "adapter_model.safetensors"]
    assert not (run / "model").exists()
    cmd = ["examples/generate.py", "--layers", "1", "--quantized", "--lora", run / "adapter"]
    generated = succeeded(run_main(*cmd, "--max-new-tokens", "4"))
    assert f"adapter: {run / 'adapter'}" in generated.stderr
