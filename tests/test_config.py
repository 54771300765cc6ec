"""Config: both flavours of config.json, presets, round trips, and bad configs."""

import dataclasses
import json
import pathlib

import pytest
import transformers
from hf_reference import C, H, S, tiny_config

import equinox_dsv4 as ed
from equinox_dsv4.config import IGNORED_HF_KEYS


DATA = pathlib.Path(__file__).parent / "data"


def test_official_release_configs_match_presets():
    flash = ed.Config.from_json(DATA / "deepseek-v4-flash.config.json")
    # This copy is the initial revision, before the top-level `"expert_dtype": "fp4"` was added.
    assert flash == dataclasses.replace(ed.Config.v4_flash(), expert_dtype=None)
    assert ed.Config.from_json(DATA / "deepseek-v4-pro.config.json") == ed.Config.v4_pro()


def test_flash_preset_values():
    c = ed.Config.v4_flash()
    assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.q_lora_rank) == (
        4096,
        43,
        64,
        1024,
    )
    assert c.layer_types[:3] == (S, S, C) and c.layer_types[3:] == (H, C) * 20
    assert c.mlp_layer_types == (ed.config.HASH_MOE,) * 3 + (ed.config.MOE,) * 40
    assert (c.compress_rate_csa, c.compress_rate_hca) == (4, 128)
    assert c.rope_scaling == ed.config.YarnScaling(
        factor=16.0, original_max_position_embeddings=65536
    )
    assert (c.n_routed_experts, c.num_experts_per_tok, c.routed_scaling_factor) == (256, 6, 1.5)
    assert (c.index_n_heads, c.index_head_dim, c.index_topk) == (64, 128, 512)
    assert c.fp8_block_size == (128, 128) and c.expert_dtype == "fp4"
    p = ed.Config.v4_pro()
    assert p.layer_types[:3] == (H, H, C) and p.layer_types[3:] == (H, C) * 29
    assert (p.hidden_size, p.o_groups, p.n_routed_experts, p.index_topk) == (7168, 16, 384, 1024)


@pytest.mark.parametrize("name", ["deepseek-v4-flash", "deepseek-v4-pro"])
def test_transformers_reading_of_the_release_config_agrees(name):
    # transformers' own legacy-key handling turns the release config into its flavour; ours
    # must read that flavour to the same config.
    raw = json.loads((DATA / f"{name}.config.json").read_text())
    hf_flavour = transformers.DeepseekV4Config(**raw).to_dict()
    assert ed.Config.from_hf(hf_flavour) == ed.Config.from_hf(raw)


@pytest.mark.parametrize(
    "config",
    [
        tiny_config(),
        tiny_config(rope_scaling=None, hc_mult=2),
        ed.Config.v4_flash(),
        ed.Config.v4_pro(),
    ],
)
def test_round_trip_through_transformers(config):
    hf_flavour = transformers.DeepseekV4Config(**config.to_hf()).to_dict()
    assert ed.Config.from_hf(hf_flavour) == config
    assert ed.Config.from_hf(config.to_hf()) == config


def test_overrides_and_json(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(tiny_config().to_hf()))
    config = ed.Config.from_json(path, scan_layers=False)
    assert config == dataclasses.replace(tiny_config(), scan_layers=False)
    with pytest.raises(ValueError, match="unknown Config fields"):
        ed.Config.from_json(path, scan_layerz=False)
    path.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        ed.Config.from_json(path)


def _flash_json():
    return json.loads((DATA / "deepseek-v4-flash.config.json").read_text())


@pytest.mark.parametrize(
    "change,field",
    [
        (dict(layer_types=[S] * 3), "layer_types"),
        (dict(layer_types=[S] * 42 + ["dense_attention"]), "layer_types"),
        (dict(mlp_layer_types=["moe"] * 42 + ["dense"]), "mlp_layer_types"),
        (dict(qk_rope_head_dim=1024), "qk_rope_head_dim"),
        (dict(qk_rope_head_dim=63), "qk_rope_head_dim"),
        (dict(o_groups=7), "o_groups"),
        (dict(num_experts_per_tok=300), "num_experts_per_tok"),
        (dict(n_shared_experts=2), "n_shared_experts"),
        (dict(scoring_func="relu"), "scoring_func"),
        (dict(num_key_value_heads=8), "num_key_value_heads"),
        (dict(hidden_act="gelu"), "hidden_act"),
        (dict(tie_word_embeddings=True), "tie_word_embeddings"),
        (dict(compress_ratios=[0, 4]), "compress_ratios"),
        (dict(compress_ratios=[0] * 43 + [4]), "MTP"),
        (dict(compress_ratios=[0, 0] + [4, 128, 4, 64] * 10 + [4, 0]), "several HCA ratios"),
        (dict(rope_scaling={"type": "linear", "factor": 2}), "rope_type"),
        (dict(rope_scaling={"type": "yarn", "factor": 2}), "original_max_position_embeddings"),
        (dict(quantization_config={"quant_method": "fp8", "bits": 4}), "bits"),
        (dict(quantization_config={"quant_method": "awq"}), "quant_method"),
        (dict(partial_rotary_factor=0.25), "partial_rotary_factor"),
        (dict(vocab_size=0), "vocab_size"),
        (dict(num_hash_layers=5, mlp_layer_types=["hash_moe"] * 3 + ["moe"] * 40), "num_hash"),
    ],
)
def test_bad_configs_name_the_field(change, field):
    raw = _flash_json()
    raw.update(change)
    with pytest.raises(ValueError, match=field):
        ed.Config.from_hf(raw)


def test_unknown_keys_are_listed():
    raw = _flash_json()
    raw.update(foo=1, dspark_layers=2)
    with pytest.raises(ValueError, match=r"unknown config keys: \['dspark_layers', 'foo'\]"):
        ed.Config.from_hf(raw)
    # Bookkeeping keys are documented as ignored.
    raw = _flash_json()
    raw.update(torch_dtype="bfloat16", architectures=["X"], use_cache=False)
    ed.Config.from_hf(raw)
    assert "transformers_version" in IGNORED_HF_KEYS


def test_direct_construction_validates():
    with pytest.raises(ValueError, match="layer_types has 2 entries"):
        dataclasses.replace(tiny_config(), layer_types=(S, S))
    with pytest.raises(ValueError, match="o_groups"):
        dataclasses.replace(tiny_config(), o_groups=3)
    with pytest.raises(ValueError, match="scan_min_repeats"):
        dataclasses.replace(tiny_config(), scan_min_repeats=1)
    assert tiny_config().compress_ratio(0) == 0 and tiny_config().compress_ratio(3) == 8


def test_first_layers_keeps_the_prefix_and_rejects_bad_counts():
    config = ed.Config.tiny()
    short = config.first_layers(3)
    assert short.num_hidden_layers == 3
    assert short.layer_types == config.layer_types[:3]
    assert short.mlp_layer_types == config.mlp_layer_types[:3]
    assert short.num_nextn_predict_layers == config.num_nextn_predict_layers
    for bad in (0, config.num_hidden_layers + 1):
        with pytest.raises(ValueError, match=rf"layers must be in 1\.\.9, got {bad}"):
            config.first_layers(bad)


def test_every_field_has_one_place_in_config_json():
    # The field list is written once (`Config`'s fields): every field is its own config.json key
    # ("plain"), read and written by `_hf_config` ("custom"), or an execution setting (None).
    config = dataclasses.replace(
        tiny_config(),
        fp8_block_size=(128, 128),
        expert_dtype="fp4",
        dspark_block_size=5,
        dspark_markov_rank=8,
        dspark_target_layer_ids=(6, 7, 8),
        dspark_noise_token_id=3,
    )
    assert config.dspark_stages == 3  # the releases' count, when nothing says otherwise
    assert not any(k.startswith("dspark") for k in tiny_config().to_hf())
    written = config.to_hf()
    for field in dataclasses.fields(ed.Config):
        kind = field.metadata["hf"]
        assert kind in ("plain", "custom", None), field.name
        if kind == "plain":
            assert written[field.name] == getattr(config, field.name), field.name
        elif kind is None:
            assert field.name not in written, field.name
    assert ed.Config.from_hf(written) == config
    # An execution setting is an override, never a config.json key.
    with pytest.raises(ValueError, match=r"unknown config keys: \['scan_layers'\]"):
        ed.Config.from_hf({**written, "scan_layers": False})
    # Ints are widened for float fields, and bad values name the field.
    assert ed.Config.from_hf({**written, "hc_eps": 1}).hc_eps == 1.0
    for name, value in (("routed_scaling_factor", 0.0), ("num_nextn_predict_layers", -1)):
        with pytest.raises(ValueError, match=name):
            dataclasses.replace(config, **{name: value})
