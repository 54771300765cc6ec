"""Generation: greedy decoding against transformers run as a repeated full forward, batched
prompts, sampling, stop tokens, the chat format, and the example script."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from helpers import lowered, run_main
from hf_reference import (
    FIVE_LAYERS,
    abstract,
    our_model,
    random_fill,
    reference_model,
    tiny_config,
)

import equinox_dsv4 as ed


# index_n_heads 8: with few heads many ReLU index scores tie at exactly 0, and transformers and
# we may break such ties differently.
# Five layers: a sliding hash-routed layer, then a scanned (CSA, HCA) period.
CONFIG = tiny_config(
    **FIVE_LAYERS,
    index_n_heads=8,
    num_nextn_predict_layers=0,
    eos_token_id=None,
)


@pytest.fixture(scope="module")
def pair():
    reference = reference_model(CONFIG, seed=5)
    return reference, our_model(CONFIG, reference)


def reference_greedy(model, prompt, new_tokens):
    """Greedy decoding by transformers' model re-run on the whole sequence at every step."""
    ids = list(prompt)
    for _ in range(new_tokens):
        with torch.no_grad():
            t = torch.tensor([ids])
            logits = model(input_ids=t, attention_mask=torch.ones_like(t)).logits
        ids.append(int(logits[0, -1].argmax()))
    return ids[len(prompt) :]


def test_greedy_generation_matches_transformers(pair):
    reference, ours = pair
    prompt = list(np.random.default_rng(1).integers(2, CONFIG.vocab_size, 11))
    expected = reference_greedy(reference, prompt, 40)
    (got,) = ed.generate(ours, [prompt], max_new_tokens=40)
    assert got == expected


def test_batched_prompts_of_different_lengths(pair):
    _, ours = pair
    rng = np.random.default_rng(2)
    prompts = [list(rng.integers(2, 97, n)) for n in (3, 17, 9)]
    together = ed.generate(ours, prompts, max_new_tokens=12)
    alone = [ed.generate(ours, [p], max_new_tokens=12)[0] for p in prompts]
    assert together == alone


def test_stop_tokens_and_callback(pair):
    _, ours = pair
    prompt = [5, 6, 7]
    (free,) = ed.generate(ours, [prompt], max_new_tokens=10)
    stop = free[4]
    seen = []
    (stopped,) = ed.generate(
        ours,
        [prompt],
        max_new_tokens=10,
        stop_tokens=[stop],
        callback=lambda tokens, running: seen.append((int(tokens[0]), bool(running[0]))),
    )
    assert stopped == free[: free.index(stop)]
    assert seen[-1] == (stop, False)
    # The cache length bounds generation too.
    (short,) = ed.generate(ours, [prompt], max_new_tokens=10, max_len=6)
    assert short == free[:3]  # prompt 3 + generated 3 = max_len


def test_sampling():
    logits = jnp.log(jnp.array([[0.1, 0.2, 0.7], [0.5, 0.3, 0.2]]))
    key = jax.random.key(0)
    assert list(ed.inference.sample(logits, key, ed.Sampling())) == [2, 0]
    assert list(ed.inference.sample(logits, key, ed.Sampling(temperature=1.0, top_k=1))) == [2, 0]
    assert list(ed.inference.sample(logits, key, ed.Sampling(temperature=1.0, top_p=0.05))) == [
        2,
        0,
    ]
    # Frequencies follow the softmax; top_p=0.75 keeps the two most likely of row 0 (0.7, 0.2).
    keys = jax.random.split(key, 4000)
    draws = np.asarray(jax.vmap(lambda k: ed.inference.sample(logits, k, ed.Sampling(1.0)))(keys))
    np.testing.assert_allclose(
        np.bincount(draws[:, 0], minlength=3) / 4000, [0.1, 0.2, 0.7], atol=0.03
    )
    nucleus = jax.vmap(lambda k: ed.inference.sample(logits, k, ed.Sampling(1.0, top_p=0.75)))(keys)
    counts = np.bincount(np.asarray(nucleus)[:, 0], minlength=3) / 4000
    np.testing.assert_allclose(counts, [0.0, 0.2 / 0.9, 0.7 / 0.9], atol=0.03)
    # Temperature sharpens: at 0.1 row 0 is almost always token 2.
    cold = jax.vmap(lambda k: ed.inference.sample(logits, k, ed.Sampling(0.1)))(keys)
    assert (np.asarray(cold)[:, 0] == 2).mean() > 0.99


@pytest.mark.parametrize("vocab", [1, 7, 360, 1009, 129280])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_greedy_is_the_first_largest_logit(vocab, dtype):
    # Greedy sampling takes block maxima of an integer key (`_generate._greedy`); numpy's
    # argmax is the reference: the first largest, NaN counted as largest, -0.0 equal to 0.0.
    rng = np.random.default_rng(vocab)
    special = np.array(
        [0.0, -0.0, 1.0, -1.0, -2.5, np.inf, -np.inf, np.nan, -np.nan, 3e38, -3e38, 1e-45]
    )
    rows = [
        rng.choice(special, vocab),
        rng.choice(special[special == special], vocab),  # no NaN
        -rng.random(vocab) - 1.0,  # all negative: the order of negative keys
        rng.normal(size=vocab).round(1),  # many ties
        np.zeros(vocab),
        np.where(np.arange(vocab) % 2, 0.0, -0.0),  # -0.0 first
    ]
    logits = jnp.asarray(np.stack(rows), dtype)
    expected = np.argmax(np.asarray(logits.astype(jnp.float32)), axis=-1)
    picked = jax.jit(lambda x: ed.inference.sample(x, jax.random.key(0), ed.Sampling()))(logits)
    assert picked.dtype == jnp.int32
    np.testing.assert_array_equal(picked, expected)


def test_sampled_generation_is_reproducible(pair):
    _, ours = pair
    s = ed.Sampling(temperature=0.8, top_k=20, top_p=0.9)
    a = ed.generate(ours, [[3, 4]], max_new_tokens=8, sampling=s, key=jax.random.key(7))
    b = ed.generate(ours, [[3, 4]], max_new_tokens=8, sampling=s, key=jax.random.key(7))
    assert a == b


def test_bad_arguments(pair):
    _, ours = pair
    with pytest.raises(ValueError, match="at least one token"):
        ed.generate(ours, [[]], max_new_tokens=3)
    with pytest.raises(ValueError, match="does not fit max_len"):
        ed.generate(ours, [[1] * 10], max_new_tokens=3, max_len=8)
    with pytest.raises(ValueError, match="temperature"):
        ed.Sampling(temperature=-1.0)
    with pytest.raises(ValueError, match="top_p"):
        ed.Sampling(top_p=0.0)
    with pytest.raises(ValueError, match="needs a PRNG key"):
        ed.generate(ours, [[1]], max_new_tokens=3, sampling=ed.Sampling(1.0))


def test_chat_format_and_tokenizer():
    prompt = ed.chat_prompt(
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": "2+2?"},
        ]
    )
    assert prompt == (
        "<｜begin▁of▁sentence｜>Be brief.<｜User｜>Hi<｜Assistant｜></think>Hello!"
        "<｜end▁of▁sentence｜><｜User｜>2+2?<｜Assistant｜></think>"
    )
    thinking = ed.chat_prompt([{"role": "user", "content": "Hi"}], thinking=True)
    assert thinking.endswith("<｜Assistant｜><think>")
    ids = ed.encode_text(prompt)
    assert ids[0] == 0 and ids[-2:] == [128804, 128822] and 128803 in ids and 1 in ids
    assert ed.text.load_tokenizer().get_vocab_size() == 129280
    assert ed.decode_text(ed.encode_text("Hello, world")) == "Hello, world"
    with pytest.raises(ValueError, match="unknown role"):
        ed.chat_prompt([{"role": "narrator", "content": "x"}])


def _example(*args):
    return run_main("examples/generate.py", *args)


# The two runs below compile the same programs (the same weights' shapes, sampling and cache
# length; the checkpoint's MTP block, which generation does not read, is no argument of a
# compiled program), which the second takes from the session's compilation cache.
def test_example_script_default_model():
    result = _example("--max-new-tokens", "5", "--temperature", "0.7")
    assert result.returncode == 0, result.stderr
    assert "random weights" in result.stderr.lower()
    assert "prefill" in result.stderr and "decode" in result.stderr and "tokens/s" in result.stderr


def test_example_script_checkpoint(tmp_path):
    model = random_fill(abstract(ed.DeepseekV4, ed.Config.tiny()), 3)
    ed.save(tmp_path / "model", model)
    result = _example(
        "--checkpoint", tmp_path / "model", "--max-new-tokens", "5", "--temperature", "0.7"
    )
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize(
    "args,message",
    [
        (["--prompt", ""], "empty"),
        (["--temperature", "-1"], "temperature"),
        (["--checkpoint", "/nonexistent/model"], "/nonexistent/model"),
        (["--hf", "/nonexistent/hf"], "/nonexistent/hf"),
        (["--prompt", "word " * 50, "--max-len", "20"], "--max-len 20"),
    ],
)
def test_example_script_errors(args, message):
    result = _example(*args)
    assert result.returncode != 0
    assert message in result.stderr
    assert "Traceback" not in result.stderr


def test_chunked_prefill_gives_the_same_generation(pair):
    _, ours = pair
    prompts = [list(range(2, 40)), list(range(5, 20))]
    whole = ed.generate(ours, prompts, max_new_tokens=6)
    start = len(lowered())
    assert ed.generate(ours, prompts, max_new_tokens=6, prefill_chunk=8) == whole
    # Five chunks, one program (the cache starts committed, as the chunks leave it).
    assert lowered()[start:].count("jit(_prefill_chunk)") == 1
