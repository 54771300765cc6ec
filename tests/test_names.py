"""The converter's name table and `convert.fill`: every name maps, per-expert (official) and
stacked (transformers) expert tensors fill the same leaves, and bad inputs are reported at once."""

import dataclasses

import equinox as eqx
import jax
import numpy as np
import pytest
from hf_reference import reference_model, tiny_config

import convert
import equinox_dsv4 as ed
from equinox_dsv4.ckpt import CheckpointError, canonical_to_path


@pytest.fixture(scope="module")
def setup():
    config = dataclasses.replace(tiny_config(), num_nextn_predict_layers=0)
    reference = reference_model(config, seed=11)
    skeleton = eqx.filter_eval_shape(ed.DeepseekV4, config, key=jax.random.key(0))
    canonical = []
    for key, tensor in reference.state_dict().items():
        targets = convert.hf_to_canonical(key)
        assert targets is not None, key
        canonical += [(name, f(tensor.numpy())) for name, f in targets]
    return skeleton, dict(canonical)


def test_every_canonical_name_has_a_leaf(setup):
    skeleton, tensors = setup
    leaves = {jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(skeleton)[0]}
    for name in tensors:
        path, _ = canonical_to_path(name, skeleton.plan)
        assert path in leaves, name


def test_official_per_expert_names_fill_the_same_model(setup):
    skeleton, tensors = setup
    stacked = convert.fill(skeleton, tensors.items())
    per_expert = {}
    for name, value in tensors.items():
        if ".ffn.experts.w" in name:
            layer, w = name.rsplit(".", 1)
            for e in range(value.shape[0]):
                per_expert[f"{layer[: -len('.experts')]}.experts.{e}.{w}.weight"] = value[e]
        else:
            per_expert[name] = value
    official = convert.fill(skeleton, per_expert.items())
    for a, b in zip(jax.tree.leaves(stacked), jax.tree.leaves(official), strict=True):
        np.testing.assert_array_equal(a, b)
    # A scanned layer's slice holds that layer's weights.
    seg, pos, rep = stacked.plan.locate(6)
    np.testing.assert_array_equal(
        stacked.layers[seg].blocks[pos].attn.wq_a.weight[rep], tensors["layers.6.attn.wq_a.weight"]
    )


def test_fill_reports_every_problem_and_returns_nothing(setup):
    skeleton, tensors = setup
    bad = dict(tensors)
    del bad["layers.4.attn.wkv.weight"]
    bad["layers.0.attn.wq_a.weight"] = np.zeros((3, 3), np.float32)
    bad["layers.0.ffn.gate.tid2eid"] = bad["layers.0.ffn.gate.tid2eid"].astype(np.float32)
    bad["layers.99.attn.wq_a.weight"] = np.zeros((1,), np.float32)
    bad["mystery.weight"] = np.zeros((1,), np.float32)
    items = list(bad.items()) + [("layers.1.attn_norm.weight", bad["layers.1.attn_norm.weight"])]
    with pytest.raises(CheckpointError) as info:
        convert.fill(skeleton, items)
    problems = "\n".join(info.value.problems)
    assert "missing tensor for .layers[3].blocks[1].attn.wkv.weight" in problems
    assert "'layers.0.attn.wq_a.weight': expected shape [16, 32], found [3, 3]" in problems
    assert "'layers.0.ffn.gate.tid2eid': expected an integer dtype like int32" in problems
    assert "unexpected tensor 'layers.99.attn.wq_a.weight'" in problems
    assert "unexpected tensor 'mystery.weight'" in problems
    assert "written twice" in problems
    assert len(info.value.problems) == 6
