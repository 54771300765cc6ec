"""`pytest --compile-report` (tests/compile_report.py): a sample test file run in fresh pytest
processes, alone and then under two xdist workers, reports its compiled programs and cache hits."""

import os
import re

from helpers import ROOT, run_python


SAMPLE = """
import jax
import numpy as np


def test_compiles():
    jax.jit(lambda x: x * 2 + 1)(np.arange(3.0, dtype=np.float32)).block_until_ready()


def test_compiles_another():
    jax.jit(lambda x: x - 5)(np.arange(4.0, dtype=np.float32)).block_until_ready()


def test_compiles_nothing():
    pass
"""


def _report(tmp_path, cache, *args) -> dict:
    # The sample run with the plugin alone (an empty ini: none of the suite's options), in a
    # fresh process with its own compilation cache; the report's rows by file name.
    # None of the calling session's pytest settings (PYTEST_ADDOPTS, xdist's worker variables).
    environ = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env = dict(
        environ,
        JAX_PLATFORMS="cpu",
        PYTHONPATH=os.pathsep.join([str(ROOT / "tests"), str(ROOT)]),
        JAX_COMPILATION_CACHE_DIR=str(cache),
        JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
    )
    result = run_python(
        "-m", "pytest", "-c", tmp_path / "pytest.ini", "-p", "compile_report", *args,
        "-p", "no:cacheprovider", "test_sample.py", cwd=tmp_path, env=env,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = {}
    for line in result.stdout.splitlines():
        m = re.match(r"(\S+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+(\d+)\s+(\d+)$", line)
        if m:
            seconds = map(float, m.group(2, 3, 4))
            rows[m[1]] = dict(zip(("wall", "trace", "compile"), seconds, strict=True))
            rows[m[1]].update(programs=int(m[5]), hits=int(m[6]))
    return rows


def test_compile_report_counts_programs_and_cache_hits(tmp_path):
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "test_sample.py").write_text(SAMPLE)
    alone = ["-p", "no:xdist"]
    assert _report(tmp_path, tmp_path / "cache", *alone) == {}  # off unless asked for
    first = _report(tmp_path, tmp_path / "cache2", *alone, "--compile-report")
    assert set(first) == {"test_sample.py", "all"}
    sample = first["test_sample.py"]
    # Both jitted functions (and nothing else: no other operation runs), traced and compiled.
    assert sample["programs"] == 2 and sample["hits"] == 0, first
    assert sample["compile"] > 0 and sample["trace"] > 0 and sample["wall"] > sample["compile"]
    assert first["all"] == sample
    # Again with the same cache, under two xdist workers (the sample's tests shared between
    # them): both programs read from it, each worker's counts handed to the controller.
    again = _report(tmp_path, tmp_path / "cache2", "-n", "2", "--compile-report")
    assert set(again) == {"test_sample.py", "all"}
    sample = again["test_sample.py"]
    assert sample["programs"] == sample["hits"] == 2 and sample["trace"] > 0, again
    assert again["all"] == sample
