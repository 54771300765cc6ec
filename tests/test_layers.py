"""RMSNorm, RoPE (default and YaRN frequencies, interleaved rotation on the trailing dims) against
transformers and hand-computed values."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import COMPONENT
from hf_reference import fill_paths, hf_config, randomize, tiny_config, to_numpy, to_torch
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf

import equinox_dsv4 as ed
from equinox_dsv4.execution import linear, map_chunks, set_rows, zeros_after
from equinox_dsv4.nn import inverse_frequencies, rms_normalize


def test_rmsnorm_matches_reference(getkey):
    x = jax.random.normal(getkey(), (2, 5, 32))
    reference = randomize(hf.DeepseekV4RMSNorm(32, eps=1e-6), seed=1)
    ours = fill_paths(ed.nn.RMSNorm(32, 1e-6), {".weight": to_numpy(reference.weight)})
    expected = to_numpy(reference(to_torch(x)))
    np.testing.assert_allclose(ours(x), expected, **COMPONENT)


def test_rmsnorm_bf16_keeps_float32_weight_and_casts_back(getkey):
    x = jax.random.normal(getkey(), (3, 16)).astype(jnp.bfloat16)
    norm = ed.nn.RMSNorm(16)
    y = norm(x)
    assert y.dtype == jnp.bfloat16 and norm.weight.dtype == jnp.float32
    xf = np.asarray(x, np.float32)
    expected = xf / np.sqrt(np.mean(xf**2, -1, keepdims=True) + 1e-6)
    np.testing.assert_allclose(np.asarray(y, np.float32), expected, rtol=1e-2, atol=1e-2)


def test_unweighted_norm_matches_reference(getkey):
    x = jax.random.normal(getkey(), (2, 3, 4, 32)) * 3
    expected = to_numpy(hf.DeepseekV4UnweightedRMSNorm(eps=1e-6)(to_torch(x)))
    np.testing.assert_allclose(rms_normalize(x, 1e-6), expected, **COMPONENT)


def test_yarn_released_correction_range():
    # V4 compress rope: dim 64, theta 160000, factor 16, original 65536 -> pairs 0..14 keep the
    # original frequency, 25..31 are divided by 16, 15..24 are blended (low 15, high 25).
    yarn = ed.config.YarnScaling(factor=16.0, original_max_position_embeddings=65536)
    base = inverse_frequencies(64, 160000.0, None)
    scaled = inverse_frequencies(64, 160000.0, yarn)
    np.testing.assert_array_equal(scaled[:16], base[:16])
    np.testing.assert_allclose(scaled[25:], base[25:] / 16, rtol=1e-6)
    ramp = (np.arange(32) - 15) / 10
    blended = base / 16 * np.clip(ramp, 0, 1) + base * (1 - np.clip(ramp, 0, 1))
    np.testing.assert_allclose(scaled, blended, rtol=1e-6)
    np.testing.assert_allclose(base, 160000.0 ** (-np.arange(0, 64, 2) / 64), rtol=1e-6)


@pytest.mark.parametrize("label", ["main", "compress"])
def test_inverse_frequencies_match_reference(label):
    config = tiny_config(
        rope_scaling=ed.config.YarnScaling(factor=16.0, original_max_position_embeddings=64)
    )
    rotary = hf.DeepseekV4RotaryEmbedding(hf_config(config))
    expected = to_numpy(getattr(rotary, f"{label}_inv_freq"))
    rope = ed.nn.RoPE.for_layer(config, compressed=label == "compress")
    np.testing.assert_allclose(
        inverse_frequencies(rope.dim, rope.theta, rope.yarn), expected, rtol=1e-6
    )


@pytest.mark.parametrize("label", ["main", "compress"])
@pytest.mark.parametrize("inverse", [False, True])
def test_rope_rotation_matches_reference(getkey, label, inverse):
    config = tiny_config()
    b, s, h = 2, 23, 3
    x = jax.random.normal(getkey(), (b, s, h, config.head_dim))
    positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32) * 5, (b, s))
    rotary = hf.DeepseekV4RotaryEmbedding(hf_config(config))
    cos, sin = rotary(to_torch(x), to_torch(positions).long(), layer_type=label)
    # transformers rotates [b, h, s, d] and broadcasts cos/sin over heads.
    ref_in = to_torch(x).transpose(1, 2)
    expected = hf.apply_rotary_pos_emb(ref_in, cos, -sin if inverse else sin).transpose(1, 2)
    rope = ed.nn.RoPE.for_layer(config, compressed=label == "compress")
    ours = rope(x, positions, inverse=inverse)
    np.testing.assert_allclose(ours, to_numpy(expected), **COMPONENT)
    # Only the trailing qk_rope_head_dim channels move.
    np.testing.assert_array_equal(
        ours[..., : -config.qk_rope_head_dim], x[..., : -config.qk_rope_head_dim]
    )


def test_rope_by_hand():
    # One pair rotated by angle t * inv_freq_0 = t (inv_freq_0 = 1): (1, 0) -> (cos t, sin t).
    rope = ed.nn.RoPE(2, 10000.0)
    x = jnp.array([[[7.0, 1.0, 0.0]]])  # [b, s, 3]: one pass-through channel, one pair
    y = rope(x, jnp.array([[3]], jnp.int32))
    np.testing.assert_allclose(y[0, 0], [7.0, math.cos(3), math.sin(3)], rtol=1e-6)
    back = rope(y, jnp.array([[3]], jnp.int32), inverse=True)
    np.testing.assert_allclose(back, x, atol=1e-6)


def test_rope_rejects_mismatched_positions(getkey):
    rope = ed.nn.RoPE(8, 10000.0)
    with pytest.raises(ValueError, match="prefix"):
        rope(jnp.zeros((2, 5, 16)), jnp.zeros((2, 4), jnp.int32))
    with pytest.raises(ValueError, match="positive even"):
        ed.nn.RoPE(7, 10000.0)


@pytest.mark.parametrize("lead", [(1,), (1, 1), (3,)])
def test_linear_bf16_matches_float64(getkey, lead):
    # One row takes its own path on XLA:CPU (a second, zero row; see `linear`): the result
    # must be the row's product all the same, with float32 accumulation.
    w = jax.random.normal(getkey(), (384, 512)).astype(jnp.bfloat16)
    x = jax.random.normal(getkey(), (*lead, 512)).astype(jnp.bfloat16)
    y = jax.jit(lambda x, w: linear(x, w, None, dtype=jnp.float32))(x, w)
    assert y.shape == (*lead, 384) and y.dtype == jnp.float32
    expected = np.asarray(x, np.float64) @ np.asarray(w, np.float64).T
    # float32 accumulation over 512 terms of size ~1, results up to ~80: a few float32 ulps.
    np.testing.assert_allclose(y, expected, rtol=0, atol=1e-4)


def test_one_row_bf16_linear_does_not_widen_the_weight():
    # XLA:CPU converts a bf16 weight whole to float32 for a one-row (matrix-vector) product,
    # on every call: a decode step's head alone took 87 ms instead of 7.5
    # (benchmarks/archive/NOTES.md, item 17). The compiled product must not hold a float32 copy of
    # the weight.
    w = jax.ShapeDtypeStruct((4096, 512), jnp.bfloat16)
    x = jax.ShapeDtypeStruct((1, 1, 512), jnp.bfloat16)
    step = jax.jit(lambda x, w: linear(x, w, None, dtype=jnp.float32)).lower(x, w).compile()
    assert step.memory_analysis().temp_size_in_bytes < 4096 * 512 * 4 / 8


def test_map_chunks_matches_one_call(getkey):
    # 45 entries in chunks of 8: the last chunk is padded. Two outputs, one of them integer,
    # and the gradient, which training takes through the attention's chunks.
    x = jax.random.normal(getkey(), (2, 45, 3))
    y = jax.random.normal(getkey(), (2, 45, 3, 5))

    def fn(x, y):
        z = jnp.einsum("bnk,bnkj->bnj", x, y)
        return {"z": jnp.tanh(z), "i": jnp.argmax(z, axis=-1)}

    whole, chunked = fn(x, y), map_chunks(fn, (x, y), 8)
    assert chunked["z"].shape == (2, 45, 5) and chunked["i"].dtype == whole["i"].dtype
    np.testing.assert_allclose(chunked["z"], whole["z"], rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(chunked["i"], whole["i"])

    def loss(chunks):
        return lambda x, y: jnp.sum(jnp.sin(map_chunks(fn, (x, y), chunks)["z"]))

    grads = jax.grad(loss(8), argnums=(0, 1))(x, y)
    for ours, expected in zip(grads, jax.grad(loss(64), argnums=(0, 1))(x, y), strict=True):
        np.testing.assert_allclose(ours, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("chunks", [2, 4, 64])
def test_map_chunks_in_parts_matches_one_call(getkey, chunks):
    # Axis 1 in 4 parts of 11 (a sequence split over 4 devices), `chunks` entries of each part
    # per step: the last step padded, every part's entries in every step, or no loop. Each
    # output lands where its input was.
    x = jax.random.normal(getkey(), (2, 44, 3))
    y = jax.random.normal(getkey(), (2, 44, 3, 5))

    def fn(x, y):
        return jnp.tanh(jnp.einsum("bnk,bnkj->bnj", x, y)) + jnp.sum(x, axis=-1, keepdims=True)

    np.testing.assert_allclose(map_chunks(fn, (x, y), chunks, 4), fn(x, y), rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="3 parts do not divide axis 1 of size 44"):
        map_chunks(fn, (x, y), chunks, 3)


@pytest.mark.parametrize("first", [-np.inf, -2.5, 0.0, np.inf])
def test_zeros_after_is_positive_zero(first):
    # Made from an element of its input (so that XLA schedules it after), but zeros all the
    # same, whatever that element is short of NaN. (That it is scheduled after its input is
    # tested on the prefill's temporaries, test_model.py.)
    x = jnp.array([[first, 2.0], [3.0, np.nan]], jnp.float32)
    for dtype in (jnp.float32, jnp.bfloat16, jnp.int32):
        z = jax.jit(lambda x, dtype=dtype: zeros_after((3, 4), dtype, x))(x)
        assert z.shape == (3, 4) and z.dtype == dtype
        assert (np.asarray(z, np.float32) == 0).all()
        assert not np.signbit(np.asarray(z, np.float32)).any()


def test_zeros_after_sends_no_gradient_to_its_input():
    # A cotangent for `after` would be a zero array of its size: 8 GiB per attention layer of
    # V4-Flash's train step on a TPU before this was cut.
    def f(x):
        return jnp.sum(x * 2.0) + jnp.sum(zeros_after((3,), jnp.float32, x))

    x = jnp.ones((256, 1024), jnp.float32)
    np.testing.assert_array_equal(jax.grad(f)(x), np.full(x.shape, 2.0, np.float32))
    jaxpr = jax.make_jaxpr(jax.grad(f))(x)
    used = {e.primitive.name for e in jaxpr.jaxpr.eqns}
    assert not used & {"pad", "scatter-add", "dynamic_update_slice"}, used


# 1 x 1 and 2 x 3 writes take the conditional updates for bf16 on XLA:CPU, 4 x 8 the scatter;
# `layered`: into layer 1 of a stack of three (a scanned stack's cache).
@pytest.mark.parametrize("layered", [False, True])
@pytest.mark.parametrize("writes", [(1, 1), (2, 3), (4, 8)])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_set_rows_is_a_dropping_scatter(getkey, writes, dtype, layered):
    b, length = 4, 10
    lead = (3,) if layered else ()
    a = jax.random.normal(getkey(), (*lead, b, length, 3, 2)).astype(dtype)
    values = jax.random.normal(getkey(), (*writes, 3, 2)).astype(dtype)
    rng = np.random.default_rng(writes[1])
    # Distinct (row, column) pairs; a row or column past the end writes nothing. With three or
    # more writes: the last column first, a row past the end, then a dropped write to the first
    # row, which an update clamped onto the last column would overwrite.
    n = math.prod(writes)
    pairs = [(r, c) for r in range(b + 1) for c in range(length + 1) if (r, c) != (0, length - 1)]
    pairs = [pairs[i] for i in rng.permutation(len(pairs))[:n]]
    if n >= 3:
        pairs[0], pairs[1], pairs[-1] = (0, length - 1), (b, 0), (0, length)
    rows, cols = (np.array([p[i] for p in pairs]).reshape(writes) for i in (0, 1))
    expected = np.asarray(a.astype(jnp.float32)).copy()
    target = expected[1] if layered else expected
    flat = np.asarray(values.astype(jnp.float32)).reshape(-1, 3, 2)
    for r, c, v in zip(rows.flat, cols.flat, flat, strict=True):
        if r < b and c < length:
            target[r, c] = v
    index = (jnp.asarray(rows, jnp.int32), jnp.asarray(cols, jnp.int32))
    layer = jnp.asarray(1, jnp.int32) if layered else None
    out = jax.jit(functools.partial(set_rows, policy=None, layer=layer))(a, index, values)
    assert out.dtype == dtype
    np.testing.assert_array_equal(out.astype(jnp.float32), expected)

    # The derivative is the scatter's: the written rows' cotangent goes to `values`.
    weights = jax.random.normal(getkey(), a.shape)
    full_index = (1, *index) if layered else index

    def loss(write):
        return lambda a, v: jnp.sum(write(a, v).astype(jnp.float32) * weights)

    # Each derivative in one program (eagerly, each operation compiles alone).
    ours = jax.jit(
        jax.grad(loss(lambda a, v: set_rows(a, index, v, None, layer=layer)), argnums=(0, 1))
    )(a, values)
    scatter = jax.jit(
        jax.grad(loss(lambda a, v: a.at[full_index].set(v, mode="drop")), argnums=(0, 1))
    )
    for got, want in zip(ours, scatter(a, values), strict=True):
        np.testing.assert_array_equal(got.astype(jnp.float32), want.astype(jnp.float32))
