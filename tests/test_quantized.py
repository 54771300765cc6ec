"""The release's FP8/FP4 weights kept quantised in memory: dequantisation against the test
writer's independent numpy code, a release-layout checkpoint loaded with `quantized=True`
against the same checkpoint dequantised on load, resident bytes, saving and the CLI, sharding,
decoding, fine-tuning with the quantised weights frozen, and bad input."""

import equinox as eqx
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from helpers import COMPONENT, run_main, succeeded
from hf_reference import C, H, S, reference_model, tiny_config
from release_layout import (
    dequantize_fp4,
    dequantize_fp8,
    quantize_fp4,
    quantize_fp8,
    write_release_checkpoint,
)

import convert
import equinox_dsv4 as ed
from convert.reader import list_tensors
from equinox_dsv4.quant import quantize


# FP8 in 32 x 32 blocks, so that the toy's 64-wide projections hold several blocks each.
BLOCK = 32
CONFIG = tiny_config(
    layer_types=(S, C, H, C),
    compress_rate_hca=128,
    hidden_size=64,
    q_lora_rank=32,
    moe_intermediate_size=64,
)
IDS = jnp.asarray(np.random.default_rng(3).integers(0, CONFIG.vocab_size, (2, 40)), jnp.int32)


def is_quantized(x):
    return isinstance(x, ed.quant.QuantizedWeight)


@eqx.filter_jit
def forward(model, ids):
    return model(ids)


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    path = tmp_path_factory.mktemp("release_quantized")
    reference = reference_model(CONFIG, seed=7)
    write_release_checkpoint(path, CONFIG, reference, shards=2, fp8_block=BLOCK)
    return path


@pytest.fixture(scope="module")
def models(release):
    # Exact numerics: the same computation on the same (dequantised) weights.
    exact = dict(numerics="exact")
    return convert.load_hf(release, quantized=True, **exact), convert.load_hf(release, **exact)


# ---------------------------------------------------------------------------------------------
# one weight


@pytest.mark.parametrize("shape, block", [((200, 300), 128), ((64, 96), 32)])
def test_fp8_dequantises_like_the_reference(shape, block):
    w = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    q, scale = quantize_fp8(w, block)
    ours = ed.quant.QuantizedWeight(
        jnp.asarray(q), jnp.asarray(scale.view(np.uint8)), "e4m3", (block, block), jnp.float32
    )
    expected = dequantize_fp8(q, scale, block)
    np.testing.assert_array_equal(np.asarray(ours.dequantize()), expected)
    np.testing.assert_array_equal(
        np.asarray(ours.dequantize(jnp.bfloat16)), expected.astype(ml_dtypes.bfloat16)
    )
    # transformers' float `weight_scale_inv` multipliers dequantise the same.
    floats = ed.quant.QuantizedWeight(
        ours.values, jnp.asarray(scale.astype(np.float32)), "e4m3", (block, block), jnp.float32
    )
    np.testing.assert_array_equal(np.asarray(floats.dequantize()), expected)


def test_fp4_dequantises_like_the_reference():
    rng = np.random.default_rng(1)
    w = rng.standard_normal((3, 10, 96)).astype(np.float32)
    packed, scales = zip(*(quantize_fp4(x) for x in w), strict=True)
    ours = ed.quant.QuantizedWeight(
        jnp.asarray(np.stack(packed).view(np.uint8)),
        jnp.asarray(np.stack(scales).view(np.uint8)),
        "e2m1",
        (1, 32),
        jnp.float32,
    )
    assert ours.shape == (3, 10, 96) and ours[1].shape == (10, 96)
    for e in range(3):  # indexing a stack (one expert) keeps values and scales together
        np.testing.assert_array_equal(
            np.asarray(ours[e].dequantize()), dequantize_fp4(packed[e], scales[e])
        )
    # Every nibble, both positions in the byte; scale byte 200 is 2^73.
    every = np.array([[(15 - n) << 4 | n for n in range(16)]], np.uint8)
    one = ed.quant.QuantizedWeight(
        jnp.asarray(every), jnp.asarray([[200]], jnp.uint8), "e2m1", (1, 32), jnp.float32
    )
    lut = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6]) * 2.0**73
    values = np.asarray(one.dequantize())[0]
    np.testing.assert_array_equal(values[0::2], lut)
    np.testing.assert_array_equal(values[1::2], lut[::-1])
    assert np.signbit(values[16])


def test_suite_compiles_8_bit_floats_with_xla_mlir_emitters():
    # The suite's compiler setting (tests/helpers.py): in effect, and not for programs holding
    # 8- or 4-bit floats, which XLA:CPU's classic emitters round wrongly (with them the test
    # below fails).
    from jax._src import compiler

    programs = compiler.compile_or_get_cached.programs
    x = jnp.linspace(-3.0, 3.0, 7)
    before = dict(programs)
    jax.jit(lambda v: v * 3.0 + 1.0)(x).block_until_ready()
    assert programs[True] == before[True] + 1 and programs[False] == before[False]
    jax.jit(lambda v: (v * 5.0).astype(jnp.float8_e4m3fn))(x).block_until_ready()
    assert programs[True] == before[True] + 1 and programs[False] == before[False] + 1


def test_quantize_rounds_like_ml_dtypes():
    w = jax.random.normal(jax.random.key(0), (2, 96, 160)) * 0.05
    fp8 = quantize(w, "e4m3", (32, 32))
    s = np.exp2(np.asarray(fp8.scale, np.float64) - 127)
    full = np.repeat(np.repeat(s, 32, -2), 32, -1)
    expected = (np.asarray(w, np.float64) / full).astype(ml_dtypes.float8_e4m3fn)
    np.testing.assert_array_equal(np.asarray(fp8.values).view(np.uint8), expected.view(np.uint8))
    # Each block's scale is the smallest power of two that keeps its largest entry in range.
    amax = np.abs(np.asarray(w)).reshape(2, 3, 32, 5, 32).max(axis=(2, 4))
    assert np.all(amax / s <= 448) and np.all(amax / s > 224)

    fp4 = quantize(w, "e2m1")
    s4 = np.repeat(np.exp2(np.asarray(fp4.scale, np.float64) - 127), 32, -1)
    codes = (np.asarray(w, np.float64) / s4).astype(ml_dtypes.float4_e2m1fn).view(np.uint8) & 0xF
    np.testing.assert_array_equal(np.asarray(fp4.values), codes[..., 0::2] | codes[..., 1::2] << 4)


# ---------------------------------------------------------------------------------------------
# a release checkpoint kept quantised


def test_release_loaded_quantized(release, models):
    quantized, dequantised = models
    wq_a = quantized.layers[0].blocks[0].attn.wq_a.weight
    w1 = quantized.layers[1].blocks[0].ffn.experts.w1
    assert wq_a.values.dtype == jnp.float8_e4m3fn and wq_a.scale.dtype == jnp.uint8
    assert wq_a.scale.shape[-2:] == (1, 2)  # q_lora 32 x d_model 64 in 32 x 32 blocks
    assert w1.values.dtype == jnp.uint8 and w1.shape[-2:] == (64, 64)
    assert w1.values.shape[-1] == 32 and w1.scale.shape[-1] == 2
    assert quantized.mtp and is_quantized(quantized.mtp[0].e_proj.weight)
    # Exactly the dequantised model's weights, and its logits.
    held = jax.tree.leaves(quantized, is_leaf=is_quantized)
    for ours, dense in zip(held, jax.tree.leaves(dequantised), strict=True):
        ours = ours.dequantize() if is_quantized(ours) else ours
        np.testing.assert_array_equal(np.asarray(ours), np.asarray(dense))
    np.testing.assert_allclose(forward(quantized, IDS), forward(dequantised, IDS), **COMPONENT)


def test_resident_bytes_are_the_release_bytes(release, models):
    quantized, dequantised = models
    problems: list[str] = []
    tensors = list_tensors(release, problems)
    assert not problems
    stored = sum(
        t.nbytes
        for t in tensors.values()
        if t.dtype.itemsize == 1 and not np.issubdtype(t.dtype, np.integer) or t.dtype == np.int8
    )
    # Measured on the live device buffers, not computed from shapes.
    held = [x for x in jax.tree.leaves(quantized, is_leaf=is_quantized) if is_quantized(x)]
    resident = sum(a.addressable_shards[0].data.nbytes for w in held for a in (w.values, w.scale))
    assert abs(resident / stored - 1) <= 0.05, (resident, stored)
    bytes_ = ed.quant.weight_bytes(quantized)
    assert bytes_["quantized"] == resident
    assert ed.quant.weight_bytes(dequantised)["total"] > bytes_["total"]


def test_decode_of_the_quantized_model_equals_its_forward(models):
    quantized, _ = models
    full = np.asarray(forward(quantized, IDS))
    step = eqx.filter_jit(lambda m, ids, cache: m.decode(ids, cache))
    cache = quantized.init_cache(2, 64)
    logits, cache = step(quantized, IDS[:, :30], cache)
    np.testing.assert_allclose(logits, full[:, :30], **COMPONENT)
    for t in range(30, 33):  # one-token steps: the experts' per-assignment path
        logits, cache = step(quantized, IDS[:, t : t + 1], cache)
        np.testing.assert_allclose(logits[:, 0], full[:, t], **COMPONENT)


def test_convert_quantized_then_load(release, models, tmp_path):
    quantized, _ = models
    out = tmp_path / "converted"
    args = [release, out, "--quantized", "--dtype", "float32"]
    succeeded(run_main("convert", *args, "--numerics", "exact"))
    help_text = succeeded(run_main("convert", "--help")).stdout
    assert "--quantized" in help_text

    def same(a, b):
        leaves_a, leaves_b = jax.tree.leaves(a), jax.tree.leaves(b)
        assert jax.tree.structure(a) == jax.tree.structure(b)
        for x, y in zip(leaves_a, leaves_b, strict=True):
            assert x.dtype == y.dtype
            np.testing.assert_array_equal(
                np.asarray(x).view(np.uint8), np.asarray(y).view(np.uint8)
            )

    same(ed.load(out), quantized)
    ed.save(tmp_path / "saved", quantized)
    same(ed.load(tmp_path / "saved"), quantized)


def test_sharded_quantized_load_splits_whole_blocks(release, models):
    quantized, _ = models
    mesh = ed.make_mesh(tensor=2, expert=4)
    sharded = convert.load_hf(release, quantized=True, mesh=mesh, numerics="exact")
    held = [x for x in jax.tree.leaves(sharded, is_leaf=is_quantized) if is_quantized(x)]
    assert all(w.values.sharding.spec == w.scale.sharding.spec for w in held)
    wo_b = sharded.layers[0].blocks[0].attn.wo_b.weight  # [layers, d_model, groups x rank]
    assert wo_b.shape == (1, 64, 16)
    dense_spec = ed.parallel.ShardingRules().spec(
        (None, "embed", "groups_x_rank"), wo_b.shape, mesh
    )
    assert dense_spec[2] == "tensor"  # a dense weight splits its 16 inputs two ways...
    # ...which would cut its 32-wide blocks (a spec leaves out its unsplit trailing dims).
    assert (*wo_b.values.sharding.spec, None, None, None)[2] is None
    # FP4 experts split in multiples of 32 along both dims, so that w1, w2 and w3 (blocks
    # along different dims) split alike: 64 hidden units two ways.
    w1, w2 = (
        sharded.layers[1].blocks[0].ffn.experts.w1,
        sharded.layers[1].blocks[0].ffn.experts.w2,
    )
    assert w1.values.sharding.spec[1:3] == ("expert", "tensor")  # fsdp: size 1, no split
    assert w2.values.sharding.spec[1] == "expert" and w2.values.sharding.spec[3] == "tensor"
    with jax.set_mesh(mesh):
        logits = forward(sharded, IDS)
    np.testing.assert_allclose(logits, forward(quantized, IDS), **COMPONENT)


def test_fine_tuning_keeps_the_quantized_weights_frozen(getkey):
    config = tiny_config(layer_types=(S, C), num_nextn_predict_layers=0, num_hash_layers=1)
    model = ed.quant.quantize_model(ed.DeepseekV4(config, key=getkey()), block=(32, 32))
    opt = ed.make_optimizer(learning_rate=1e-2)
    state = ed.init_train_state(model, opt)
    ids = jax.random.randint(getkey(), (2, 17), 0, config.vocab_size)
    new, metrics = ed.make_train_step(opt, donate=False)(state, ed.Batch.from_tokens(ids))
    assert np.isfinite(metrics["loss"]) and metrics["grad_norm"] > 0
    before = jax.tree.leaves(model, is_leaf=is_quantized)
    after = jax.tree.leaves(new.model, is_leaf=is_quantized)
    for a, b in zip(before, after, strict=True):
        if is_quantized(a):
            assert is_quantized(b) and b.values.dtype == a.values.dtype
            np.testing.assert_array_equal(np.asarray(a.values), np.asarray(b.values))
            np.testing.assert_array_equal(np.asarray(a.scale), np.asarray(b.scale))
    assert not np.array_equal(np.asarray(model.embed.weight), np.asarray(new.model.embed.weight))


def test_quantized_needs_quantized_weights(tmp_path):
    reference = reference_model(tiny_config(layer_types=(S, C), num_hash_layers=1), seed=2)
    reference.save_pretrained(tmp_path)
    with pytest.raises(ed.CheckpointError, match="quantized=False") as info:
        convert.load_hf(tmp_path, quantized=True, load_mtp=False)
    assert "attn.wq_a.weight" in str(info.value)


def test_fp8_routed_experts_when_the_config_says_so(getkey):
    # The official converter's `--expert-dtype fp8` stores routed experts as FP8 in 128 x 128
    # blocks; `expert_dtype="fp8"` in the config keeps them so.
    config = tiny_config(
        layer_types=(S, C), num_nextn_predict_layers=0, num_hash_layers=1, expert_dtype="fp8"
    )
    abstract = ed.quant.abstract_quantized(
        eqx.filter_eval_shape(ed.DeepseekV4, config, key=getkey())
    )
    w1 = abstract.layers[1].blocks[0].ffn.experts.w1
    assert w1.fmt == "e4m3" and w1.values.dtype == jnp.float8_e4m3fn and w1.block == (128, 128)
    model = ed.quant.quantize_model(ed.DeepseekV4(config, key=getkey()))
    assert jax.tree.structure(model) == jax.tree.structure(abstract)
    ids = IDS[:, :12] % config.vocab_size
    np.testing.assert_allclose(
        forward(model, ids), forward(ed.quant.dequantize_model(model), ids), **COMPONENT
    )
