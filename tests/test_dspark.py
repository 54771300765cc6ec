"""The DSpark drafter against a float32 torch port written from the release's description
(`dspark_reference.py`): the trunk's context taps, the block logits after the Markov
correction, the greedy drafts and the confidences, for prompts shorter and longer than the
stages' ring."""

import dataclasses
import json
import shutil
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from dspark_reference import Drafter, trunk_taps
from helpers import (
    COMPONENT,
    assert_close,
    assert_draws_from,
    generate_streamed,
    run_main,
    succeeded,
)
from hf_reference import FIVE_LAYERS, abstract, random_fill, reference_model, tiny_config
from release_layout import write_release_checkpoint

import convert
import equinox_dsv4 as ed
from convert.names import hf_to_canonical
from convert.reader import list_tensors, read_tensor, write_safetensors
from equinox_dsv4 import serve


# Five layers (a sliding hash-routed one, then a scanned (CSA, HCA) period), 8 index heads (see
# test_generate); the drafter reads layers 2 (inside the scan's first repeat), 3 and 4 (its
# second), as the release reads its last three. Window 8: a ring of 8 context rows.
CONFIG = tiny_config(
    **FIVE_LAYERS,
    index_n_heads=8,
    eos_token_id=None,
    dspark_block_size=5,
    dspark_markov_rank=8,
    dspark_target_layer_ids=(2, 3, 4),
    dspark_noise_token_id=96,
    dspark_stages=3,
)
TRUNK = CONFIG.trunk_only()
# Shorter than the ring, and longer (the ring wrapped twice).
PROMPTS = [[5, 17, 33, 2, 71], [(7 * i + 3) % 97 for i in range(21)]]
ANCHORS = [40, 88]


def load(config: ed.Config, trunk, drafter: Drafter) -> ed.DeepseekV4:
    """Our model with the trunk's and the drafter's weights, by their release names."""
    tensors = {}
    for key, tensor in trunk.state_dict().items():
        for name, transform in hf_to_canonical(key):
            tensors[name] = transform(tensor.detach().numpy())
    tensors.update(drafter.canonical())
    skeleton = eqx.filter_eval_shape(ed.DeepseekV4, config, key=jax.random.key(0))
    return ed.ckpt.fill(skeleton, tensors.items())


@pytest.fixture(scope="module")
def setup():
    trunk = reference_model(TRUNK, seed=3)
    drafter = Drafter.random(CONFIG, seed=4)
    return trunk, drafter, load(CONFIG, trunk, drafter)


def _padded(prompts):
    width = max(map(len, prompts))
    ids = np.zeros((len(prompts), width), np.int32)
    for row, p in zip(ids, prompts, strict=True):
        row[: len(p)] = p
    return jnp.asarray(ids), jnp.asarray([len(p) for p in prompts], jnp.int32)


@eqx.filter_jit
def taps_of(model, ids, counts):
    b, s = ids.shape
    _, _, _, taps = model.step(ids, model.init_cache(b, s), counts, taps=model.dspark.targets)
    return taps


@eqx.filter_jit
def draft(model, ids, counts, anchors):
    rings = model.dspark.init_cache(ids.shape[0], ids.shape[1] + 8, jnp.float32)
    rings = model.dspark.extend(taps_of(model, ids, counts), rings, counts)
    return model.dspark.draft(anchors, rings, model.embed, model.head)


@pytest.mark.parametrize("scan", [True, False])
def test_taps_equal_the_reference_layers(setup, scan):
    trunk, drafter, model = setup
    if not scan:  # the Python-loop driver over the same stacks
        model = load(dataclasses.replace(CONFIG, scan_layers=False), trunk, drafter)
    ids, counts = _padded(PROMPTS)
    ours = np.asarray(taps_of(model, ids, counts))
    for row, prompt in enumerate(PROMPTS):
        expected = trunk_taps(trunk, prompt, CONFIG.dspark_target_layer_ids).numpy()
        assert_close(ours[row, : len(prompt)], expected, COMPONENT, f"prompt {row}")


def test_drafts_equal_the_reference(setup):
    trunk, drafter, model = setup
    ids, counts = _padded(PROMPTS)
    out = draft(model, ids, counts, jnp.asarray(ANCHORS, jnp.int32))
    for row, (prompt, anchor) in enumerate(zip(PROMPTS, ANCHORS, strict=True)):
        logits, drafts, confidence = drafter.draft(trunk, prompt, anchor)
        np.testing.assert_array_equal(np.asarray(out.tokens[row]), drafts, f"prompt {row}")
        assert_close(np.asarray(out.logits[row]), logits, COMPONENT, f"prompt {row}")
        assert_close(np.asarray(out.confidence[row]), confidence, COMPONENT, f"prompt {row}")
    # Not a degenerate case: the Markov head changes drafts, and confidences spread.
    assert len(set(np.asarray(out.tokens).ravel().tolist())) > 3


# ---------------------------------------------------------------------------------------------
# the release layout (V4-Flash-0731: the drafter's stages under mtp.<i>, FP8 / FP4 with scales)


@pytest.fixture(scope="module")
def release(tmp_path_factory, setup):
    trunk, _, _ = setup
    path = tmp_path_factory.mktemp("dspark-release")
    return path, write_release_checkpoint(path, CONFIG, trunk, shards=2)


def _weight_map(path) -> dict[str, str]:
    return json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]


def _drafts(model: ed.DeepseekV4):
    ids, counts = _padded(PROMPTS)
    return draft(model, ids, counts, jnp.asarray(ANCHORS, jnp.int32))


def test_release_layout_converts_and_loads(release, tmp_path):
    path, expected = release
    official = json.loads((path / "config.json").read_text())
    # As released: one MTP layer announced, a compress_ratios entry per drafter stage.
    assert official["num_nextn_predict_layers"] == 1
    assert len(official["compress_ratios"]) == CONFIG.num_hidden_layers + 3
    names = set(_weight_map(path))
    own = {
        "mtp.0.main_proj.weight", "mtp.0.main_proj.scale", "mtp.0.main_norm.weight",
        "mtp.2.norm.weight", "mtp.2.hc_head_fn", "mtp.2.hc_head_base", "mtp.2.hc_head_scale",
        "mtp.2.markov_head.markov_w1.weight", "mtp.2.markov_head.markov_w2.weight",
        "mtp.2.confidence_head.proj.weight",
    }  # fmt: skip
    assert own <= names
    for i in range(3):
        assert {f"mtp.{i}.attn.wkv.scale", f"mtp.{i}.ffn.experts.7.w2.scale"} <= names
    assert not any(n.startswith("mtp.3.") for n in names)

    # Every leaf is the release's value (after its quantisation); the drafter's math on such
    # a model is test_drafts_equal_the_reference's.
    exact = ed.ckpt.fill(
        eqx.filter_eval_shape(ed.DeepseekV4, CONFIG, key=jax.random.key(0)), expected.items()
    )
    model = convert.load_hf(path, numerics="exact")
    assert model.config.dspark_stages == 3 and not model.mtp
    _same_leaves(model, exact)
    kept = convert.load_hf(path, numerics="exact", quantized=True)
    assert isinstance(kept.dspark.main_proj.weight, ed.quant.QuantizedWeight)
    _same_leaves(eqx.filter_jit(ed.quant.dequantize_model)(kept), exact)
    # Onto a mesh, each device reading its part, the drafter's too (generation on a sharded
    # model: test_greedy_dspark_equals_plain_greedy).
    sharded = convert.load_hf(path, numerics="exact", mesh=ed.make_mesh(fsdp=2, expert=4))
    assert len(sharded.dspark.stages[0].ffn.experts.w1.sharding.device_set) == 8
    _same_leaves(sharded, exact)
    # The CLI's output loads with the library, in the release's numerics (its default).
    out = tmp_path / "out"
    succeeded(run_main("convert", str(path), str(out), "--quiet", "--dtype", "float32"))
    converted = ed.load(out)
    assert converted.config.dspark_stages == 3 and converted.config.numerics == "release"
    _same_leaves(converted, exact)


def _same_leaves(a: ed.DeepseekV4, b: ed.DeepseekV4) -> None:
    # By release name: the models' plans may differ (scan_min_repeats is not in config.json).
    left, right = dict(ed.ckpt.canonical_pieces(a)), dict(ed.ckpt.canonical_pieces(b))
    assert sorted(left) == sorted(right)
    for name, x in left.items():
        np.testing.assert_array_equal(np.asarray(x), np.asarray(right[name]), err_msg=name)


def test_release_layout_without_the_drafter(release, tmp_path):
    path, _ = release
    assert convert.load_hf(path, load_mtp=False).dspark is None
    # The stages are counted from the checkpoint: a config.json saying one extra layer loads 3.
    counted = tmp_path / "counted"
    shutil.copytree(path, counted)
    official = json.loads((counted / "config.json").read_text())
    official["compress_ratios"] = official["compress_ratios"][: CONFIG.num_hidden_layers + 1]
    (counted / "config.json").write_text(json.dumps(official))
    assert len(convert.load_hf(counted).dspark.stages) == 3
    # A config announcing the drafter over a checkpoint without one: the missing tensors and
    # the flag are named.
    bare = tmp_path / "bare"
    shutil.copytree(path, bare)
    weight_map = _weight_map(bare)
    drafter = [n for n in weight_map if n.startswith("mtp.")]
    for shard in sorted({weight_map[n] for n in drafter}):
        kept = {
            n: read_tensor(info)
            for n, info in list_tensors(bare, []).items()
            if info.file.name == shard and not n.startswith("mtp.")
        }
        write_safetensors(bare / shard, kept)
    index = json.loads((bare / "model.safetensors.index.json").read_text())
    index["weight_map"] = {n: f for n, f in weight_map.items() if not n.startswith("mtp.")}
    (bare / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(convert.CheckpointError) as info:
        convert.load_hf(bare)
    message = str(info.value)
    assert "mtp.0.main_proj.weight" in message and "DSpark" in message
    assert "load_mtp=False" in message and "--no-mtp" in message
    result = run_main("convert", str(bare), str(tmp_path / "out"), "--quiet")
    assert result.returncode == 1 and "--no-mtp" in result.stderr
    assert not (tmp_path / "out").exists()
    assert convert.load_hf(bare, load_mtp=False).dspark is None


# ---------------------------------------------------------------------------------------------
# generation: speculative="dspark"


class _Count:
    # A counter hashed by identity (a drafter is a static argument).
    def __init__(self):
        self.n = 0


class _Watched(ed.inference.DSparkDrafter):
    # The DSpark drafter, counting the programs its drafting is traced into.
    traced: _Count = eqx.field(static=True)

    def draft(self, *args):
        self.traced.n += 1
        return super().draft(*args)


def _few_tokens(model, keep: int = 2):
    # The head and the Markov head shrunk but for `keep` rows: every greedy choice, the trunk's
    # and the drafter's, falls among `keep` tokens, so whole blocks of drafts are sometimes
    # accepted and every accepted length occurs (random weights alone accept almost none).
    scale = jnp.where(jnp.arange(model.config.vocab_size) < keep, 1.0, 0.05)[:, None]
    model = eqx.tree_at(lambda m: m.head.weight, model, model.head.weight * scale)
    w2 = model.dspark.markov_w2.weight
    return eqx.tree_at(lambda m: m.dspark.markov_w2.weight, model, w2 * scale)


def test_greedy_dspark_equals_plain_greedy(setup):
    # Prompts of 1..40 tokens in one batch (shorter and longer than the ring of 8), up to 100
    # new tokens each; the step traced once (the drafter drafts in two programs: after the
    # prefill and in the step).
    model = _few_tokens(setup[2])
    rng = np.random.default_rng(5)
    prompts = [list(rng.integers(0, CONFIG.vocab_size, n)) for n in range(1, 41)]
    # Prompts of up to 40 in chunks of 16: the rings take the prompts in three chunks. Rows
    # end at max_len (128: prompt 40 at 88 tokens) or at 100 new tokens; greedy rows are
    # independent, so each row's first 64 are what 64 new tokens give.
    longest = ed.generate(model, prompts, max_new_tokens=100, prefill_chunk=16, max_len=128)
    plain = [row[:64] for row in longest]
    drafter = _Watched(_Count())
    # Rows ending at max_len (128), at a stop token, or at max_new_tokens, also inside a step's
    # accepted tokens; the callback streams the same tokens.
    stop = plain[0][6]
    # Greedy rows are independent: with the stop token, plain generation gives each row's
    # tokens before its first stop.
    stopped = [row[: row.index(stop)] if stop in row else row for row in plain]
    for kwargs, expected in (
        ({"max_new_tokens": 100}, longest),  # prompt 1 at 100 tokens, prompt 40 at 128
        ({"max_new_tokens": 64, "stop_tokens": [stop]}, stopped),
    ):
        spec, stats = generate_streamed(
            model, prompts, prefill_chunk=16, max_len=128, speculative=drafter, **kwargs
        )
        for row, (a, b) in enumerate(zip(expected, spec, strict=True)):
            assert a == b, (kwargs, row, f"first difference at {np.argmin(np.equal(a, b))}")
        assert stats["tokens"] == sum(map(len, spec)) and stats["steps"] > 2
        if "stop_tokens" in kwargs:
            assert len(spec[0]) == plain[0].index(stop) < 64
        else:
            assert (len(spec[0]), len(spec[-1])) == (100, 128 - 40)
            assert sum(stats["histogram"]) * 5 == stats["drafted"]
            assert all(count > 0 for count in stats["histogram"]), stats  # 0 .. 5 accepted
            assert 0 < stats["confidence_rejected"] < 1 and 0 < stats["confidence_accepted"] < 1
    assert drafter.traced.n == 2  # the same programs throughout
    # The server's engine drafting per row (16 slots, rows reused, each row's drafter state
    # taken and put back by the prefill steps): the last run's tokens, and its drafts (as
    # many accepted: a row reused or beside others drafts what it drafts alone).
    engine = serve.Engine(
        model, slots=16, max_len=128, chunk=16, prefill_rows=2, speculative="dspark"
    ).start()
    served = [[] for _ in prompts]
    finished = []
    # Longest first: rows that held long prompts are reused for prompts shorter than the ring.
    for ids, out in reversed(list(zip(prompts, served, strict=True))):
        engine.submit(
            serve.Request(
                [int(t) for t in ids],
                64,
                on_token=out.append,
                on_finish=finished.append,
                stop_tokens=frozenset([stop]),
            )
        )
    try:
        end = time.monotonic() + 300
        while len(finished) < len(prompts):
            assert time.monotonic() < end, "the engine did not finish"
            time.sleep(0.05)
        counts = engine.health()
    finally:
        engine.stop()
    assert served == expected
    assert (counts["drafted"], counts["accepted"]) == (stats["drafted"], stats["accepted"])
    # On a sharded model.
    sharded = ed.shard(model, ed.make_mesh(fsdp=2, expert=4))
    got = ed.generate(sharded, prompts[:4], max_new_tokens=12, speculative="dspark")
    assert got == [p[:12] for p in plain[:4]]


def test_dspark_errors(setup):
    model = setup[2]
    with pytest.raises(ValueError, match='use speculative="dspark"'):
        ed.generate(model, [[1]], max_new_tokens=2, speculative=True)
    with pytest.raises(ValueError, match="speculative must be"):
        ed.generate(model, [[1]], max_new_tokens=2, speculative="eagle")
    bare = eqx.tree_at(lambda m: m.dspark, model, None, is_leaf=lambda x: x is None)
    with pytest.raises(ValueError, match="has none"):
        ed.generate(bare, [[1]], max_new_tokens=2, speculative="dspark")
    # Training it: a model without one, and options that do not apply.
    opt = ed.make_optimizer(warmup_steps=1, total_steps=2)
    objective = ed.train.DSparkObjective()
    step = ed.make_train_step(opt, dspark=objective, donate=False)
    batch = ed.Batch.from_tokens(np.ones((1, 4), np.int32))
    with pytest.raises(ValueError, match="needs a model with a DSpark drafter"):
        step(ed.init_train_state(bare, opt), batch)
    with pytest.raises(ValueError, match="micro_batches=1, got 2"):
        ed.make_train_step(opt, dspark=objective, micro_batches=2)
    with pytest.raises(ValueError, match="anchors must be >= 1, got 0"):
        ed.train.DSparkObjective(anchors=0)


def test_rings_after_verification_equal_a_fresh_run(setup):
    # Steps as generation takes them: the main model over [pending + 5 drafts], then only the
    # verified positions' rows written (0 .. 6 of them, the rest taken back from the main
    # cache); the rings then equal those of one run over the kept tokens.
    model = setup[2]
    dspark = model.dspark
    rng = np.random.default_rng(7)
    b, w = 2, CONFIG.sliding_window
    cache = model.init_cache(b, 64, rewind=6)
    rings = dspark.init_cache(b, 64, jnp.float32)
    kept = []

    @eqx.filter_jit
    def advance(model, ids, cache, rings, verified):
        start = cache.positions
        t = jnp.full((ids.shape[0],), ids.shape[1], jnp.int32)
        _, cache, _, taps = model.step(ids, cache, t, in_place=True, taps=dspark.targets)
        return cache.at_positions(start + verified), dspark.extend(taps, rings, verified)

    # A prompt of 3, then 8 steps (one compiled shape: 6 tokens, some taken back).
    for verified in [np.full(b, 3)] + [rng.integers(0, 7, b) for _ in range(8)]:
        ids = rng.integers(0, 97, (b, 6)).astype(np.int32)
        verified = verified.astype(np.int32)
        cache, rings = advance(model, jnp.asarray(ids), cache, rings, jnp.asarray(verified))
        kept.append(np.where(np.arange(6)[None] < verified[:, None], ids, -1))
    tokens = [np.concatenate([k[row] for k in kept]) for row in range(b)]
    tokens = [t[t >= 0] for t in tokens]
    n = np.array([len(t) for t in tokens], np.int32)
    np.testing.assert_array_equal(rings.positions, n)
    fresh_ids = np.zeros((b, 64), np.int32)
    for row, t in enumerate(tokens):
        fresh_ids[row, : len(t)] = t
    fresh = dspark.init_cache(b, 64, jnp.float32)
    _, fresh = advance(
        model, jnp.asarray(fresh_ids), model.init_cache(b, 64), fresh, jnp.asarray(n)
    )
    for row in range(b):
        slots = np.arange(max(0, n[row] - w), n[row]) % w
        ours = np.asarray(rings.layers[0][0].ring)[:, row, slots]
        assert_close(ours, np.asarray(fresh.layers[0][0].ring)[:, row, slots], COMPONENT)


# ---------------------------------------------------------------------------------------------
# training a drafter on a frozen trunk


@eqx.filter_jit
def _train_outputs(model, ids, anchors):
    # The training outputs, and the whole sequence's taps they are computed from.
    taps = taps_of(model, ids, jnp.full((ids.shape[0],), ids.shape[1], jnp.int32))
    return model.dspark.train_outputs(taps, ids, anchors, model.embed, model.head), taps


def test_training_outputs_are_the_drafts_outputs(setup):
    # The block at anchor a over the whole sequence equals drafting after a context rows with
    # the true tokens chosen (the Markov head then sees what training feeds it).
    model = setup[2]
    ids = jnp.asarray([PROMPTS[1] + [9, 8, 7, 6, 5, 4]], jnp.int32)  # 27 tokens
    anchors = jnp.asarray([[0, 3, 12, 20, 26]], jnp.int32)
    # The whole sequence's taps: the first a of them are those of its first a tokens (causal).
    (z, c), taps = _train_outputs(model, ids, anchors)
    # Indexed on the host: indexing a device array compiles a program per index.
    z, confidence, truth = np.asarray(z), np.asarray(jax.nn.sigmoid(c)), np.asarray(ids[0])
    for i, a in enumerate(np.asarray(anchors[0])):
        nexts = jnp.asarray([[truth[min(a + j + 1, len(truth) - 1)] for j in range(5)]])
        anchor = jnp.asarray(truth[a : a + 1])
        block = _forced(model, taps, jnp.asarray([a], jnp.int32), anchor, nexts)
        assert_close(z[0, i], np.asarray(block.logits)[0], COMPONENT, f"anchor {a}")
        assert_close(confidence[0, i], np.asarray(block.confidence)[0], COMPONENT)


@eqx.filter_jit
def _forced(model, taps, count, anchor, nexts):
    # Drafting after `count` context rows, the true next tokens chosen.
    rings = model.dspark.extend(taps, model.dspark.init_cache(1, 64, jnp.float32), count)
    return model.dspark.draft(anchor, rings, model.embed, model.head, lambda z, j: nexts[:, j])


def test_drafter_training_lowers_its_loss_and_keeps_the_trunk(setup):
    model = setup[2]
    # The main model's training leaves the drafter alone (no decay of weights it never reads);
    # the drafter's, the trunk.
    assert not any(jax.tree.leaves(ed.train.trainable(model).dspark))
    only = ed.train.trainable(model, drafter_only=True)
    trunk = (only.embed, only.layers, only.head, only.hc_head, only.norm)
    assert all(jax.tree.leaves(only.dspark.main_proj)) and not any(jax.tree.leaves(trunk))
    opt = ed.make_optimizer(1e-2, warmup_steps=1, total_steps=30, weight_decay=0.0)
    state = ed.init_train_state(model, opt, drafter_only=True)
    objective = ed.train.DSparkObjective(anchors=8)
    step = ed.make_train_step(opt, dspark=objective, donate=False)
    rng = np.random.default_rng(0)
    text = rng.integers(0, 16, 200)  # a small alphabet: something to learn in a few steps
    first = last = None
    for _ in range(30):
        starts = rng.integers(0, len(text) - 33, 4)
        batch = ed.Batch.from_tokens(np.stack([text[s : s + 33] for s in starts]))
        state, metrics = step(state, batch)
        first = first or {k: float(v) for k, v in metrics.items() if k != "grad_norm"}
        last = {k: float(v) for k, v in metrics.items() if k != "grad_norm"}
    assert last["loss"] < 0.8 * first["loss"], (first, last)
    assert last["accept"] > first["accept"], (first, last)
    trained = state.model
    # Compared on the host (jnp.array_equal would compile two programs per leaf shape).
    for name in ("embed", "layers", "head", "hc_head", "norm"):
        same = jax.tree.map(
            lambda a, b: np.array_equal(a, b),
            eqx.filter(getattr(model, name), eqx.is_array),
            eqx.filter(getattr(trained, name), eqx.is_array),
        )
        assert all(jax.tree.leaves(same)), name
    assert not np.array_equal(model.dspark.main_proj.weight, trained.dspark.main_proj.weight)


@eqx.filter_jit
def _forward_and_draft(model, ids, anchors):
    # One forward over `ids` [b, s] (one program, not one per question): the logits at every
    # position, and the drafter's block after `anchors` with the taps of the first s - 1
    # positions in its rings (causal: what the prompts `ids[:, :-1]` alone give).
    b, s = ids.shape
    full = jnp.full((b,), s, jnp.int32)
    x, _, _, taps = model.step(ids, model.init_cache(b, s), full, taps=model.dspark.targets)
    rings = model.dspark.init_cache(b, s + 8, jnp.float32)
    rings = model.dspark.extend(taps, rings, full - 1)
    return model.logits(x), model.dspark.draft(anchors, rings, model.embed, model.head)


def test_dspark_sampling_draws_the_plain_distribution():
    # As the MTP test (test_speculative.py): a vocabulary of 8, 3000 copies of one prompt, the
    # first two tokens' joint frequencies against the exact plain-sampling distribution by a
    # chi-square test at level 1e-3, whose power against always accepting the block's first
    # draft is required above 0.99.
    config = dataclasses.replace(CONFIG, vocab_size=8, dspark_noise_token_id=7)
    model = random_fill(abstract(ed.DeepseekV4, config), seed=11)
    s = ed.Sampling(temperature=1.3, top_k=7, top_p=0.97)
    prompt, n = [3, 1, 4, 1, 5], 3000

    def probs(logits):
        return np.asarray(jax.nn.softmax(ed.inference.filtered_logits(logits, s), axis=-1))

    seqs = jnp.asarray([prompt + [x] for x in range(8)], jnp.int32)
    logits, block = _forward_and_draft(model, seqs, jnp.arange(8, dtype=jnp.int32))
    first = probs(logits[:1, -2])[0]  # causal: position -2 sees the prompt alone
    exact = first[:, None] * probs(logits[:, -1])
    # Always accepting: x2 from the drafter's first slot after anchor x1.
    wrong = first[:, None] * probs(block.logits[:, 0])

    out = ed.generate(
        model, [prompt] * n, max_new_tokens=2, sampling=s, key=jax.random.key(1),
        speculative="dspark", max_len=8,
    )  # fmt: skip
    assert_draws_from(out, exact, wrong)


def test_example_script_dspark():
    result = succeeded(
        run_main(
            "examples/generate.py",
            "--speculative",
            "dspark",
            "--layers",
            "3",
            "--max-new-tokens",
            "6",
        )  # fmt: skip
    )
    assert "drafts accepted" in result.stderr and "drafter confidence" in result.stderr
