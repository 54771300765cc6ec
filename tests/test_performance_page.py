"""docs/performance.md is what benchmarks/performance.py writes from benchmarks/results/*.json:
a result file changed without regenerating the page fails here. Every target row gives a
figure or says that no result file gives one. Standard library only: no JAX."""

import importlib.util
import json
import pathlib
import re

from helpers import ROOT, run_python


SCRIPT = ROOT / "benchmarks" / "performance.py"
PAGE = ROOT / "docs" / "performance.md"
RESULTS = ROOT / "benchmarks" / "results"


def _generator():
    spec = importlib.util.spec_from_file_location("performance_page", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _generate(out: pathlib.Path, results: pathlib.Path = RESULTS) -> None:
    done = run_python(SCRIPT, "--out", out, "--results", results, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr


def _target_rows(page: str) -> list[list[str]]:
    section = page.split("\n## Targets\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ")]
    assert rows[0].startswith("| target | threshold | measured | status |"), rows[0]
    return [[c.strip() for c in line.strip("|").split(" | ")] for line in rows[1:]]


def test_page_is_generated_from_the_result_files(tmp_path):
    out = tmp_path / "performance.md"
    _generate(out)
    assert PAGE.exists(), "docs/performance.md is missing: python benchmarks/performance.py"
    assert out.read_bytes() == PAGE.read_bytes(), (
        "docs/performance.md differs from what benchmarks/results/*.json give: regenerate it "
        "with python benchmarks/performance.py"
    )
    # The same bytes again: the output depends on the result files alone.
    again = tmp_path / "again.md"
    _generate(again)
    assert again.read_bytes() == out.read_bytes()


def test_every_target_has_a_figure_or_says_no_result_file():
    generator = _generator()
    rows = _target_rows(PAGE.read_text())
    assert len(rows) == len(generator.TARGETS)
    for target, (name, threshold, measured, status, _) in zip(generator.TARGETS, rows, strict=True):
        assert name == target.name and threshold == target.threshold
        if measured.startswith(generator.NO_RESULT):
            assert status == "-", name
        else:
            assert re.search(r"\d", measured), f"{name}: no figure in {measured!r}"
            expected = {"met", "missed"} if target.compare else {"reported"}
            assert status in expected, f"{name}: {status}"


def test_targets_without_result_files_say_so(tmp_path):
    """With no result files every target reads "no result file"; with one file lacking the
    row a target reads, that target says so and the others still compute."""
    generator = _generator()
    empty = tmp_path / "empty"
    empty.mkdir()
    for row in generator.targets_table(generator.load(empty)):
        assert row["measured"] == generator.NO_RESULT and row["status"] == "-", row
    partial = tmp_path / "partial"
    partial.mkdir()
    decode = json.loads((RESULTS / "decode.json").read_text())
    decode["rows"] = [r for r in decode["rows"] if r["context"] != 65536]
    (partial / "decode.json").write_text(json.dumps(decode))
    rows = {r["target"]: r for r in generator.targets_table(generator.load(partial))}
    long_context = rows["decode, float32: ms per token at 64k context over at 1k"]
    assert long_context["measured"].startswith(generator.NO_RESULT), long_context
    per_token = rows["decode, float32, 4k context: per token against transformers"]
    assert per_token["status"] in {"met", "missed"}, per_token


def test_check_reports_a_stale_page(tmp_path):
    stale = tmp_path / "performance.md"
    stale.write_text(PAGE.read_text().replace("## Targets", "## Targets (edited)", 1))
    command = (SCRIPT, "--check", "--out", stale)
    done = run_python(*command, timeout=120)
    assert done.returncode == 1 and "differs" in done.stdout, done.stdout + done.stderr
    stale.write_bytes(PAGE.read_bytes())
    done = run_python(*command, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
