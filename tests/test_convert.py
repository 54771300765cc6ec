"""The converter: transformers-saved and release-layout checkpoints, dequantisation by hand,
sharded loading, orbax round trips, and every kind of bad input."""

import json
import os
import pathlib
import shutil
import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
import transformers
from helpers import COMPONENT, LOGITS, compiled_collectives, run_main, run_python, succeeded
from hf_reference import C, H, S, reference_logits, reference_model, tiny_config
from jax.sharding import NamedSharding, PartitionSpec as P
from release_layout import hf_state_from_canonical, write_release_checkpoint

import convert
import equinox_dsv4 as ed
from convert.reader import write_safetensors


# hca ratio 128 (transformers reads only 0 / 4 / 128 in a release config's compress_ratios).
CONFIG = tiny_config(layer_types=(S, S, C, H, C), compress_rate_hca=128)
IDS = np.random.default_rng(0).integers(0, CONFIG.vocab_size, (2, 140))


def logits(model, ids=IDS):
    return np.asarray(eqx.filter_jit(model)(jnp.asarray(ids, jnp.int32)))


# ---------------------------------------------------------------------------------------------
# fixtures


@pytest.fixture(scope="module")
def reference():
    # transformers' default config announces one MTP layer; its model has none.
    assert transformers.DeepseekV4Config().num_nextn_predict_layers == 1
    assert CONFIG.num_nextn_predict_layers == 1
    return reference_model(CONFIG, seed=21)


@pytest.fixture(scope="module")
def hf_saved(tmp_path_factory, reference):
    path = tmp_path_factory.mktemp("hf_saved")
    reference.save_pretrained(path, max_shard_size="200KB")
    assert json.loads((path / "config.json").read_text())["num_nextn_predict_layers"] == 1
    return path


def load_saved(path, **kwargs):
    """`convert.load_hf` on a transformers-saved checkpoint, which announces an MTP block it
    does not hold: loaded without it, with a warning."""
    with pytest.warns(convert.MTPSkippedWarning, match="MTP block is absent"):
        return convert.load_hf(path, **kwargs)


@pytest.fixture(scope="module")
def release(tmp_path_factory, reference):
    path = tmp_path_factory.mktemp("release")
    expected = write_release_checkpoint(path, CONFIG, reference, shards=3)
    return path, expected


@pytest.fixture(scope="module")
def release_reference_logits(release, reference):
    """transformers' model on the dequantised release weights."""
    _, expected = release
    dequantised = reference_model(CONFIG, seed=21)
    dequantised.load_state_dict(hf_state_from_canonical(expected, reference))
    return reference_logits(dequantised, IDS)


# ---------------------------------------------------------------------------------------------
# dequantisation by hand (the converter's: `equinox_dsv4.quant.dequantize_host`)


def dequantize_fp4(packed, scale):
    return ed.quant.dequantize_host(packed, scale)


def dequantize_fp8(q, scale, block=(128, 128)):
    return ed.quant.dequantize_host(q, scale, block)


def test_all_sixteen_fp4_nibbles():
    # byte = high << 4 | low; low nibble is the even column.
    lut = [0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6]
    packed = np.array([[(15 - n) << 4 | n for n in range(16)]], np.uint8).view(np.int8)
    values = dequantize_fp4(packed, np.full((1, 1), 127, np.uint8))  # scale 2^0
    np.testing.assert_array_equal(values[0, 0::2], lut)
    np.testing.assert_array_equal(values[0, 1::2], lut[::-1])
    assert np.signbit(values[0, 16]) and values[0, 16] == 0  # nibble 8 is -0


def test_fp4_scales_per_32_inputs():
    packed = np.full((2, 32), 0x72, np.uint8).view(np.int8)  # low 2 -> 1.0, high 7 -> 6.0
    scale = np.array([[127, 129], [120, 130]], np.uint8).view(ml_dtypes.float8_e8m0fnu)
    w = dequantize_fp4(packed, scale)
    assert w.shape == (2, 64)
    np.testing.assert_array_equal(w[0, :32:2], 1.0)
    np.testing.assert_array_equal(w[0, 1:32:2], 6.0)
    np.testing.assert_array_equal(w[0, 32::2], 4.0)  # 2^(129-127)
    np.testing.assert_array_equal(w[1, :32:2], 2.0**-7)
    np.testing.assert_array_equal(w[1, 33::2], 6.0 * 8)


def test_fp8_block_scales_non_multiple_of_128():
    q = np.full((200, 130), 1.5, np.float32).astype(ml_dtypes.float8_e4m3fn)
    exps = np.array([[127, 128], [126, 131]], np.uint8)
    w = dequantize_fp8(q, exps.view(ml_dtypes.float8_e8m0fnu))
    assert w.shape == (200, 130)
    np.testing.assert_array_equal(w[:128, :128], 1.5)
    np.testing.assert_array_equal(w[:128, 128:], 3.0)
    np.testing.assert_array_equal(w[128:, :128], 0.75)
    np.testing.assert_array_equal(w[128:, 128:], 1.5 * 16)
    # Float (transformers' weight_scale_inv) and raw uint8 exponents mean the same.
    np.testing.assert_array_equal(dequantize_fp8(q, exps), w)
    np.testing.assert_array_equal(dequantize_fp8(q, np.exp2(exps - 127.0)), w)


def test_fp8_values_are_exact():
    q = np.array([[448.0, -0.015625, 0.001953125]]).astype(ml_dtypes.float8_e4m3fn)
    w = dequantize_fp8(q, np.array([[2.0**-3]], np.float32))
    np.testing.assert_array_equal(w, [[56.0, -0.001953125, 0.000244140625]])


# ---------------------------------------------------------------------------------------------
# loading


def test_transformers_saved_checkpoint(hf_saved, reference):
    assert (hf_saved / "model.safetensors.index.json").is_file()
    model = load_saved(hf_saved)  # default arguments
    assert not model.mtp and model.config.num_nextn_predict_layers == 0
    np.testing.assert_allclose(logits(model), reference_logits(reference, IDS), **LOGITS)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # asked for no MTP: nothing to warn about
        assert not convert.load_hf(hf_saved, load_mtp=False).mtp


def test_transformers_saved_checkpoint_with_mtp_required(hf_saved):
    with pytest.raises(convert.CheckpointError, match="load_mtp=True, but this transformers"):
        convert.load_hf(hf_saved, load_mtp=True)


def test_transformers_saved_checkpoint_cli(hf_saved, reference, tmp_path):
    out = tmp_path / "out"
    result = _cli(hf_saved, out, "--quiet", "--dtype", "float32")
    assert result.returncode == 0, result.stderr
    warning = [line for line in result.stderr.splitlines() if "MTP" in line]
    assert len(warning) == 1 and warning[0].startswith("warning: the MTP block is absent")
    model = ed.load(out)
    assert not model.mtp
    np.testing.assert_allclose(logits(model), reference_logits(reference, IDS), **LOGITS)


def test_release_layout_without_its_mtp_is_an_error(release, tmp_path):
    bad = _copy(release, tmp_path)
    weight_map = json.loads((bad / "model.safetensors.index.json").read_text())["weight_map"]
    by_shard = {f: n for n, f in weight_map.items() if n.startswith("mtp.")}
    assert by_shard
    for name in by_shard.values():  # one name per shard: drops every MTP tensor of the shard
        _rewrite_shard(bad, name, lambda t: [t.pop(n) for n in list(t) if n.startswith("mtp.")])
    for load_mtp in (None, True):
        with pytest.raises(convert.CheckpointError) as info:
            convert.load_hf(bad, load_mtp=load_mtp)
        assert "announces 1 MTP layer(s)" in str(info.value)
        assert "load_mtp=False" in str(info.value) and "--no-mtp" in str(info.value)
    result = _cli(bad, tmp_path / "out", "--quiet")
    assert result.returncode == 1 and "--no-mtp" in result.stderr
    assert not convert.load_hf(bad, load_mtp=False).mtp
    # Some of the MTP block missing: each missing tensor listed, and the same hint.
    partial = _copy(release, tmp_path / "partial")
    _rewrite_shard(partial, "mtp.0.e_proj.weight", lambda t: t.pop("mtp.0.e_proj.weight"))
    with pytest.raises(convert.CheckpointError) as info:
        convert.load_hf(partial)
    assert "missing tensor for .mtp[0].e_proj.weight" in str(info.value)
    assert "--no-mtp" in str(info.value)


def test_release_layout(release, release_reference_logits):
    path, expected = release
    assert len(list(path.glob("*.safetensors"))) == 3
    model = convert.load_hf(path, numerics="exact")  # transformers' numerics
    np.testing.assert_allclose(logits(model), release_reference_logits, **LOGITS)
    # The MTP weights land in the MTP block, dequantised.
    np.testing.assert_array_equal(model.mtp[0].e_proj.weight, expected["mtp.0.e_proj.weight"])
    np.testing.assert_array_equal(
        model.mtp[0].block.ffn.experts.w2[3], expected["mtp.0.ffn.experts.3.w2.weight"]
    )
    default = convert.load_hf(path, load_mtp=False)
    assert not default.mtp and default.config.numerics == "release"


def test_transformers_reads_the_release_fixture_the_same(release, release_reference_logits):
    path, _ = release
    model = transformers.DeepseekV4ForCausalLM.from_pretrained(
        path,
        quantization_config=transformers.FineGrainedFP8Config(dequantize=True),
        dtype=torch.float32,
    ).eval()
    np.testing.assert_allclose(reference_logits(model, IDS), release_reference_logits, **LOGITS)


def test_sharded_load_on_eight_devices(release):
    path, _ = release
    mesh = jax.make_mesh((2, 4), ("fsdp", "expert"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    sharded = convert.load_hf(path, mesh=mesh, numerics="exact")
    expected = ed.parallel.partition_specs(sharded, mesh)
    for leaf, spec in zip(
        jax.tree.leaves(sharded),
        jax.tree.leaves(expected, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec)),
        strict=True,
    ):
        assert isinstance(leaf.sharding, NamedSharding) and leaf.sharding.spec == spec
    w1 = sharded.layers[3].blocks[0].ffn.experts.w1
    assert w1.sharding.spec == P(None, "expert", "fsdp")  # [1, experts, inter, d_model]
    assert w1.addressable_shards[0].data.shape == (1, 2, 8, 32)
    single = convert.load_hf(path, numerics="exact")
    np.testing.assert_allclose(logits(sharded), logits(single), **COMPONENT)


# ---------------------------------------------------------------------------------------------
# saved models


def test_convert_then_load_is_bit_exact(release, tmp_path):
    path, _ = release
    out = tmp_path / "converted"
    summary = convert.convert(path, out, dtype=jnp.bfloat16)
    assert summary["tensors"] > 0 and summary["bytes"] > 0 and summary["peak_rss_bytes"] > 0
    loaded = ed.load(out)
    direct = convert.load_hf(path, dtype=jnp.bfloat16)
    for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(direct), strict=True):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert loaded.config.numerics == direct.config.numerics == "release"
    assert loaded.layers[0].blocks[0].attn.wq_a.weight.dtype == jnp.bfloat16
    assert loaded.layers[0].blocks[0].attn.attn_sink.dtype == jnp.float32
    # On the README's mesh: each routed expert's pieces split over `fsdp`, their stack over
    # `expert`. Each device stacks its own experts' pieces: no program of the load sends
    # anything between devices. (Partitioned whole, the stacking took several independent
    # all-to-alls, which XLA:CPU's devices could enter in different orders and then wait on
    # each other for ever.)
    mesh = jax.make_mesh((2, 4), ("fsdp", "expert"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    with compiled_collectives() as programs:
        sharded = ed.load(out, mesh=mesh)
    assert programs and not [p for p in programs if p[1]], programs
    assert sharded.layers[-1].blocks[-1].ffn.experts.w1.sharding.spec == P(None, "expert", "fsdp")
    for a, b in zip(jax.tree.leaves(sharded), jax.tree.leaves(loaded), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_save_load_round_trip_and_sharded_load(tmp_path, hf_saved):
    model = load_saved(hf_saved)
    ed.save(tmp_path / "saved", model)
    loaded = ed.load(tmp_path / "saved")
    for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(model), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    mesh = jax.make_mesh((8,), ("expert",), axis_types=(jax.sharding.AxisType.Auto,))
    sharded = ed.load(tmp_path / "saved", mesh=mesh)
    assert sharded.layers[4].blocks[0].ffn.experts.w3.sharding.spec == P(None, "expert")
    for a, b in zip(jax.tree.leaves(sharded), jax.tree.leaves(model), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(FileExistsError):
        ed.save(tmp_path / "saved", model)
    with pytest.raises(FileNotFoundError, match="not a saved equinox_dsv4 model"):
        ed.load(hf_saved)


def test_cli(release, tmp_path):
    path, _ = release
    out = tmp_path / "cli"
    result = _cli(path, out, "--layers", "3", "--no-mtp", "--dtype", "float32")
    assert result.returncode == 0, result.stderr
    assert "converted" in result.stderr and "peak RSS" in result.stderr
    model = ed.load(out)
    assert model.config.num_hidden_layers == 3 and not model.mtp
    assert model.layers[0].blocks[0].attn.wq_a.weight.dtype == jnp.float32
    # `python -m convert` as a process (the others run its `main` in this one).
    help_text = succeeded(run_python("-m", "convert", "--help")).stdout
    assert "--no-mtp" in help_text and "--layers" in help_text


def _cli(*args):
    return run_main("convert", *args)


# ---------------------------------------------------------------------------------------------
# bad inputs: one error naming every problem, non-zero exit, no output directory


def _copy(release, tmp_path) -> pathlib.Path:
    path, _ = release
    bad = tmp_path / "bad"
    shutil.copytree(path, bad)
    return bad


def _shard_of(bad: pathlib.Path, name: str) -> pathlib.Path:
    weight_map = json.loads((bad / "model.safetensors.index.json").read_text())["weight_map"]
    return bad / weight_map[name]


def _rewrite_shard(bad: pathlib.Path, name: str, edit) -> None:
    from convert.reader import list_tensors, read_tensor

    shard = _shard_of(bad, name)
    tensors = {
        n: read_tensor(info) for n, info in list_tensors(bad, []).items() if info.file == shard
    }
    edit(tensors)
    index_path = bad / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"] = {
        n: f for n, f in index["weight_map"].items() if f != shard.name or n in tensors
    } | {n: shard.name for n in tensors}
    index_path.write_text(json.dumps(index))
    write_safetensors(shard, tensors)


def _set(name, value):
    def edit(tensors):
        tensors[name] = value

    return edit


BAD_INPUTS = {
    "missing": (
        lambda bad: _rewrite_shard(
            bad, "layers.1.attn.wkv.weight", lambda t: t.pop("layers.1.attn.wkv.weight")
        ),
        [
            "missing tensor for .layers[1].blocks[0].attn.wkv.weight",
            "'layers.1.attn.wkv.scale': a scale without its weight 'layers.1.attn.wkv.weight'",
        ],
    ),
    "unexpected": (
        lambda bad: _rewrite_shard(
            bad, "norm.weight", _set("layers.0.attn.extra.weight", np.ones(3, np.float32))
        ),
        ["unexpected tensor 'layers.0.attn.extra.weight'"],
    ),
    "wrong_shape": (
        lambda bad: _rewrite_shard(
            bad, "norm.weight", _set("norm.weight", np.ones(7, ml_dtypes.bfloat16))
        ),
        ["'norm.weight': expected shape [32], found [7]"],
    ),
    "wrong_dtype": (
        lambda bad: _rewrite_shard(
            bad,
            "layers.0.ffn.gate.tid2eid",
            _set("layers.0.ffn.gate.tid2eid", np.zeros((97, 2), np.float32)),
        ),
        ["'layers.0.ffn.gate.tid2eid': expected an integer dtype"],
    ),
    "fp8_without_scale": (
        lambda bad: _rewrite_shard(
            bad, "layers.0.attn.wq_a.scale", lambda t: t.pop("layers.0.attn.wq_a.scale")
        ),
        ["'layers.0.attn.wq_a.weight': float8_e4m3fn weight without a scale"],
    ),
    "bad_scale_shape": (
        lambda bad: _rewrite_shard(
            bad,
            "layers.3.ffn.experts.0.w1.scale",
            _set("layers.3.ffn.experts.0.w1.scale", np.ones((16, 2), ml_dtypes.float8_e8m0fnu)),
        ),
        ["'layers.3.ffn.experts.0.w1.scale': expected scale shape [16, 1], found [16, 2]"],
    ),
    "truncated": (
        lambda bad: os.truncate(
            _shard_of(bad, "embed.weight"), _shard_of(bad, "embed.weight").stat().st_size - 100
        ),
        ["truncated"],
    ),
    "corrupt_header": (
        lambda bad: _shard_of(bad, "embed.weight").write_bytes(
            (32).to_bytes(8, "little") + b"{not json" + b"." * 23 + b"data"
        ),
        ["corrupt header"],
    ),
    "missing_shard": (
        lambda bad: _shard_of(bad, "embed.weight").unlink(),
        ["names shard", "which does not exist"],
    ),
    "config_disagrees": (
        lambda bad: (bad / "config.json").write_text(
            json.dumps({**json.loads((bad / "config.json").read_text()), "hidden_size": 48})
        ),
        ["'embed.weight': expected shape [97, 48], found [97, 32]"],
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input(release, tmp_path, case):
    corrupt, messages = BAD_INPUTS[case]
    bad = _copy(release, tmp_path)
    corrupt(bad)
    out = tmp_path / "out"
    with pytest.raises((convert.CheckpointError, ValueError)) as info:
        convert.convert(bad, out)
    for message in messages:
        assert message in str(info.value)
    assert not out.exists() and not list(tmp_path.glob("out.tmp-*"))
    with pytest.raises((convert.CheckpointError, ValueError)):
        convert.load_hf(bad)


@pytest.mark.parametrize("case", ["missing", "truncated"])
def test_bad_input_cli_exit_status(release, tmp_path, case):
    corrupt, messages = BAD_INPUTS[case]
    bad = _copy(release, tmp_path)
    corrupt(bad)
    out = tmp_path / "out"
    result = _cli(bad, out, "--quiet")
    assert result.returncode == 1
    assert messages[0] in result.stderr
    assert not out.exists()


def test_many_problems_are_reported_together(release, tmp_path):
    bad = _copy(release, tmp_path)
    for case in ("missing", "wrong_shape", "unexpected"):
        BAD_INPUTS[case][0](bad)
    with pytest.raises(convert.CheckpointError) as info:
        convert.load_hf(bad)
    assert len(info.value.problems) == 4  # the missing weight also orphans its scale


def test_pickles_are_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(CONFIG.to_hf()))
    (tmp_path / "pytorch_model.bin").write_bytes(b"not really a pickle")
    with pytest.raises(ValueError, match="refusing to load them, unpickling runs arbitrary code"):
        convert.load_hf(tmp_path)
    result = _cli(tmp_path, tmp_path / "out", "--quiet")
    assert result.returncode == 1 and "pytorch_model.bin" in result.stderr


def test_existing_output_is_not_touched(release, tmp_path):
    path, _ = release
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep").write_text("x")
    with pytest.raises(FileExistsError):
        convert.convert(path, tmp_path / "out")
    assert (tmp_path / "out" / "keep").read_text() == "x"


def test_failure_mid_way_leaves_nothing(release, tmp_path):
    bad = _copy(release, tmp_path)
    # Valid headers, but a weight full of NaN: found only while reading the data.
    _rewrite_shard(bad, "norm.weight", _set("norm.weight", np.full(32, np.nan, ml_dtypes.bfloat16)))
    with pytest.raises(convert.CheckpointError, match="NaN"):
        convert.convert(bad, tmp_path / "out")
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob("out.tmp-*"))
