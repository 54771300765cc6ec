"""Speculative decoding with the MTP blocks: rewinding the positional caches gives the cache of
the tokens kept, the cached MTP path equals its full forward, greedy speculative generation
equals plain greedy generation token for token, and speculative sampling draws from the same
distribution as plain sampling."""

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import COMPONENT, LOGITS, assert_draws_from, generate_streamed, run_main, succeeded
from hf_reference import abstract, random_fill
from test_decode import CONFIGS as DECODE_CONFIGS

import equinox_dsv4 as ed


# The two tiny configs of test_decode.py, with MTP blocks: one (flash_like) and two chained
# (pro_like). eos off: generation runs its full length.
CONFIGS = {
    name: dataclasses.replace(config, num_nextn_predict_layers=depth, eos_token_id=None)
    for (name, config), depth in zip(sorted(DECODE_CONFIGS.items()), (1, 2), strict=True)
}


@pytest.fixture(scope="module")
def models():
    return {
        name: random_fill(abstract(ed.DeepseekV4, config), seed=i)
        for i, (name, config) in enumerate(CONFIGS.items())
    }


class _Log:
    # A list a drafter appends to, hashed by identity (a drafter is a static argument).
    def __init__(self):
        self.items = []


class _Watched(ed.inference.AbstractDrafter):
    # The MTP drafter, watched: `traced` counts the programs its drafting is traced into,
    # `records` gets (tokens verified, drafts, their distributions) at every drafting, from
    # inside the compiled steps.
    traced: _Log = eqx.field(static=True)
    records: _Log = eqx.field(static=True)

    def depth(self, model):
        return ed.inference.MTPDrafter().depth(model)

    def init(self, *args):
        return ed.inference.MTPDrafter().init(*args)

    def prefill(self, *args):
        return ed.inference.MTPDrafter().prefill(*args)

    def drafts(self, state):
        return ed.inference.MTPDrafter().drafts(state)

    def draft(self, *args):
        self.traced.items.append(1)
        state = ed.inference.MTPDrafter().draft(*args)
        verified = args[3]

        def record(*values):
            self.records.items.append(jax.device_get(values))

        jax.debug.callback(record, verified, state.tokens, state.probs, ordered=True)
        return state


@eqx.filter_jit
def _decode(model, ids, cache, num_tokens):
    return model.decode(ids, cache, num_tokens)


def _ratios(model):
    # Per plan segment, per period position: (ratio, overlapping) of its compressor, or None.
    out = []
    for stack in model.layers:
        row = []
        for block in stack.blocks:
            c = block.attn.compressor
            row.append(None if c is None else (c.ratio, c.overlap))
        out.append(row)
    return out


def _live(model, cache: ed.KVCache) -> list[np.ndarray]:
    """What a cache's next decode can read, per sequence: the window's raw keys, the
    compressor rings' slots of the open block (and for CSA the block before), the emitted
    entries and index keys, all by position."""
    out = []
    w = model.config.sliding_window
    # On the host: a device array's slices would compile a program each.
    cache = jax.device_get(cache)
    positions = cache.positions
    for ratios, layers in zip(_ratios(model), cache.layers, strict=True):
        for ratio, layer in zip(ratios, layers, strict=True):
            for b, p in enumerate(positions):
                ring = layer.ring[:, b]
                keep = np.arange(max(0, p - w + 1), p)
                out.append(ring[:, keep % ring.shape[1]])
                if ratio is None:
                    continue
                m, overlap = ratio
                first = max(0, (p // m - (1 if overlap else 0)) * m)
                for state in (layer.compressor, layer.indexer):
                    if state is None:
                        continue
                    slots = np.arange(first, p) % state.kv.shape[2]
                    out.append(state.kv[:, b][:, slots])
                    out.append(state.gate[:, b][:, slots])
                    out.append(state.entries[:, b, : p // m])
    return out


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_rewind_gives_the_cache_of_the_kept_tokens(models, name):
    # Chunks of 1..4 tokens, then up to 3 of them taken back, per sequence, against one token
    # at a time of only the kept ones: through the window's wrap and many CSA and HCA block
    # closes (window 8 or 16, ratios 4 and 8 or 16, 60 kept positions). Every chunk in one
    # compiled width of 4, the rest of it padding, as a speculative step appends its tokens.
    model = models[name]
    rng = np.random.default_rng(3)
    rewind, length = 3, 72
    spec = model.init_cache(2, length, rewind=rewind)
    plain = model.init_cache(2, length)
    vocab = model.config.vocab_size
    while int(np.min(spec.positions)) < 60:
        ids = rng.integers(0, vocab, (2, 4))
        count = rng.integers(1, 5, 2)
        back = np.array([rng.integers(0, min(c, rewind) + 1) for c in count])
        logits, spec = _decode(model, jnp.asarray(ids), spec, jnp.asarray(count, jnp.int32))
        spec = spec.rewind(jnp.asarray(back, jnp.int32))
        logits = np.asarray(logits)  # indexed on the host: no program per index
        kept = count - back
        for i in range(int(kept.max())):
            one, plain = _decode(
                model, jnp.asarray(ids[:, i : i + 1]), plain, jnp.asarray(kept > i, jnp.int32)
            )
            one = np.asarray(one)
            for b in np.flatnonzero(kept > i):
                np.testing.assert_allclose(logits[b, i], one[b, 0], **LOGITS)
        np.testing.assert_array_equal(spec.positions, plain.positions)
        for a, b in zip(_live(model, spec), _live(model, plain), strict=True):
            np.testing.assert_allclose(a, b, **COMPONENT)


def test_rewind_is_bounded(models):
    # The cache and a chunk of test_rewind_gives_the_cache_of_the_kept_tokens: its programs.
    # Four tokens appended, at most three may be taken back.
    model = models["flash_like"]
    cache = model.init_cache(2, 72, rewind=3)
    four = jnp.asarray([4, 4], jnp.int32)
    _, cache = _decode(model, jnp.zeros((2, 4), jnp.int32), cache, four)
    assert int(cache.rewind(jnp.asarray([3, 3], jnp.int32)).positions[0]) == 1
    with pytest.raises(Exception, match="rewind"):
        jax.block_until_ready(cache.rewind(four).positions)
    with pytest.raises(ValueError, match="rewind must be >= 0"):
        model.init_cache(1, 16, rewind=-1)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_cached_mtp_equals_its_full_forward(models, name):
    # Every depth: its full forward from position 0 (depth j fed the tokens j + 1 ahead and the
    # previous depth's output streams) against chunks appended to its cache.
    model = models[name]
    rng = np.random.default_rng(4)
    n = 40
    # Three rows: the full forward's programs are test_drafts_equal_the_mtp_full_forward's.
    ids = rng.integers(0, model.config.vocab_size, (3, n + 2)).astype(np.int32)
    streams = model.streams(jnp.asarray(ids[:, :n]))
    caches = model.init_mtp_cache(3, 48)
    # Every chunk in one compiled width of 16, the rest of it padding (not counted), as a
    # speculative step appends its accepted positions; sliced on the host (a device array's
    # slices would compile a program each).
    width = 16
    for depth, block in enumerate(model.mtp):
        ahead = jnp.asarray(ids[:, depth + 1 : depth + 1 + n])
        h, out = eqx.filter_jit(block)(streams, ahead, model.embed)
        full = model.head(h, dtype=jnp.float32)
        padded = [np.asarray(x) for x in (streams, ahead)]
        padded = [np.pad(x, [(0, 0), (0, width)] + [(0, 0)] * (x.ndim - 2)) for x in padded]
        cache, got, got_streams, s = caches[depth], [], [], 0
        for chunk in (5, 1, 1, 8, 3, 16, 6):
            part_streams, part_ahead = (jnp.asarray(x[:, s : s + width]) for x in padded)
            count = jnp.asarray(np.full(3, chunk, np.int32))
            logits, o, cache = model.mtp_decode(part_streams, part_ahead, cache, count, depth=depth)
            got.append(np.asarray(logits)[:, :chunk])
            got_streams.append(np.asarray(o)[:, :chunk])
            s += chunk
        assert s == n
        np.testing.assert_allclose(np.concatenate(got, 1), full, **COMPONENT)
        np.testing.assert_allclose(np.concatenate(got_streams, 1), out, **COMPONENT)
        streams = out
    with pytest.raises(ValueError, match="depth must be in"):
        model.mtp_decode(streams[:, :1], jnp.asarray(ids[:, :1]), caches[0], depth=len(model.mtp))


def _few_tokens(model, keep: int = 4):
    # The head shrunk but for `keep` rows: every greedy choice, the main model's and the MTP
    # blocks' (which share the head), falls among `keep` tokens, so drafts are often accepted
    # and every number of accepted drafts occurs.
    scale = jnp.where(jnp.arange(model.config.vocab_size) < keep, 1.0, 0.05)[:, None]
    return eqx.tree_at(lambda m: m.head.weight, model, model.head.weight * scale)


def _prompts(name):
    # Prompts of 1..40 tokens in one batch: shorter and longer than the window, across many
    # block closes.
    rng = np.random.default_rng(5)
    return [list(rng.integers(0, CONFIGS[name].vocab_size, n)) for n in range(1, 41)]


@pytest.fixture(scope="module")
def plain_greedy(models):
    """Plain greedy generation of `_prompts(name)`, up to 64 new tokens in a cache of 96, per
    config, made once: the reference of the speculative runs below. Greedy rows are
    independent: a row's first n tokens are what n new tokens give, in any batch."""
    made = {}

    def of(name):
        if name not in made:
            model = _few_tokens(models[name])
            made[name] = ed.generate(model, _prompts(name), max_new_tokens=64, max_len=96)
        return made[name]

    return of


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_greedy_speculative_equals_plain_greedy(models, plain_greedy, name):
    # Up to 64 new tokens per prompt: past the window and many block closes. With the shrunk
    # head drafts are accepted (6-18% here) and rejected, every number of them (random weights
    # alone accept almost none). Rows end at max_len (96: prompts 33 .. 40 before 64 tokens),
    # at a stop token, or at max_new_tokens, in the middle of a step's accepted tokens too; the
    # callback streams the same tokens. One cache length throughout, so the speculative step
    # is traced once: the drafter drafts in two programs, after the prefill and in the step.
    drafter = _Watched(_Log(), _Log())
    prompts = _prompts(name)
    depth = CONFIGS[name].num_nextn_predict_layers
    model = _few_tokens(models[name])
    plain = plain_greedy(name)
    assert [len(row) for row in plain] == [min(64, 96 - len(p)) for p in prompts]
    stop = plain[0][6]
    # Greedy rows are independent: with the stop token, plain generation gives each row's
    # tokens before its first stop; with a limit of 3, its first 3.
    stopped = [row[: row.index(stop)] if stop in row else row for row in plain]
    for kwargs, expected in (
        ({"max_new_tokens": 64}, plain),
        ({"max_new_tokens": 64, "stop_tokens": [stop]}, stopped),
        ({"max_new_tokens": 3}, [row[:3] for row in plain]),
    ):
        spec, stats = generate_streamed(model, prompts, max_len=96, speculative=drafter, **kwargs)
        for row, (a, b) in enumerate(zip(expected, spec, strict=True)):
            assert a == b, (kwargs, row, f"first difference at {np.argmin(np.equal(a, b))}")
        assert stats["tokens"] == sum(map(len, spec))
        assert sum(stats["histogram"]) * depth == stats["drafted"]
        if "stop_tokens" in kwargs:
            assert len(spec[0]) == plain[0].index(stop) < 64
        elif kwargs["max_new_tokens"] == 64:
            assert stats["steps"] > 2
            # Every number of accepted drafts occurs (for pro_like: the second depth's too).
            assert all(count > 0 for count in stats["histogram"]), stats
    assert len(drafter.traced.items) == 2  # the same programs throughout
    with pytest.raises(ValueError, match="has none"):
        ed.generate(
            eqx.tree_at(lambda m: m.mtp, model, ()), [[1]], max_new_tokens=2, speculative=True
        )


def test_drafts_equal_the_mtp_full_forward(models):
    # After every drafting (the first, then every speculative step), the distributions the
    # drafts were drawn from (both chained depths, sampling at temperature 1) against the MTP
    # blocks run from position 0 on the sequence so far: the MTP caches hold what the accepted
    # tokens give, whatever was drafted and taken back (prompts of 1, 2 and 7 tokens: the
    # depths' late starts too).
    model = _few_tokens(models["pro_like"])
    drafter = _Watched(_Log(), _Log())
    prompts = [[5], [8, 9], [1, 2, 3, 4, 5, 6, 7]]
    s = ed.Sampling(temperature=1.0)
    out = ed.generate(
        model,
        prompts,
        max_new_tokens=24,
        sampling=s,
        key=jax.random.key(2),
        speculative=drafter,
    )
    records = drafter.records.items
    assert len(records) > 8
    n = 40  # one padded length (causal: padding changes nothing before)

    def full(ids):
        # [3, n + 2] tokens (each row's sequence, pending token last, then the first depth's
        # draft after it): both depths' logits at positions 0 .. n-1, from the programs of
        # test_cached_mtp_equals_its_full_forward (the same shapes).
        streams = model.streams(jnp.asarray(ids[:, :n]))
        h0, x0 = eqx.filter_jit(model.mtp[0])(streams, jnp.asarray(ids[:, 1 : n + 1]), model.embed)
        h1, _ = eqx.filter_jit(model.mtp[1])(x0, jnp.asarray(ids[:, 2:]), model.embed)
        return model.head(h0, dtype=jnp.float32), model.head(h1, dtype=jnp.float32)

    done = np.zeros(3, np.int64)  # tokens out of generate so far (the first: the prefill's)
    checked = 0
    for counts, tokens, probs in records:
        done += counts
        ids = np.zeros((3, n + 2), np.int32)
        lengths = []
        for b, p in enumerate(prompts):
            seq = p + out[b][: done[b]]
            lengths.append(len(seq))
            ids[b, : len(seq)] = seq
            ids[b, len(seq)] = tokens[b, 0]  # the first depth's draft: the second's input
        # On the host: indexing a device array compiles a program per index.
        logits0, logits1 = map(np.asarray, full(ids))
        for b in range(3):
            if done[b] > len(out[b]) or counts[b] == 0:
                continue  # the row had ended (its last tokens cut at the limit)
            t = lengths[b] - 2  # the last position with its next token: the pending one
            np.testing.assert_allclose(probs[b, 0], jax.nn.softmax(logits0[b, t]), atol=1e-5)
            np.testing.assert_allclose(probs[b, 1], jax.nn.softmax(logits1[b, t]), atol=1e-5)
            checked += 1
    assert checked > 20


def test_speculative_on_a_sharded_model(plain_greedy, models):
    # Weights split over fsdp x expert, the caches (the MTP blocks' too) over the batch. Against
    # plain greedy generation's first rows (prompts of 1..4 tokens; see plain_greedy).
    model = _few_tokens(models["flash_like"])
    sharded = ed.shard(model, ed.make_mesh(fsdp=2, expert=4))
    stats = {}
    prompts = _prompts("flash_like")[:4]
    got = ed.generate(sharded, prompts, max_new_tokens=12, speculative=True, stats=stats)
    assert got == [row[:12] for row in plain_greedy("flash_like")[:4]]
    assert stats["accepted"] > 0


def test_accept_drafts_by_hand():
    key = jax.random.key(0)
    # Greedy: accepted while the draft is the target's argmax; then the target's token.
    logits = jnp.log(jnp.asarray([[[0.1, 0.9, 0.0], [0.8, 0.1, 0.1], [0.2, 0.3, 0.5]]] * 3))
    drafts = jnp.asarray([[1, 0], [1, 2], [0, 0]], jnp.int32)
    accepted, tokens = ed.inference.accept_drafts(logits, drafts, None, key, ed.Sampling())
    np.testing.assert_array_equal(accepted, [2, 1, 0])
    np.testing.assert_array_equal(tokens, [[1, 0, 2]] * 3)
    # Sampling: a draft drawn from the target itself is always accepted; one from a
    # distribution the target gives no mass is always rejected and replaced from the target.
    s = ed.Sampling(temperature=1.0)
    p = jax.nn.softmax(logits[:1, :2], axis=-1)
    keys = jax.random.split(key, 200)
    same = jax.vmap(lambda k: ed.inference.accept_drafts(logits[:1], drafts[:1], p, k, s)[0])(keys)
    assert (np.asarray(same) == 2).all()
    never = jnp.asarray([[[0.0, 0.0, 1.0], [1.0, 0.0, 0.0]]])
    draft = jnp.asarray([[2, 0]], jnp.int32)
    zero = jnp.log(jnp.asarray([[[0.5, 0.5, 0.0], [0.8, 0.1, 0.1], [0.2, 0.3, 0.5]]]))
    out = jax.vmap(lambda k: ed.inference.accept_drafts(zero, draft, never, k, s))(keys)
    assert (np.asarray(out[0]) == 0).all()
    replaced = np.asarray(out[1])[:, 0, 0]
    assert set(replaced) == {0, 1} and 0.35 < (replaced == 0).mean() < 0.65


def test_accept_drafts_row_by_row():
    # SamplingRows, a key per row: each row is judged as a batch of that row alone with its
    # own Sampling and key; a greedy row, its drafts' distributions all on them (as
    # draw_rows gives), as greedy. Drafts near the target's, so that some are accepted.
    rng = np.random.default_rng(7)
    b, n, v = 8, 3, 40
    logits = jnp.asarray(rng.normal(size=(b, n + 1, v)) * 2, jnp.float32)
    near = logits[:, :n] + jnp.asarray(rng.normal(size=(b, n, v)) * 0.3, jnp.float32)
    greedy = ed.Sampling()
    settings = [greedy, ed.Sampling(0.8, 5), ed.Sampling(1.0, 0, 0.7), greedy]
    settings += [ed.Sampling(1.5, 7, 0.9), ed.Sampling(1.0), greedy, ed.Sampling(0.5, 2, 0.5)]
    rows = ed.inference.SamplingRows(
        jnp.asarray([s.temperature for s in settings], jnp.float32),
        jnp.asarray([s.top_k for s in settings], jnp.int32),
        jnp.asarray([s.top_p for s in settings], jnp.float32),
    )
    keys = jax.random.split(jax.random.key(3), b)
    drawn = [
        ed.inference.draw_rows(near[:, j], jax.random.split(jax.random.key(j), b), rows)
        for j in range(n)
    ]
    drafts = jnp.stack([t for t, _ in drawn], axis=1)
    q = jnp.stack([p for _, p in drawn], axis=1)
    # Jitted: a program per Sampling, not one per operation, shape and index.
    accept = eqx.filter_jit(ed.inference.accept_drafts)
    accepted, tokens = map(np.asarray, accept(logits, drafts, q, keys, rows))
    # Rows taken on the host: a device array's row would compile a program per index.
    logits, near, drafts, q = map(np.asarray, (logits, near, drafts, q))
    for r, s in enumerate(settings):
        row = slice(r, r + 1)
        if s.greedy:
            np.testing.assert_array_equal(drafts[r], np.argmax(near[r], -1))
            np.testing.assert_array_equal(q[r], jax.nn.one_hot(drafts[r], v))
        else:
            filtered = ed.inference.filtered_logits(jnp.asarray(near[r]), s)
            expected = jax.nn.softmax(filtered, axis=-1)
            np.testing.assert_allclose(q[r], expected, rtol=1e-5, atol=1e-7)
        probs = None if s.greedy else jnp.asarray(q[row])
        alone = jnp.asarray(logits[row]), jnp.asarray(drafts[row])
        a, t = map(np.asarray, accept(*alone, probs, keys[r], s))
        assert int(accepted[r]) == int(a[0]), r
        np.testing.assert_array_equal(tokens[r, : int(a[0]) + 1], t[0, : int(a[0]) + 1])
    # Both rules occur: drafts accepted and rejected, greedy and sampled.
    assert 0 < accepted.sum() < b * n
    assert accepted[[0, 3, 6]].sum() > 0 and accepted[[1, 2, 4, 5, 7]].sum() > 0


def test_speculative_sampling_draws_the_plain_distribution():
    # Two chained MTP blocks, a vocabulary of 8 and 3000 copies of one prompt: the first two
    # generated tokens' joint frequencies against the exact plain-sampling distribution (the
    # model's own softmax at each step, after temperature, top-k and top-p), by a chi-square
    # test at level 1e-3. Its power against the distribution a sampler that always accepted
    # the drafts would give is computed below and required to be above 0.99 (made to accept
    # too often, the sampler failed it: p = 0).
    config = dataclasses.replace(CONFIGS["pro_like"], vocab_size=8)
    model = random_fill(abstract(ed.DeepseekV4, config), seed=11)
    s = ed.Sampling(temperature=1.3, top_k=7, top_p=0.97)
    prompt = [3, 1, 4, 1, 5]
    n = 3000

    def probs(logits):
        return np.asarray(jax.nn.softmax(ed.inference.filtered_logits(logits, s), axis=-1))

    @eqx.filter_jit
    def forward(model, seqs):
        # One forward: the main model's logits, and the MTP block's at the prompt's end.
        streams = model.streams(seqs)
        return model.logits(streams), model.mtp_logits(streams[:, -2:-1], seqs[:, -1:])[:, 0]

    seqs = jnp.asarray([prompt + [x] for x in range(8)], jnp.int32)
    logits, mtp = forward(model, seqs)
    first = probs(logits[:1, -2])[0]  # causal: position -2 sees the prompt alone
    second = probs(logits[:, -1])  # [x1, x2]
    exact = first[:, None] * second
    # What always accepting the MTP's draft would give: x2 from the MTP's distribution.
    wrong = first[:, None] * probs(mtp)

    out = ed.generate(
        model,
        [prompt] * n,
        max_new_tokens=2,
        sampling=s,
        key=jax.random.key(1),
        speculative=True,
        max_len=8,  # the prompt and two tokens: the rows prefill 8 columns, not the default 32
    )
    assert_draws_from(out, exact, wrong)


def test_example_script_speculative():
    # The embedded default's first three layers with its MTP block (random weights: drafts are
    # rejected).
    args = ("--speculative", "--layers", "3", "--max-new-tokens", "6")
    result = succeeded(run_main("examples/generate.py", *args))
    assert "drafts accepted" in result.stderr, result.stderr
    assert "tokens per main-model call" in result.stderr
