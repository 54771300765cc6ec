"""The package's layout: sub-packages that import one way only (each `__init__` says what it may
import), modules of a readable size, the execution policy out of the math's signatures, a small
public surface that nothing outside the package bypasses, and public entry points that refuse
a wrong type."""

import ast
import inspect
import pathlib
import re

import pytest
from helpers import ROOT, run_python

import equinox_dsv4 as ed


PACKAGE = ROOT / "equinox_dsv4"
SUBPACKAGES = sorted(p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file())
NAMESPACES = [name for name in ed.__all__ if inspect.ismodule(getattr(ed, name))]


def allowed_imports() -> dict[str, set[str]]:
    """Each sub-package's `May import:` line, as the set of sub-packages it names."""
    out = {}
    for name in SUBPACKAGES:
        doc = ast.get_docstring(ast.parse((PACKAGE / name / "__init__.py").read_text())) or ""
        m = re.search(r"May import: (.*?)\.\s*$", doc, re.MULTILINE | re.DOTALL)
        assert m, f"equinox_dsv4/{name}/__init__.py does not say what it may import"
        text = " ".join(m[1].split())
        if text == "nothing of the package":
            out[name] = set()
        elif text == "everything in the package":
            out[name] = set(SUBPACKAGES) - {name} | {"*"}
        else:
            out[name] = {part.strip() for part in text.split(",")}
            assert out[name] <= set(SUBPACKAGES), (name, out[name])
    return out


def imported_subpackages(source: str, package: str) -> set[str]:
    """The sub-packages of `equinox_dsv4` that a module of sub-package `package` imports
    (relative or absolute), itself excluded; the package's root modules (`_typecheck`) are
    everyone's."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        names = []
        if isinstance(node, ast.ImportFrom):
            if node.level == 2 and node.module:
                names.append(node.module.split(".")[0])
            elif node.level == 2:
                names += [alias.name for alias in node.names]
            elif node.level == 0 and node.module and node.module.startswith("equinox_dsv4."):
                names.append(node.module.split(".")[1])
            elif node.level == 0 and node.module == "equinox_dsv4":
                names += [alias.name for alias in node.names]
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == "equinox_dsv4":
                    names.append(parts[1] if len(parts) > 1 else "*")
        found |= {n for n in names if not n.startswith("_") and n != package}
    return found


def upward_imports(allowed: dict[str, set[str]], package: pathlib.Path = PACKAGE) -> list[str]:
    problems = []
    for name in SUBPACKAGES:
        for module in sorted((package / name).glob("*.py")):
            for target in sorted(imported_subpackages(module.read_text(), name)):
                if target not in allowed[name]:
                    problems.append(f"{module.relative_to(package)} imports {target}")
    return problems


def test_imports_go_one_way():
    allowed = allowed_imports()
    assert upward_imports(allowed) == []
    # The declared graph has no cycle: it orders the sub-packages.
    order, left = [], dict(allowed)
    while left:
        ready = sorted(n for n, deps in left.items() if deps - {"*"} <= set(order))
        assert ready, f"the declared imports go in a circle among {sorted(left)}"
        order += ready
        left = {n: d for n, d in left.items() if n not in ready}
    assert order.index("config") < order.index("nn") < order.index("inference")


def test_an_upward_import_is_caught(tmp_path):
    # The check itself: the math importing inference (or anything above it) fails.
    allowed = allowed_imports()
    for text in (
        "from ..inference import generate\n",
        "from ..inference._generate import generate\n",
        "import equinox_dsv4.train\n",
        "from equinox_dsv4 import parallel\n",
    ):
        assert imported_subpackages(text, "nn") - allowed["nn"], text
    copy = tmp_path / "equinox_dsv4"
    for path in PACKAGE.rglob("*.py"):
        target = copy / path.relative_to(PACKAGE)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(path.read_text())
    assert upward_imports(allowed, copy) == []
    (copy / "nn" / "_upward.py").write_text("from ..train import make_train_step\n")
    assert upward_imports(allowed, copy) == ["nn/_upward.py imports train"]


def test_modules_are_at_most_450_lines():
    long = {
        str(p.relative_to(ROOT)): n
        for p in list(PACKAGE.rglob("*.py")) + list((ROOT / "convert").glob("*.py"))
        if (n := len(p.read_text().splitlines())) > 450
    }
    assert long == {}


def test_the_policy_is_no_keyword_of_the_math():
    math = sum(p.read_text().count("policy=") for p in (PACKAGE / "nn").glob("*.py"))
    everywhere = sum(p.read_text().count("policy=") for p in PACKAGE.rglob("*.py"))
    assert math == 0 and everywhere <= 20, (math, everywhere)
    # The math names no backend.
    for path in (PACKAGE / "nn").glob("*.py"):
        assert not re.search(r"XLA|\bCPU\b|\bTPU\b|\bGPU\b", path.read_text()), path


def test_public_surface():
    assert len(ed.__all__) <= 30 and len(set(ed.__all__)) == len(ed.__all__)
    # The tools with extras of their own are not imported by the package itself.
    assert set(NAMESPACES) == set(SUBPACKAGES) - {"compile", "serve"}
    for namespace in [ed, *(getattr(ed, n) for n in NAMESPACES)]:
        for name in namespace.__all__:
            assert hasattr(namespace, name), (namespace.__name__, name)
    for internal in ("LayerStack", "Segment", "attend", "CompressorState", "LayerCache", "Gate"):
        assert not hasattr(ed, internal), internal


def test_nothing_outside_the_package_imports_a_private_name():
    pattern = re.compile(r"equinox_dsv4\._|from \._|equinox_dsv4\.[a-z_]*\._")
    found = []
    for folder in ("convert", "examples", "benchmarks", "tests"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for i, line in enumerate(path.read_text().splitlines(), 1):
                if pattern.search(line):
                    found.append(f"{path.relative_to(ROOT)}:{i}: {line.strip()}")
    assert found == []


# The building blocks the model's traces call many times over (the math's and the execution
# layer's functions, the quantisation round trips) are checked by the suite's own type-checking
# hook only; what a user calls is checked everywhere.
TRACED = {"execution", "nn"}
TRACED_QUANT = {"act_quant", "kv_round_trip", "index_round_trip", "fp8_round_trip"}
TRACED_QUANT |= {"fp4_round_trip", "hadamard", "bf16_round", "dense", "scale_grid"}
TRACED_QUANT |= {"whole_blocks", "multipliers"}
MODEL_ENTRY_POINTS = ["__call__", "streams", "init_cache", "decode", "mtp_logits"]
MODEL_ENTRY_POINTS += ["init_mtp_cache", "mtp_decode"]


def _public_functions():
    for name in set(NAMESPACES) - TRACED:
        namespace = getattr(ed, name)
        for attr in namespace.__all__:
            obj = getattr(namespace, attr)
            if inspect.isfunction(obj) and not (name == "quant" and attr in TRACED_QUANT):
                yield f"{name}.{attr}", obj
    yield "execution.with_policy", ed.execution.with_policy
    for attr in MODEL_ENTRY_POINTS:
        yield f"DeepseekV4.{attr}", getattr(ed.DeepseekV4, attr)
    yield "KVCache.rewind", ed.KVCache.rewind


def test_public_functions_check_their_argument_types():
    unchecked, unannotated = [], []
    for name, fn in _public_functions():
        if not getattr(fn, "__equinox_dsv4_typechecked__", False):
            unchecked.append(name)
        for parameter in inspect.signature(fn).parameters.values():
            skip = parameter.name == "self" or parameter.kind in (
                parameter.VAR_POSITIONAL,
                parameter.VAR_KEYWORD,
            )
            if not skip and parameter.annotation is inspect.Parameter.empty:
                unannotated.append(f"{name}({parameter.name})")
    assert unchecked == [] and unannotated == [], (unchecked, unannotated)


# Run without the test suite's own type-checking hook: what a user gets.
WRONG_TYPES = """
import equinox_dsv4 as ed, jax, convert

def refused(call, *args, **kwargs):
    try:
        call(*args, **kwargs)
    except TypeError as e:
        return str(e)
    raise AssertionError(f"{call.__name__} accepted {args} {kwargs}")

messages = [{"role": "user", "content": "Hi"}]
print(refused(ed.chat_prompt, messages, thinking="auto"))
print(refused(ed.parse_reply, b"bytes"))
print(refused(ed.Sampling, temperature="0.7"))
print(refused(ed.Sampling, top_k=2.5))
print(refused(ed.make_optimizer, "1e-4"))
print(refused(ed.make_mesh, fsdp="2"))
print(refused(ed.inference.cache_bytes, ed.Config.tiny(), "4096"))
print(refused(ed.execution.Policy, few_writes=1.5))
print(refused(ed.execution.with_policy, ed.Config.tiny(), "cpu"))
print(refused(convert.load_hf, 3))
print("--- refused")
"""


def test_public_entry_points_refuse_wrong_types_without_the_test_hook():
    env = {"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)}
    result = run_python("-c", WRONG_TYPES, env=env, timeout=300)
    assert result.returncode == 0 and "--- refused" in result.stdout, result.stderr[-3000:]
    # Each names what it refused.
    assert "thinking" in result.stdout and "temperature" in result.stdout


@pytest.mark.parametrize("name", SUBPACKAGES)
def test_every_subpackage_says_what_it_holds(name):
    doc = ast.get_docstring(ast.parse((PACKAGE / name / "__init__.py").read_text()))
    assert doc and len(doc.split()) > 15 and "May import:" in doc
