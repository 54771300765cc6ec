"""The decoder block (mHC + attention + MoE) against transformers' decoder layer."""

import equinox as eqx
import jax
import numpy as np
import pytest
import torch
from helpers import COMPONENT
from hf_reference import (
    abstract,
    hf_config,
    load_component,
    randomize,
    tiny_config,
    to_numpy,
    to_torch,
    window_mask,
)
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf

import equinox_dsv4 as ed


# tiny_config layers: 0 sliding/hash, 2 CSA/hash, 3 HCA/learned, 4 CSA/learned.
@pytest.mark.parametrize("layer", [0, 2, 3, 4])
@pytest.mark.parametrize("hc_mult", [2, 4])
def test_block_matches_reference(getkey, layer, hc_mult):
    config = tiny_config(hc_mult=hc_mult)
    hf_cfg = hf_config(config)
    reference = randomize(hf.DeepseekV4DecoderLayer(hf_cfg, layer), seed=layer).eval()
    rotary = hf.DeepseekV4RotaryEmbedding(hf_cfg)
    kind = (config.layer_types[layer], config.mlp_layer_types[layer])
    ours = load_component(
        abstract(ed.nn.Block, config, *kind), reference, f"model.layers.{layer}.", ""
    )
    b, s = 2, 29
    x = jax.random.normal(getkey(), (b, s, hc_mult, config.hidden_size))
    ids = jax.random.randint(getkey(), (b, s), 0, config.vocab_size)
    xt = to_torch(x)
    positions = torch.arange(s).expand(b, s)
    with torch.no_grad():
        expected = reference(
            xt,
            input_ids=to_torch(ids).long(),
            position_embeddings={
                label: rotary(xt, positions, layer_type=label) for label in ("main", "compress")
            },
            position_ids=positions,
            attention_mask=window_mask(s, config.sliding_window, b),
        )
    out = eqx.filter_jit(ours)(x, ids)
    np.testing.assert_allclose(out, to_numpy(expected), **COMPONENT)
