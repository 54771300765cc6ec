"""HCA and CSA compressors and the Lightning Indexer against transformers."""

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
)
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf

import equinox_dsv4 as ed


# 3: shorter than one block; 13, 37: not multiples of the ratios; 37 with index_topk 3 leaves
# more visible CSA blocks than the indexer keeps.
LENGTHS = [3, 13, 37]


def _inputs(key, config, batch, seq):
    x_key, q_key = jax.random.split(key)
    x = jax.random.normal(x_key, (batch, seq, config.hidden_size))
    qr = jax.random.normal(q_key, (batch, seq, config.q_lora_rank))
    positions = torch.arange(seq).expand(batch, seq)
    return x, qr, positions


@pytest.mark.parametrize("seq", LENGTHS + [8, 24])
def test_hca_compressor_matches_reference(getkey, seq):
    config = tiny_config()
    reference = randomize(hf.DeepseekV4HCACompressor(hf_config(config)), seed=seq)
    ours = load_component(
        abstract(ed.nn.HCACompressor, config, config.head_dim),
        reference,
        "model.layers.3.self_attn.compressor.",
        ".attn.compressor",
    )
    x, qr, positions = _inputs(getkey(), config, 2, seq)
    expected, _ = reference(to_torch(x), to_torch(qr), positions, None, 3)
    entries = eqx.filter_jit(ours)(x)
    assert entries.shape == (2, seq // 8, config.head_dim)
    np.testing.assert_allclose(entries, to_numpy(expected[:, 0]), **COMPONENT)


@pytest.mark.parametrize("seq", LENGTHS + [4, 16])
def test_csa_compressor_matches_reference(getkey, seq):
    config = tiny_config()
    reference = randomize(hf.DeepseekV4CSACompressor(hf_config(config)), seed=seq)
    ours = load_component(
        abstract(ed.nn.CSACompressor, config, config.head_dim),
        reference.eval(),
        "model.layers.2.self_attn.compressor.",
        ".attn.compressor",
        skip="indexer.",  # ours keeps the indexer beside the compressor, not inside it
    )
    x, qr, positions = _inputs(getkey(), config, 2, seq)
    expected, _ = reference(to_torch(x), to_torch(qr), positions, None, 2)
    entries = eqx.filter_jit(ours)(x)
    assert entries.shape == (2, seq // 4, config.head_dim)
    np.testing.assert_allclose(entries, to_numpy(expected[:, 0]), **COMPONENT)


def test_csa_first_window_has_no_predecessor(getkey):
    # Entry 0 pools only Cb of block 0: with Ca of block 0 scaled up, entry 0 is unchanged and
    # entry 1 (which pools Ca of block 0) moves.
    config = tiny_config()
    comp = random_fill(abstract(ed.nn.CSACompressor, config, config.head_dim), 0)
    x = jax.random.normal(getkey(), (1, 8, config.hidden_size))
    base = comp(x)
    d = config.head_dim
    changed = eqx.tree_at(lambda c: c.wkv.weight, comp, comp.wkv.weight.at[:d].multiply(3.0))
    moved = changed(x)
    np.testing.assert_allclose(moved[:, 0], base[:, 0], rtol=1e-6)
    assert not np.allclose(moved[:, 1], base[:, 1])


def _indexer_pair(getkey, config, seed):
    reference = randomize(hf.DeepseekV4Indexer(hf_config(config)), seed=seed)
    ours = load_component(
        abstract(ed.nn.LightningIndexer, config),
        reference,
        "model.layers.2.self_attn.compressor.indexer.",
        ".attn.indexer",
    )
    return reference, ours


def assert_same_selection(ours, theirs, scores):
    """Per query: the same number of sentinels, and the same multiset of reference scores over
    the picked entries (so picks may differ only between exactly tied entries)."""
    ours, theirs = np.asarray(ours), np.asarray(theirs)
    assert ours.shape == theirs.shape
    for idx in np.ndindex(ours.shape[:-1]):
        a, b = ours[idx], theirs[idx]
        assert (a < 0).sum() == (b < 0).sum(), (idx, a, b)
        sa = np.sort(scores[idx][a[a >= 0]])
        sb = np.sort(scores[idx][b[b >= 0]])
        np.testing.assert_array_equal(sa, sb, err_msg=f"query {idx}: {a} vs {b}")


def _reference_picks_and_scores(reference, x, qr, positions):
    """The reference indexer's picks, and the scores its scorer computed (None when it had no
    blocks to score)."""
    captured = []
    scorer = reference.scorer.forward
    reference.scorer.forward = lambda *a: captured.append(scorer(*a)) or captured[-1]
    picks = reference(to_torch(x), to_torch(qr), positions, None, 2)
    return picks, to_numpy(captured[0]) if captured else None


@pytest.mark.parametrize("seq", LENGTHS)
def test_indexer_matches_reference(getkey, seq):
    config = tiny_config()
    reference, ours = _indexer_pair(getkey, config, seed=seq)
    x, qr, positions = _inputs(getkey(), config, 2, seq)
    expected, ref_scores = _reference_picks_and_scores(reference, x, qr, positions)
    picked = eqx.filter_jit(ours)(x, qr)
    k = min(config.index_topk, seq // 4)
    assert picked.shape == (2, seq, k) and picked.dtype == jnp.int32
    if k == 0:
        assert expected.shape[-1] == 0
        return
    keys = eqx.filter_jit(ours.compressor)(x)
    pos = jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), (2, seq))
    scores = eqx.filter_jit(ours.scores)(x, qr, keys, pos)
    np.testing.assert_allclose(scores, ref_scores, **COMPONENT)
    assert_same_selection(picked, to_numpy(expected), ref_scores)
    # Sentinels exactly where a query sees fewer than k blocks.
    visible = (np.arange(seq) + 1) // 4
    np.testing.assert_array_equal((np.asarray(picked) < 0).sum(-1)[0], np.maximum(k - visible, 0))


@pytest.mark.parametrize("queries", [1, 2, 8])
def test_indexer_scores_of_a_few_queries(getkey, queries):
    # Up to `LightningIndexer.FEW_QUERIES` queries (decoding) the scores are computed in
    # another layout: the last queries of a sequence against all its keys, as the reference
    # scores them.
    config = tiny_config()
    seq = 37
    reference, ours = _indexer_pair(getkey, config, seed=queries)
    x, qr, positions = _inputs(getkey(), config, 2, seq)
    assert queries <= ed.nn.LightningIndexer.FEW_QUERIES
    _, ref_scores = _reference_picks_and_scores(reference, x, qr, positions)
    keys = eqx.filter_jit(ours.compressor)(x)
    last = slice(seq - queries, seq)
    pos = jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), (2, seq))[:, last]
    scores = eqx.filter_jit(ours.scores)(x[:, last], qr[:, last], keys, pos)
    np.testing.assert_allclose(scores, ref_scores[:, last], **COMPONENT)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_indexer_decode_scores_read_the_keys_as_stored(dtype):
    # A decoded token's scores against all the keys: with the keys as the product's columns
    # XLA:CPU copied them transposed (bf16: converted to float32) on every token, float32 1.9x
    # slower at 4k keys and 3.3x at 16k (benchmarks/archive/NOTES.md, item 33). The temporaries must
    # stay below the keys' own size: here 1 MiB of float32 keys, 128 KiB of scores.
    config = tiny_config(index_n_heads=8, index_head_dim=64)
    indexer = abstract(ed.nn.LightningIndexer, config, dtype=dtype)
    blocks = 4096

    def spec(*shape, dt=dtype):
        return jax.ShapeDtypeStruct(shape, dt)

    args = (spec(1, 1, config.hidden_size), spec(1, 1, config.q_lora_rank))
    args += (spec(1, blocks, config.index_head_dim), spec(1, 1, dt=jnp.int32))
    step = jax.jit(lambda m, *a: m.scores(*a)).lower(indexer, *args).compile()
    keys = blocks * config.index_head_dim * jnp.dtype(dtype).itemsize
    assert step.memory_analysis().temp_size_in_bytes < keys / 2
