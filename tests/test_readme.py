"""The documented paths work as written: every Python block of the README, run in order in one
fresh process (as a notebook would run them), the decode snippet's loop called eagerly, and both
examples' `--hf` on a checkpoint written by transformers' `save_pretrained`."""

import json
import pathlib
import re
import subprocess
import textwrap

import numpy as np
import pytest
import transformers
from helpers import ROOT, SAME, run_main, run_python, short_tiny, succeeded
from hf_reference import hf_config, randomize

import equinox_dsv4 as ed


README = ROOT / "README.md"
# The directory name the README's loading block reads.
HF_DIR = "DeepSeek-V4-Flash"


# The first line of the blocks that talk to a running examples/serve.py: tests/test_serve.py
# runs them against its server.
SERVER_BLOCK = "# With examples/serve.py running"


def python_blocks(text: str, *, server: bool = False) -> list[str]:
    """The README's Python blocks, in order: those that need no server, or (`server`) those
    that talk to one."""
    blocks = re.findall(r"^```python\n(.*?)^```$", text, re.MULTILINE | re.DOTALL)
    return [b for b in blocks if b.startswith(SERVER_BLOCK) == server]


@pytest.fixture(scope="module")
def hf_tiny(tmp_path_factory) -> pathlib.Path:
    """A directory holding `HF_DIR`: three layers of the embedded tiny config (the tokenizer's
    vocabulary), saved by transformers from its default config's MTP count (one, which its
    model does not hold), every weight randomised."""
    config = ed.Config.tiny().first_layers(3)
    kwargs = config.to_hf()
    del kwargs["num_nextn_predict_layers"]  # transformers' own default
    reference = transformers.DeepseekV4ForCausalLM(transformers.DeepseekV4Config(**kwargs))
    assert reference.config.to_dict() == hf_config(config).to_dict()
    randomize(reference.eval(), seed=5)
    root = tmp_path_factory.mktemp("readme")
    reference.save_pretrained(root / HF_DIR)
    saved = json.loads((root / HF_DIR / "config.json").read_text())
    assert saved["num_nextn_predict_layers"] == 1
    return root


def test_readme_is_a_short_manual():
    # Details live in docs/ (fit tables, design, architecture), not in the README.
    assert len(README.read_text().splitlines()) <= 250


def test_readme_blocks_run_as_written(hf_tiny):
    blocks = python_blocks(README.read_text())
    assert len(blocks) >= 5, "the README's Python blocks were not found"
    # Each block runs as it stands, in order, in one namespace; a failure names its block.
    code = "\n".join(
        f"print('--- block {i}', round(time.perf_counter() - start), flush=True)\n"
        f"exec(compile({block!r}, 'README block {i}', 'exec'))"
        for i, block in enumerate(blocks)
    )
    code = f"import time\nstart = time.perf_counter()\n{code}\nprint('--- done', flush=True)\n"
    result = run_python("-c", code, cwd=hf_tiny)
    print(result.stdout)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    assert "--- done" in result.stdout
    for name in ("v4-flash-jax", "v4-flash-finetuned", "run/state"):
        assert (hf_tiny / name).is_dir(), name
    # Both reads of the transformers-saved checkpoint (load_hf, convert) said that its MTP is
    # skipped, once each.
    assert result.stderr.count("MTPSkippedWarning: the MTP block is absent") == 2


EAGER = textwrap.dedent(
    """
    import json
    import sys
    import equinox as eqx, jax, jax.numpy as jnp, numpy as np
    import equinox_dsv4 as ed

    def mappings():
        with open("/proc/self/maps") as f:
            return sum(1 for _ in f)

    def run(decode, steps):
        # The README's decode snippet, with `decode` in place of `model.decode`.
        prompt_ids = jnp.array([[0, 19923, 14, 5], [0, 3, 17, 0]])
        lengths = jnp.array([4, 3])
        cache = model.init_cache(batch=2, max_len=512)
        logits, cache = decode(prompt_ids, cache, num_tokens=lengths)
        next_ids = jnp.argmax(logits[jnp.arange(2), lengths - 1], axis=-1)
        tokens, heads, sums = [], [], []
        for i in range(steps):
            logits, cache = decode(next_ids[:, None], cache)
            next_ids = jnp.argmax(logits[:, 0], axis=-1)
            row = np.asarray(logits[:, 0])
            tokens.append(np.asarray(next_ids))
            heads.append(row[:, :256])
            sums.append(row.sum(-1, dtype=np.float64))
            if i == 10:
                before = mappings()
        return np.stack(tokens), np.stack(heads), np.stack(sums), mappings() - before

    # `helpers.short_tiny`: a layer scan (what an eager call compiled anew) after a layer of
    # its own, at the embedded tiny model's widths.
    config = ed.Config.from_hf(json.loads(sys.argv[2]), scan_min_repeats=2)
    model = ed.DeepseekV4(config, key=jax.random.key(0))
    steps = int(sys.argv[1])
    eager = run(model.decode, steps)
    jitted_decode = eqx.filter_jit(
        lambda m, ids, cache, num_tokens=None: m.decode(ids, cache, num_tokens)
    )
    jitted = run(lambda *a, **k: jitted_decode(model, *a, **k), steps)
    names = ("tokens", "heads", "sums")
    np.savez(
        "out.npz",
        grown=eager[3],
        **{f"eager_{n}": v for n, v in zip(names, eager)},
        **{f"jitted_{n}": v for n, v in zip(names, jitted)},
    )
    """
)


def test_eager_decode_loop(tmp_path):
    steps = 28  # past the ring (16), and row 0 (32 tokens) through two HCA blocks of 16
    config = json.dumps(short_tiny().to_hf())
    succeeded(run_python("-c", EAGER, steps, config, cwd=tmp_path))
    out = np.load(tmp_path / "out.npz")
    assert out["eager_tokens"].shape == (steps, 2)
    np.testing.assert_array_equal(out["eager_tokens"], out["jitted_tokens"])
    # Each step's logits (the first 256 of the vocabulary and the sum over all of it).
    np.testing.assert_allclose(out["eager_heads"], out["jitted_heads"], **SAME)
    np.testing.assert_allclose(out["eager_sums"], out["jitted_sums"], atol=1e-3, rtol=1e-6)
    # Run op by op, every call compiled the layer scan anew, each program with its own memory
    # mappings (broken so on purpose, these steps added several times the bound).
    grown = int(out["grown"])
    assert grown < 500, f"{grown} memory mappings added by {steps - 11} eager steps"


def _example(script: str, *args) -> subprocess.CompletedProcess:
    return run_main(f"examples/{script}", *args)


def test_generate_example_hf(hf_tiny):
    result = _example("generate.py", "--hf", hf_tiny / HF_DIR, "--max-new-tokens", "4")
    assert result.returncode == 0, result.stderr[-4000:]
    assert f"model: {hf_tiny / HF_DIR}" in result.stderr and "decode" in result.stderr


def test_train_example_hf(hf_tiny, tmp_path):
    args = ("--hf", hf_tiny / HF_DIR, "--steps", "1", "--batch", "1", "--seq-len", "16")
    result = _example("train.py", *args, "--out", tmp_path / "run")
    assert result.returncode == 0, result.stderr[-4000:]
    assert "MTP block is absent" in result.stderr
    assert ed.load(tmp_path / "run" / "model").config.num_hidden_layers == 3
