"""mHC: HyperConnection (pre / post / Sinkhorn comb, the C^T mixing) and HyperHead."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from helpers import COMPONENT
from hf_reference import (
    abstract,
    fill_paths,
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
from equinox_dsv4.nn import sinkhorn


@pytest.mark.parametrize("hc_mult", [2, 4])
def test_hyper_connection_matches_reference(getkey, hc_mult):
    config = tiny_config(hc_mult=hc_mult, hc_sinkhorn_iters=20)
    reference = randomize(hf.DeepseekV4HyperConnection(hf_config(config)), seed=hc_mult)
    ours = load_component(
        abstract(ed.nn.HyperConnection, config), reference, "model.layers.0.attn_hc.", ".hc_attn"
    )
    x = jax.random.normal(getkey(), (2, 7, hc_mult, config.hidden_size))
    post, comb, collapsed = reference(to_torch(x))
    u, our_post, our_comb = eqx.filter_jit(ours)(x)
    np.testing.assert_allclose(u, to_numpy(collapsed), **COMPONENT)
    np.testing.assert_allclose(our_post, to_numpy(post), **COMPONENT)
    np.testing.assert_allclose(our_comb, to_numpy(comb), **COMPONENT)

    # The residual update of transformers' decoder layer: post * y + comb^T @ X.
    y = jax.random.normal(getkey(), (2, 7, config.hidden_size))
    expected = post.unsqueeze(-1) * to_torch(y).unsqueeze(-2) + torch.matmul(
        comb.transpose(-1, -2), to_torch(x)
    )
    np.testing.assert_allclose(ours.mix(y, x, our_post, our_comb), to_numpy(expected), **COMPONENT)


def test_mix_uses_the_transpose():
    # Streams X_0 = [1], X_1 = [0]; C = [[a, b], [c, d]]: X'_k = sum_j C[j, k] X_j -> [a, b].
    config = tiny_config(hc_mult=2, hidden_size=1, q_lora_rank=1)
    hc = ed.nn.HyperConnection(config, key=jax.random.key(0))
    comb = jnp.array([[0.7, 0.3], [0.2, 0.8]])
    out = hc.mix(jnp.zeros((1,)), jnp.array([[1.0], [0.0]]), jnp.zeros((2,)), comb)
    np.testing.assert_allclose(out[:, 0], [0.7, 0.3], rtol=1e-6)


def test_sinkhorn_is_doubly_stochastic(getkey):
    comb = sinkhorn(jax.random.normal(getkey(), (5, 4, 4)), iters=20, eps=1e-6)
    np.testing.assert_allclose(comb.sum(-2), 1.0, atol=1e-5)
    # Columns are normalised last, so they are exact; rows converge (20 steps here).
    np.testing.assert_allclose(comb.sum(-1), 1.0, atol=1e-3)
    assert not np.allclose(comb, jnp.swapaxes(comb, -1, -2))


def test_sinkhorn_one_iteration_by_hand():
    logits = jnp.log(jnp.array([[1.0, 3.0], [1.0, 1.0]]))
    # softmax rows: [[.25, .75], [.5, .5]] (+ eps 0), then one column normalisation.
    c = np.array([[0.25, 0.75], [0.5, 0.5]])
    expected = c / c.sum(0, keepdims=True)
    np.testing.assert_allclose(sinkhorn(logits, iters=1, eps=0.0), expected, rtol=1e-6)


@pytest.mark.parametrize("hc_mult", [2, 4])
def test_hyper_head_matches_reference(getkey, hc_mult):
    config = tiny_config(hc_mult=hc_mult)
    reference = randomize(hf.DeepseekV4HyperHead(hf_config(config)), seed=3)
    values = {
        ".fn": to_numpy(reference.hc_fn),
        ".base": to_numpy(reference.hc_base),
        ".scale": to_numpy(reference.hc_scale),
    }
    ours = fill_paths(abstract(ed.nn.HyperHead, config), values)
    x = jax.random.normal(getkey(), (2, 5, hc_mult, config.hidden_size))
    expected = to_numpy(reference(to_torch(x)))
    np.testing.assert_allclose(eqx.filter_jit(ours)(x), expected, **COMPONENT)


def test_hyper_connection_bf16(getkey):
    config = tiny_config()
    hc = random_fill(abstract(ed.nn.HyperConnection, config), 0)
    x = jax.random.normal(getkey(), (1, 3, 4, config.hidden_size)).astype(jnp.bfloat16)
    u, post, comb = hc(x)
    assert u.dtype == jnp.bfloat16 and post.dtype == jnp.float32 and comb.dtype == jnp.float32
    assert hc.mix(u, x, post, comb).dtype == jnp.bfloat16


def test_sinkhorn_rolled_equals_unrolled(getkey):
    # The loop form GPUs' policy takes (Policy.rolled_sinkhorn) gives the unrolled numbers.
    logits = jax.random.normal(getkey(), (5, 4, 4))
    unrolled = sinkhorn(logits, iters=20, eps=1e-6, policy=ed.execution.Policy())
    rolled = sinkhorn(logits, iters=20, eps=1e-6, policy=ed.execution.Policy(rolled_sinkhorn=True))
    np.testing.assert_array_equal(np.asarray(rolled), np.asarray(unrolled))
    jaxpr = str(
        jax.make_jaxpr(lambda x: sinkhorn(x, 20, 1e-6, ed.execution.Policy(rolled_sinkhorn=True)))(
            logits
        )
    )
    assert "scan[" in jaxpr and "unroll=1" in jaxpr  # one loop body, 19 trips
