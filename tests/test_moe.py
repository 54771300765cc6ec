"""MoE: routers (hash, learned with bias, three scoring functions), clamped SwiGLU experts with
the sorted block dispatch, the shared expert."""

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from helpers import COMPONENT, LOGITS, equations
from hf_reference import (
    abstract,
    decode_temporaries,
    hf_config,
    load_component,
    random_fill,
    randomize,
    tiny_config,
    to_numpy,
    to_torch,
)
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf

import equinox_dsv4 as ed
from equinox_dsv4.nn import Gate


SCORE_FNS = {"softmax": torch.nn.Softmax(dim=-1), "sigmoid": torch.nn.Sigmoid()}


@pytest.mark.parametrize("layer", [0, 3])  # hash-routed, learned
@pytest.mark.parametrize("scoring", ["sqrtsoftplus", "softmax", "sigmoid"])
def test_moe_matches_reference(getkey, layer, scoring):
    # swiglu_limit 0.5 so that both clamps are active on random activations.
    config = tiny_config(scoring_func=scoring, swiglu_limit=0.5)
    # transformers 5.24 can only build "sqrtsoftplus" (its activation table has no "softmax");
    # the other scoring functions are patched into its router.
    hf_cfg = hf_config(dataclasses.replace(config, scoring_func="sqrtsoftplus"))
    reference = randomize(hf.DeepseekV4SparseMoeBlock(hf_cfg, layer), seed=layer)
    if scoring in SCORE_FNS:
        reference.gate.score_fn = SCORE_FNS[scoring]
    ours = load_component(
        abstract(ed.nn.MoE, config, config.mlp_layer_types[layer]),
        reference,
        f"model.layers.{layer}.mlp.",
        ".ffn",
    )
    x = jax.random.normal(getkey(), (2, 13, config.hidden_size))
    ids = jax.random.randint(getkey(), (2, 13), 0, config.vocab_size)
    with torch.no_grad():
        expected = reference(to_torch(x), to_torch(ids).long())
    np.testing.assert_allclose(eqx.filter_jit(ours)(x, ids), to_numpy(expected), **COMPONENT)


def test_router_selects_with_bias_but_weights_without(getkey):
    config = tiny_config(n_routed_experts=4, num_experts_per_tok=1, routed_scaling_factor=1.0)
    gate = random_fill(abstract(Gate, config, False), 1)
    x = jax.random.normal(getkey(), (5, config.hidden_size))
    scores = np.sqrt(np.log1p(np.exp(np.asarray(x @ gate.weight.T))))
    # A large bias on expert 2 forces its selection; the weight is still its unbiased score,
    # renormalised over one expert -> 1.
    gate = eqx.tree_at(lambda g: g.bias, gate, jnp.array([0.0, 0.0, 100.0, 0.0]))
    weights, indices = gate(x, jnp.zeros((5,), jnp.int32))
    np.testing.assert_array_equal(indices[:, 0], 2)
    np.testing.assert_allclose(weights[:, 0], 1.0, rtol=1e-6)
    # Without renormalisation the weight is the raw score.
    config = tiny_config(
        n_routed_experts=4, num_experts_per_tok=1, routed_scaling_factor=2.0, norm_topk_prob=False
    )
    gate2 = eqx.tree_at(lambda g: g.bias, random_fill(abstract(Gate, config, False), 2), gate.bias)
    gate2 = eqx.tree_at(lambda g: g.weight, gate2, gate.weight)
    weights, _ = gate2(x, jnp.zeros((5,), jnp.int32))
    np.testing.assert_allclose(weights[:, 0], 2.0 * scores[:, 2], rtol=1e-5)


def test_hash_router_uses_token_ids(getkey):
    config = tiny_config()
    gate = random_fill(abstract(Gate, config, True), 3)
    ids = jnp.array([5, 5, 17], jnp.int32)
    _, indices = gate(jax.random.normal(getkey(), (3, config.hidden_size)), ids)
    np.testing.assert_array_equal(indices, gate.tid2eid[ids])


def _dense_reference(experts, x, indices, weights, limit):
    # Every (token, slot) through its expert, in float64 numpy.
    w1, w2, w3 = (np.asarray(w, np.float64) for w in (experts.w1, experts.w2, experts.w3))
    x = np.asarray(x, np.float64)
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(indices.shape[1]):
            e = int(indices[t, j])
            g, u = w1[e] @ x[t], w3[e] @ x[t]
            if limit > 0:
                g, u = np.minimum(g, limit), np.clip(u, -limit, limit)
            out[t] += float(weights[t, j]) * (w2[e] @ (g / (1 + np.exp(-g)) * u))
    return out


@pytest.mark.parametrize(
    "tokens,experts,top_k", [(1, 16, 4), (5, 3, 2), (7, 8, 1), (300, 4, 2), (64, 64, 6)]
)
def test_expert_dispatch_matches_dense(getkey, tokens, experts, top_k):
    config = tiny_config(n_routed_experts=experts, num_experts_per_tok=top_k, swiglu_limit=0.7)
    layer = random_fill(abstract(ed.nn.Experts, config), 4)
    layer = jax.tree.map(lambda w: w * 5, layer)  # large enough for the clamp to bite
    x = jax.random.normal(getkey(), (tokens, config.hidden_size))
    indices = jax.vmap(lambda k: jax.random.permutation(k, experts)[:top_k])(
        jax.random.split(getkey(), tokens)
    ).astype(jnp.int32)
    weights = jax.random.uniform(getkey(), (tokens, top_k))
    out = eqx.filter_jit(layer)(x, indices, weights)
    expected = _dense_reference(layer, x, indices, weights, 0.7)
    np.testing.assert_allclose(out, expected, **LOGITS)  # float32 vs float64 sums
    # Inside a layer stack, decoding (no more assignments than experts) gathers the experts.
    gather = ed.execution.with_policy(layer, ed.execution.Policy(gather_experts=True))
    out = eqx.filter_jit(gather)(x, indices, weights)
    np.testing.assert_allclose(out, expected, **LOGITS)


@pytest.mark.parametrize("gather", [False, True])
def test_decode_dispatch_drops_out_of_range_experts(getkey, gather):
    # Expert parallelism marks the assignments to other devices' experts with index E.
    config = tiny_config(n_routed_experts=8, num_experts_per_tok=3, swiglu_limit=0.7)
    layer = jax.tree.map(lambda w: w * 5, random_fill(abstract(ed.nn.Experts, config), 7))
    x = jax.random.normal(getkey(), (2, config.hidden_size))
    indices = jnp.array([[8, 2, 5], [7, 8, 8]], jnp.int32)
    weights = jax.random.uniform(getkey(), (2, 3))
    policy = ed.execution.Policy(gather_experts=gather)
    out = jax.jit(ed.execution.dispatch, static_argnums=(6, 7, 8))(
        x, indices, weights, layer.w1, layer.w2, layer.w3, 0.7, "exact", policy
    )
    kept = indices < 8
    expected = _dense_reference(
        layer, x, jnp.where(kept, indices, 0), jnp.where(kept, weights, 0.0), 0.7
    )
    np.testing.assert_allclose(out, expected, **COMPONENT)


def test_all_tokens_on_one_expert(getkey):
    config = tiny_config(n_routed_experts=8, num_experts_per_tok=1)
    layer = random_fill(abstract(ed.nn.Experts, config), 5)
    x = jax.random.normal(getkey(), (50, config.hidden_size))
    indices = jnp.full((50, 1), 5, jnp.int32)
    weights = jnp.ones((50, 1))
    expected = _dense_reference(layer, x, indices, weights, config.swiglu_limit)
    np.testing.assert_allclose(layer(x, indices, weights), expected, atol=1e-5, rtol=1e-4)


def test_expert_loop_gradient_matches_dense(getkey):
    # 700 tokens x top-2 over 8 experts: more row blocks than experts, so `dispatch` takes the
    # expert loop (`expert_mlps`, whose gradient is written by hand), where each expert's ~200
    # rows run as one 128-row block and then 16-row ones. Expert 3 gets no token.
    tokens, experts, top_k, limit = 700, 8, 2, 0.7
    config = tiny_config(n_routed_experts=experts, num_experts_per_tok=top_k)
    layer = jax.tree.map(lambda w: w * 5, random_fill(abstract(ed.nn.Experts, config), 6))
    x = jax.random.normal(getkey(), (tokens, config.hidden_size))
    others = jnp.array([0, 1, 2, 4, 5, 6, 7])
    indices = jax.vmap(lambda k: others[jax.random.permutation(k, 7)[:top_k]])(
        jax.random.split(getkey(), tokens)
    ).astype(jnp.int32)
    weights = jax.random.uniform(getkey(), (tokens, top_k))

    def dense(x, weights, w1, w2, w3):  # every expert on every token, masked
        g = jnp.einsum("td,eid->tei", x, w1)
        u = jnp.einsum("td,eid->tei", x, w3)
        y = jnp.einsum("tei,edi->ted", ed.execution.swiglu(g, u, limit), w2)
        chosen = jax.nn.one_hot(indices, experts)
        return jnp.einsum("tke,tk,ted->td", chosen, weights, y)

    def ours(x, weights, w1, w2, w3):
        return ed.execution.dispatch(x, indices, weights, w1, w2, w3, limit, "exact", None)

    def loss(f):
        return lambda *a: jnp.sum(jnp.sin(f(*a)))

    args = (x, weights, layer.w1, layer.w2, layer.w3)
    got = jax.jit(jax.grad(loss(ours), argnums=range(5)))(*args)
    want = jax.grad(loss(dense), argnums=range(5))(*args)
    for name, g, w in zip(["x", "weights", "w1", "w2", "w3"], got, want, strict=True):
        np.testing.assert_allclose(g, w, atol=1e-5 * float(jnp.max(jnp.abs(w))), err_msg=name)
    for g in got[2:]:
        assert not np.any(np.asarray(g[3])), "an expert without tokens gets no gradient"


def test_decode_dispatch_memory_does_not_grow_with_its_blocks():
    # 2 tokens x top-4: 8 assignments, fewer than the 16 experts, so `dispatch` runs them in a
    # loop, copying one expert's weights at a time. Unrolled, every assignment kept its own
    # copy (8x here), which at the small config's size made malloc map the decode step's
    # temporaries fresh, with page faults, on every token.
    experts, inter, dim, tokens, top_k = 16, 128, 128, 2, 4
    expert_weights = 3 * inter * dim * 4

    def temporaries(gather):
        def f(x, indices, weights, w1, w2, w3):
            policy = ed.execution.Policy(gather_experts=gather)
            return ed.execution.dispatch(x, indices, weights, w1, w2, w3, 0.0, "exact", policy)

        shapes = [(tokens, dim), (tokens, top_k), (tokens, top_k)]
        shapes += [(experts, inter, dim), (experts, dim, inter), (experts, inter, dim)]
        dtypes = [jnp.float32, jnp.int32] + [jnp.float32] * 4
        args = [jax.ShapeDtypeStruct(s, d) for s, d in zip(shapes, dtypes, strict=True)]
        return jax.jit(f).lower(*args).compile().memory_analysis().temp_size_in_bytes

    assert temporaries(False) < 1.5 * expert_weights
    # The gathered form, for weights that are not parameters, holds all 8 chosen experts.
    assert temporaries(True) > 4 * expert_weights


def test_scanned_decode_step_does_not_copy_every_expert():
    # In a scanned layer stack a decode step must read the chosen experts only. A loop over
    # the assignments took the layer's slice of the stacked experts as its operand, and XLA
    # copied the slice, every expert of every scanned layer, on every token (the small
    # config's 43-layer decode step: 285 -> 103 ms, benchmarks/archive/NOTES.md, Round 5). So the
    # step's temporaries must not grow with the number of experts.
    def temporaries(experts):
        config = tiny_config(
            n_routed_experts=experts, moe_intermediate_size=64, num_nextn_predict_layers=0
        )
        assert any(s.scanned for s in ed.config.LayerPlan.from_config(config).segments)
        return decode_temporaries(abstract(ed.DeepseekV4, config))

    layer_slice = 3 * 56 * 64 * 32 * 4  # the 56 experts added, one layer's slice, float32
    assert temporaries(64) - temporaries(8) < layer_slice / 4


def test_bf16_decode_step_does_not_widen_the_experts():
    # With bf16 weights, the loop over the assignments (the unrolled layers' decode dispatch)
    # had XLA:CPU convert each layer's whole expert stack to float32 in front of the loop, on
    # every token, until the loop carried the stacks (benchmarks/archive/NOTES.md, item 17). So the
    # step's temporaries must not grow with the number of experts.
    def temporaries(experts):
        config = tiny_config(
            n_routed_experts=experts,
            moe_intermediate_size=64,
            num_nextn_predict_layers=0,
            num_hidden_layers=4,
        )
        assert not any(s.scanned for s in ed.config.LayerPlan.from_config(config).segments)
        return decode_temporaries(abstract(ed.DeepseekV4, config, dtype=jnp.bfloat16))

    # The 56 experts added, float32, in one of the four layers.
    layer_stack = 3 * 56 * 64 * 32 * 4
    assert temporaries(64) - temporaries(8) < layer_stack / 4


def _bf16_dispatch(experts, inter, dim, tokens, top_k, policy=None):
    # `dispatch` on bf16 tokens and experts, and its arguments' shapes.
    def f(x, indices, weights, w1, w2, w3):
        return ed.execution.dispatch(x, indices, weights, w1, w2, w3, 0.0, "exact", policy)

    shapes = [(tokens, dim), (tokens, top_k), (tokens, top_k)]
    shapes += [(experts, inter, dim), (experts, dim, inter), (experts, inter, dim)]
    dtypes = [jnp.bfloat16, jnp.int32, jnp.float32] + [jnp.bfloat16] * 3
    return f, [jax.ShapeDtypeStruct(s, d) for s, d in zip(shapes, dtypes, strict=True)]


def test_bf16_prefill_dispatch_does_not_widen_the_experts():
    # 256 assignments for 16 experts: the expert loop. With the stacks as the loop's scanned
    # operand, XLA:CPU converted each bf16 stack to float32 whole in front of it, every
    # layer's at the start of the program (the small config's bf16 prefill: 384 MiB of its
    # 762 MiB of temporaries; benchmarks/archive/NOTES.md, item 20). The loop carries them now.
    experts, inter, dim, tokens, top_k = 16, 128, 128, 64, 4
    widened = 3 * experts * inter * dim * 4

    f, args = _bf16_dispatch(experts, inter, dim, tokens, top_k)
    compiled = jax.jit(f).lower(*args).compile()
    # Here: 0.6 MB (rows, outputs), against 3.7 MB with the stacks converted.
    assert compiled.memory_analysis().temp_size_in_bytes < widened / 2


def _avals(jaxpr):
    # Every value a jaxpr computes, its sub-jaxprs' (loops, custom VJPs) included; a custom
    # VJP's results once, as its own jaxpr computes them.
    for eqn in equations(jaxpr):
        if not eqn.primitive.name.startswith("custom_vjp_call"):
            yield from (v.aval for v in eqn.outvars)


@pytest.mark.parametrize("platform,experts", [("tpu", "loop"), ("tpu", "ragged"), ("cpu", "loop")])
def test_bf16_prefill_dispatch_keeps_its_rows_in_bf16(platform, experts):
    # Each assignment's output row (the expert loop's output, or the ragged products') and
    # their read-back per token are a prefill MoE's largest buffers (V4-Flash on a TPU:
    # benchmarks/archive/NOTES.md): in the activation dtype, summed over top-k in float32.
    # XLA:CPU converted a bf16 buffer whole around each block's update of it, so under its
    # policy the loop holds float32 (the values still rounded to bf16:
    # `test_bf16_dispatch_is_the_same_under_both_policies`). A TPU runs the loop for quantised
    # experts, `ragged_dot` (no padded rows) for dense ones.
    experts_, inter, dim, tokens, top_k = 16, 32, 64, 64, 4
    policy = ed.execution.Policy.for_platform(platform)
    assert policy.experts == ("loop" if platform == "cpu" else "ragged")
    policy = dataclasses.replace(policy, experts=experts)
    held = jnp.dtype(jnp.float32 if platform == "cpu" else jnp.bfloat16)

    f, args = _bf16_dispatch(experts_, inter, dim, tokens, top_k, policy)
    closed = jax.make_jaxpr(f)(*args)
    assert closed.out_avals[0].dtype == jnp.float32
    values = [
        a
        for a in _avals(closed.jaxpr)
        if a.ndim == 2 and a.shape[1] == dim and jnp.issubdtype(a.dtype, jnp.floating)
    ]
    # The read-back (one row per assignment) and the loop's rows (padded per expert: more).
    read_back = [a.dtype for a in values if a.shape[0] == tokens * top_k]
    loop = {a.dtype for a in values if a.shape[0] > tokens * top_k}
    if experts == "ragged":
        # The w2 product's float32 result, rounded to bf16 as it leaves the product (one
        # fusion on a TPU), then the bf16 rows read back per token; no padded buffer.
        assert read_back.count(jnp.dtype(jnp.float32)) == 1, read_back
        assert read_back[-1] == jnp.bfloat16 and not loop, (read_back, loop)
    else:
        assert read_back and all(d == jnp.bfloat16 for d in read_back), read_back
        assert held in loop and loop <= {held, jnp.dtype(jnp.bfloat16)}, loop


def test_bf16_dispatch_is_the_same_under_both_policies():
    # The float32 buffer XLA:CPU's policy holds the expert loop's rows in changes no number:
    # outputs and every gradient equal the bf16 buffer's bit for bit. (The policies differ in
    # their other forms too, which must not change a number either.) 512 assignments for 16
    # experts: 32-row blocks, then 16-row tails.
    experts, inter, dim, tokens, top_k = 16, 32, 64, 128, 4
    keys = jax.random.split(jax.random.key(3), 6)
    _, args = _bf16_dispatch(experts, inter, dim, tokens, top_k)
    x, _, _, w1, w2, w3 = (
        jax.random.normal(k, a.shape).astype(a.dtype) for k, a in zip(keys, args, strict=True)
    )
    indices = jax.random.randint(keys[1], (tokens, top_k), 0, experts)
    weights = jax.random.uniform(keys[2], (tokens, top_k))

    def loss(x, weights, w1, w2, w3, policy):
        y = ed.execution.dispatch(x, indices, weights, w1, w2, w3, 0.0, "exact", policy)
        return jnp.sum(jnp.sin(y)), y

    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True), static_argnums=5)
    policies = [ed.execution.Policy.for_platform(p) for p in ("tpu", "cpu")]
    policies[0] = dataclasses.replace(policies[0], experts="loop")  # the loop, bf16 buffer
    outs = [grad(x, weights, w1, w2, w3, policy) for policy in policies]
    for a, b in zip(*(jax.tree.leaves(o) for o in outs), strict=True):
        assert a.dtype == b.dtype and np.isfinite(np.asarray(a, np.float32)).all()
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_ragged_experts_equal_the_expert_loop(dtype):
    # `Policy.experts="ragged"`: the same sorted assignments through `jax.lax.ragged_dot`
    # instead of the loop over experts, each assignment's output rounded to the activation
    # dtype as the loop's is: outputs and every gradient against the loop's. 512 assignments
    # for 16 experts, one expert with none; out-of-range assignments dropped.
    experts, inter, dim, tokens, top_k = 16, 32, 64, 128, 4
    keys = jax.random.split(jax.random.key(4), 6)
    x = jax.random.normal(keys[0], (tokens, dim)).astype(dtype)
    w1, w3 = (jax.random.normal(k, (experts, inter, dim)).astype(dtype) / 8 for k in keys[1:3])
    w2 = jax.random.normal(keys[3], (experts, dim, inter)).astype(dtype) / 6
    indices = jax.random.randint(keys[4], (tokens, top_k), 0, experts + 1)  # 16: dropped
    indices = jnp.where(indices == 5, 6, indices)  # expert 5: no assignment
    weights = jax.random.uniform(keys[5], (tokens, top_k))

    def loss(x, weights, w1, w2, w3, policy):
        y = ed.execution.dispatch(x, indices, weights, w1, w2, w3, 0.7, "exact", policy)
        return jnp.sum(jnp.sin(y)), y

    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True), static_argnums=5)
    loop = ed.execution.Policy(experts="loop")
    ragged = ed.execution.Policy(experts="ragged")
    # bf16: the two kernels round their bf16 products' float32 sums in other orders.
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    got, want = (grad(x, weights, w1, w2, w3, p) for p in (ragged, loop))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        np.testing.assert_allclose(a, b, atol=tol * max(1.0, float(np.abs(b).max())), rtol=tol)
    assert not np.any(np.asarray(got[0][2][5], np.float32)), "expert 5 gets no gradient"
    # The ragged form is what runs: no loop over the experts in its program.
    jaxpr = str(jax.make_jaxpr(lambda *a: loss(*a, ragged))(x, weights, w1, w2, w3))
    assert "ragged_dot" in jaxpr and "scan" not in jaxpr


def test_ragged_policy_keeps_the_loop_for_quantised_experts():
    # A quantised stack is dequantised one expert at a time by the loop; `ragged_dot` would
    # need the whole layer's dense stack. Both policies then give the same bits.
    experts, inter, dim, tokens, top_k = 8, 32, 64, 32, 2
    keys = jax.random.split(jax.random.key(5), 4)
    w1, w3 = (
        ed.quant.quantize(jax.random.normal(k, (experts, inter, dim)), "e2m1") for k in keys[:2]
    )
    w2 = ed.quant.quantize(jax.random.normal(keys[2], (experts, dim, inter)), "e2m1")
    x = jax.random.normal(keys[3], (tokens, dim))
    indices = jnp.tile(jnp.arange(top_k, dtype=jnp.int32)[None], (tokens, 1))
    weights = jnp.full((tokens, top_k), 0.5)

    def run(policy):
        f = eqx.filter_jit(ed.execution.dispatch)
        return f(x, indices, weights, w1, w2, w3, 0.0, "exact", policy)

    loop, ragged = run(ed.execution.Policy()), run(ed.execution.Policy(experts="ragged"))
    np.testing.assert_array_equal(np.asarray(loop), np.asarray(ragged))
