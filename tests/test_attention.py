"""Attention (sliding-only, CSA, HCA) against transformers, and the sink / window by hand."""

import contextlib
import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from helpers import COMPONENT
from hf_reference import (
    abstract,
    hf_config,
    load_component,
    random_fill,
    randomize,
    tiny_config,
    to_numpy,
    to_torch,
    window_mask,
)
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf

import equinox_dsv4 as ed
from equinox_dsv4.nn import attend


def reference_attention(config, layer, seed):
    hf_cfg = hf_config(config)
    reference = randomize(hf.DeepseekV4Attention(hf_cfg, layer), seed=seed).eval()
    return reference, hf.DeepseekV4RotaryEmbedding(hf_cfg)


def run_reference(reference, rotary, x, window):
    b, s, _ = x.shape
    xt = to_torch(x)
    positions = torch.arange(s).expand(b, s)
    embeddings = {label: rotary(xt, positions, layer_type=label) for label in ("main", "compress")}
    with torch.no_grad():
        out, _ = reference(xt, embeddings, positions, window_mask(s, window, b))
    return to_numpy(out)


# Layers of tiny_config: 0 sliding, 2 CSA (hash), 3 HCA. Batch 2 x seq 3 takes the output
# projection's few-token einsum (`Policy.few_tokens`), longer ones its per-group matmuls.
@pytest.mark.parametrize("layer", [0, 2, 3])
@pytest.mark.parametrize("seq", [3, 13, 37])
def test_attention_matches_reference(getkey, layer, seq):
    config = tiny_config()
    reference, rotary = reference_attention(config, layer, seed=10 * layer + seq)
    ours = load_component(
        abstract(ed.nn.Attention, config, config.layer_types[layer]),
        reference,
        f"model.layers.{layer}.self_attn.",
        ".attn",
    )
    x = jax.random.normal(getkey(), (2, seq, config.hidden_size))
    expected = run_reference(reference, rotary, x, config.sliding_window)
    np.testing.assert_allclose(eqx.filter_jit(ours)(x), expected, **COMPONENT)


def test_attention_window_longer_than_sequence(getkey):
    config = tiny_config(sliding_window=64)
    reference, rotary = reference_attention(config, 3, seed=5)
    ours = load_component(
        abstract(ed.nn.Attention, config, ed.config.HCA),
        reference,
        "model.layers.3.self_attn.",
        ".attn",
    )
    x = jax.random.normal(getkey(), (1, 40, config.hidden_size))
    np.testing.assert_allclose(
        eqx.filter_jit(ours)(x), run_reference(reference, rotary, x, 64), **COMPONENT
    )


def test_attend_by_hand():
    # One head, head_dim 1, keys = values = [1, 2, 3] at positions 0..2, window 2, q = 1.
    # Query 2 sees keys 1, 2 (values 2, 3) with logits 2, 3 and the sink logit s:
    # out = (2 e^2 + 3 e^3) / (e^2 + e^3 + e^s).
    q = jnp.ones((1, 3, 1, 1))
    kv = jnp.array([[[1.0], [2.0], [3.0]]])
    sink = jnp.array([0.5])
    out = attend(q, kv, sink, window=2)
    e = np.exp
    expected = (2 * e(2) + 3 * e(3)) / (e(2) + e(3) + e(0.5))
    np.testing.assert_allclose(out[0, 2, 0, 0], expected, rtol=1e-6)
    # Query 0 sees only itself: 1 * e^1 / (e^1 + e^0.5).
    np.testing.assert_allclose(out[0, 0, 0, 0], e(1) / (e(1) + e(0.5)), rtol=1e-6)


def test_bf16_attention_products_read_bf16_activations():
    # Every product of `attend` (sliding window, dense and picked compressed entries) takes the
    # bf16 activations as they are, with a float32 result: upcasting them first, as XLA:CPU
    # once needed, cost 9% of a bf16 prefill (benchmarks/archive/NOTES.md, item 59).
    b, t, h, d, w, m, k = 1, 64, 4, 32, 16, 8, 4
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (b, t, h, d), jnp.bfloat16)
    kv = jax.random.normal(keys[1], (b, t, d), jnp.bfloat16)
    compressed = jax.random.normal(keys[2], (b, m, d), jnp.bfloat16)
    mask = jnp.ones((b, t, m), bool)
    picks = jnp.zeros((b, t, k), jnp.int32)
    sinks = jnp.zeros((h,))
    for kwargs in (dict(compressed_mask=mask), dict(compressed_picks=picks)):
        text = (
            jax.jit(lambda q, kv, c, kwargs=kwargs: attend(q, kv, sinks, w, compressed=c, **kwargs))
            .lower(q, kv, compressed)
            .as_text()
        )
        products = re.findall(r"stablehlo\.dot_general.*: \((.*)\) -> (\S+)", text)
        assert len(products) == 4, text
        for operands, result in products:
            assert operands.count("bf16") == 2 and "f32" in result, (operands, result)


def test_attend_compressed_entries_by_hand():
    # Query 1 with window 1 sees key 1 (value 2) plus compressed entry 0 (value 5), no sink mass
    # to speak of: out = (2 e^2 + 5 e^5) / (e^2 + e^5 + e^-30).
    q = jnp.ones((1, 2, 1, 1))
    kv = jnp.array([[[1.0], [2.0]]])
    compressed = jnp.array([[[5.0], [7.0]]])
    mask = jnp.array([[[False, False], [True, False]]])
    out = attend(q, kv, jnp.array([-30.0]), 1, compressed=compressed, compressed_mask=mask)
    e = np.exp
    np.testing.assert_allclose(
        out[0, 1, 0, 0], (2 * e(2) + 5 * e(5)) / (e(2) + e(5) + e(-30)), rtol=1e-6
    )
    np.testing.assert_allclose(out[0, 0, 0, 0], 1.0, rtol=1e-6)


def test_attention_bf16_runs(getkey):
    config = tiny_config()
    attn = random_fill(abstract(ed.nn.Attention, config, ed.config.CSA, dtype=jnp.bfloat16), 0)
    x = jax.random.normal(getkey(), (1, 21, config.hidden_size)).astype(jnp.bfloat16)
    out = eqx.filter_jit(attn)(x)
    assert out.dtype == jnp.bfloat16 and bool(jnp.isfinite(out.astype(jnp.float32)).all())


# `Policy.attention_kernel` (TPUs'), run in Pallas' interpreter on CPU.
KERNEL = ed.execution.Policy(attention_kernel=True)


def _kernels(fn, *args) -> int:
    return str(jax.make_jaxpr(fn)(*args)).count("pallas_call[")


@pytest.mark.parametrize("layer", [0, 2, 3])
def test_attention_kernel_matches_reference(getkey, layer):
    # A 37-token chunk (more than `Policy.few_tokens`) attends through the kernel: the window
    # alone, with the indexer's picks as a dense selection (CSA), with every visible entry
    # (HCA). Against transformers.
    config = tiny_config()
    reference, rotary = reference_attention(config, layer, seed=40 + layer)
    ours = load_component(
        abstract(ed.nn.Attention, config, config.layer_types[layer]),
        reference,
        f"model.layers.{layer}.self_attn.",
        ".attn",
    )
    ours = ed.execution.with_policy(ours, KERNEL)
    x = jax.random.normal(getkey(), (2, 37, config.hidden_size))
    assert _kernels(ours, x) == 1
    expected = run_reference(reference, rotary, x, config.sliding_window)
    np.testing.assert_allclose(eqx.filter_jit(ours)(x), expected, **COMPONENT)


@pytest.mark.parametrize("mesh", [None, dict(fsdp=2, tensor=2, expert=2)])
def test_attention_kernel_equals_the_plain_form(mesh):
    # Outputs and gradients (queries, keys, sinks, entries) of the kernels (forward and
    # backward) against the plain form: 16 heads in two groups of a program, 700 compressed
    # entries in two padded steps, one sequence's window before the chunk half missing. On a
    # mesh the kernels run in a shard_map over the batch (fsdp), the sequence's parts
    # (expert) and the heads (tensor): the gradients of the sinks and the entries, which each
    # device holds whole, add up.
    b, t, h, k, w, m = 2, 64, 16, 16, 8, 700
    keys = jax.random.split(jax.random.key(3), 7)
    q = jax.random.normal(keys[0], (b, t, h, k))
    kv = jax.random.normal(keys[1], (b, t, k))
    sinks = jax.random.normal(keys[2], (h,))
    prefix = jax.random.normal(keys[3], (b, w, k))
    prefix_valid = jnp.arange(w)[None] >= jnp.array([[w // 2], [0]])
    entries = jax.random.normal(keys[4], (b, m, k))
    mask = jax.random.bernoulli(keys[5], 0.3, (b, t, m))
    cotangent = jax.random.normal(keys[6], (b, t, h, k))

    def loss(policy, parts, q, kv, sinks, entries):
        out = attend(
            q, kv, sinks, w, prefix, prefix_valid, entries, mask, parts=parts, policy=policy
        )
        return jnp.sum(out * cotangent), out

    grad = jax.jit(
        jax.value_and_grad(loss, argnums=(2, 3, 4, 5), has_aux=True), static_argnums=(0, 1)
    )
    args = (q, kv, sinks, entries)
    (_, want), want_grads = grad(ed.execution.Policy(), 1, *args)
    parts = 1 if mesh is None else mesh["expert"]
    context = jax.set_mesh(ed.make_mesh(**mesh)) if mesh else contextlib.nullcontext()
    with context:
        # The forward kernel, and the backward one.
        assert _kernels(lambda *a: grad(KERNEL, parts, *a), *args) == 2
        (_, got), got_grads = grad(KERNEL, parts, *args)
    np.testing.assert_allclose(got, want, **COMPONENT)
    for name, a, b_ in zip(("q", "kv", "sinks", "entries"), got_grads, want_grads, strict=True):
        np.testing.assert_allclose(a, b_, **COMPONENT, err_msg=name)


def test_attention_kernel_in_bfloat16():
    # In a bf16 model the forward kernel writes its output in bf16 and the backward kernel
    # reads it back so for D = dO . O (as FlashAttention's backward does): the outputs and
    # gradients are the plain form's to bf16 precision. Neither transposes anything.
    b, t, h, k, w, m = 1, 64, 8, 128, 8, 300
    keys = jax.random.split(jax.random.key(4), 6)
    bf16 = jnp.bfloat16
    q = jax.random.normal(keys[0], (b, t, h, k), bf16)
    kv = jax.random.normal(keys[1], (b, t, k), bf16)
    sinks = jax.random.normal(keys[2], (h,))
    entries = jax.random.normal(keys[3], (b, m, k), bf16)
    mask = jax.random.bernoulli(keys[4], 0.3, (b, t, m))
    cotangent = jax.random.normal(keys[5], (b, t, h, k))

    def loss(policy, q, kv, sinks, entries):
        out = attend(q, kv, sinks, w, compressed=entries, compressed_mask=mask, policy=policy)
        return jnp.sum(out.astype(jnp.float32) * cotangent), out

    grad = jax.jit(jax.value_and_grad(loss, argnums=(1, 2, 3, 4), has_aux=True), static_argnums=0)
    args = (q, kv, sinks, entries)
    (_, want), want_grads = grad(ed.execution.Policy(), *args)
    jaxpr = str(jax.make_jaxpr(lambda *a: grad(KERNEL, *a))(*args))
    # Both kernels, and no transposed copy of the queries, the output or their gradients:
    # the kernels take and give them in the model's layout.
    assert jaxpr.count("pallas_call[") == 2 and "transpose[" not in jaxpr
    (_, got), got_grads = grad(KERNEL, *args)
    assert got.dtype == bf16
    # Both round the probabilities to bf16 for the values' product, in another order (the
    # kernel's running maximum): the outputs differ by that rounding, relative to their scale.
    want, got = np.asarray(want, float), np.asarray(got, float)
    np.testing.assert_allclose(got, want, rtol=2**-7, atol=2**-8 * np.abs(want).max())
    for name, a, b_ in zip(("q", "kv", "sinks", "entries"), got_grads, want_grads, strict=True):
        a, b_ = np.asarray(a, float), np.asarray(b_, float)
        # bf16 operands throughout: the gradients' error is the inputs' rounding, relative to
        # their largest entry.
        np.testing.assert_allclose(a, b_, rtol=0, atol=2e-2 * np.abs(b_).max(), err_msg=name)
