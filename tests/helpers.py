"""What many test files share: running a script in a fresh process (or through its `main` in
this one), the tolerances parity is held to, and the compiler setting the suite's processes
compile with."""

import contextlib
import dataclasses
import gc
import importlib
import io
import os
import pathlib
import re
import subprocess
import sys
import types
import warnings
from typing import TYPE_CHECKING

import jax
import numpy as np


if TYPE_CHECKING:
    import equinox_dsv4 as ed


ROOT = pathlib.Path(__file__).resolve().parent.parent
# For the Python processes the tests start: the repository importable, and tests/site, whose
# sitecustomize makes them compile as the test session does.
PYTHONPATH = os.pathsep.join([str(ROOT), str(ROOT / "tests" / "site")])

# Parity with an independent float32 reference: each component to 1e-5, a whole model's logits
# (dozens of layers of float32 rounding) to 1e-4.
COMPONENT = dict(atol=1e-5, rtol=1e-5)
LOGITS = dict(atol=1e-4, rtol=1e-4)
# Two of our own computations that must agree to float32 rounding (scan vs unrolled, eager vs
# jitted): tighter than any parity.
SAME = dict(atol=1e-6, rtol=1e-6)
# The report of `python -m equinox_dsv4.compile --json`, the same for every platform (TPU, GPU,
# CPU devices).
COMPILE_REPORT_KEYS = sorted(
    ["batch", "build_seconds", "cache_bytes", "device", "device_memory_bytes", "devices",
     "dtype", "layers", "lora", "max_len", "mesh", "micro_batches", "model", "numerics",
     "parameter_bytes", "parameter_bytes_per_device_ideal", "parameters", "peak", "phases",
     "platform", "policy", "quantized", "remat", "rules", "topology", "unrolled"]
)  # fmt: skip


def assert_close(actual, expected, tol: dict = COMPONENT, err_msg: str = "") -> None:
    """`np.testing.assert_allclose` at one of the tolerances above."""
    np.testing.assert_allclose(np.asarray(actual), np.asarray(expected), err_msg=err_msg, **tol)


def on_device(value, dtype) -> "jax.Array":
    """`jnp.asarray(value, dtype)` with the cast made on the host (float64 narrowed to float32
    first, as JAX does): `jnp.asarray` compiles a conversion or copy program per shape."""
    value = np.asarray(value)
    if value.dtype == np.float64:
        value = value.astype(np.float32)
    return jax.device_put(value.astype(dtype))


def random_adapters(model, seed: int, scale: float = 0.3):
    """`model` with every LoRA adapter's `A` and `B` random (a fresh `B` is zero, which would
    leave nothing to compare)."""
    import jax

    import equinox_dsv4 as ed

    rng = np.random.default_rng(seed)

    def fill(w):
        if not isinstance(w, ed.lora.LoraWeight):
            return w
        a = rng.standard_normal(w.a.shape) / np.sqrt(w.a.shape[-1])
        b = scale * rng.standard_normal(w.b.shape) / np.sqrt(w.b.shape[-1])
        return ed.lora.LoraWeight(w.base, on_device(a, w.a.dtype), on_device(b, w.b.dtype), w.scale)

    return jax.tree.map(fill, model, is_leaf=lambda x: isinstance(x, ed.lora.LoraWeight))


def adapted_weights(model) -> list:
    """The `LoraWeight`s of `model`, in tree order."""
    import jax

    import equinox_dsv4 as ed

    leaves = jax.tree.leaves(model, is_leaf=ed.quant.is_weight)
    return [w for w in leaves if isinstance(w, ed.lora.LoraWeight)]


def run_python(
    *args,
    cwd: pathlib.Path = ROOT,
    input: str | None = None,
    env: dict | None = None,
    timeout: float = 900,
) -> subprocess.CompletedProcess:
    """`python *args` in a fresh process: on the CPU, with this session's environment (conftest's
    eight devices and compilation cache, which the process shares, and its compiler setting) and
    the repository importable from any `cwd`. Returns the finished process (text stdout and
    stderr)."""
    base = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=PYTHONPATH)
    return subprocess.run(
        [sys.executable, *map(str, args)],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=base if env is None else env,
        input=input,
        timeout=timeout,
    )


def succeeded(result: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    """`result`, after asserting that it exited 0 (else the end of its stderr is the message)."""
    assert result.returncode == 0, result.stderr[-6000:]
    return result


def _print_warning(message, category, filename, lineno, file=None, line=None) -> None:
    sys.stderr.write(warnings.formatwarning(message, category, filename, lineno, line))


def run_main(script: str, *args, input: str | None = None) -> subprocess.CompletedProcess:
    """`python script *args` (a path such as `examples/generate.py`), or `python -m script *args`
    (a package such as `convert`, whose `__main__` is guarded), run in this process through the
    script's `main(argv)`: what `run_python` returns, without a process start, and with the
    programs this worker already traced at hand. Its output is captured (its import's too);
    its warnings are printed to its stderr, every time, not raised as the suite's filter would;
    `input` is its stdin; the exit status is a process's (`None` is 0, a message is 1). For
    what only a process shows (exit by a signal, a setting made before JAX starts, memory
    mappings, the `__main__` line), `run_python`."""
    argv = list(map(str, args))
    stdout, stderr = io.StringIO(), io.StringIO()
    with (
        contextlib.redirect_stdout(stdout),
        contextlib.redirect_stderr(stderr),
        warnings.catch_warnings(),
    ):
        warnings.simplefilter("always")
        # Printed, not handed to pytest's recorder.
        warnings.showwarning = _print_warning
        saved_stdin, sys.stdin = sys.stdin, io.StringIO(input or "")
        try:
            status = script_module(script).main(argv)
        except SystemExit as e:  # argparse's errors and --help
            status = e.code
        finally:
            sys.stdin = saved_stdin
    if status is None:
        status = 0
    elif not isinstance(status, int):
        print(status, file=stderr)
        status = 1
    out, err = stdout.getvalue(), stderr.getvalue()
    return subprocess.CompletedProcess([script, *argv], status, out, err)


def script_module(script: str) -> types.ModuleType:
    """The module of `script`: a path such as `examples/chat.py`, imported by its file name with
    its folder on the path (as the script imports its siblings), or a package run with `-m`,
    its `__main__` (which must be guarded)."""
    if script.endswith(".py"):
        path = ROOT / script
        sys.path.insert(0, str(path.parent))
        try:
            module = importlib.import_module(path.stem)
        finally:
            sys.path.remove(str(path.parent))
        assert pathlib.Path(module.__file__).resolve() == path, module.__file__
    else:
        module = importlib.import_module(f"{script}.__main__")
    return module


# 8- and 4-bit float types in a program's MLIR text (f8E4M3FN, f8E8M0FNU, f4E2M1FN, ...).
_LOW_PRECISION_FLOAT = re.compile(r"f[48]E\d")


# For every XLA:CPU program of the suite: one LLVM module per program, not split for threads
# that a two-core machine running three workers does not have (the split cost more CPU than it
# saved), and without LLVM's costlier passes, which buy nothing for programs compiled more than
# run. Neither changes a result: both are code generation, after XLA has fixed the arithmetic.
_QUICKER_CPU_COMPILES = (
    ("xla_cpu_parallel_codegen_split_count", 1),
    ("xla_llvm_disable_expensive_passes", True),
)


def set_suite_cpu_compile_options() -> None:
    """From now on this process compiles its XLA:CPU programs with XLA's classic LLVM IR fusion
    emitters instead of its MLIR ones, which take longer to compile a fusion, and with
    `_QUICKER_CPU_COMPILES`. Programs holding 8- or 4-bit floats keep the MLIR emitters: the
    classic ones round and pack those wrongly (seen: float32 -> float8_e4m3fn off by one step,
    an invalid i4 bitcast). Per program, through a private hook of JAX's, rather than in
    XLA_FLAGS (which libtpu also parses, refusing the flag): if the hook goes, this raises; if
    JAX stops calling it, test_quantized's `test_suite_compiles_8_bit_floats_...` fails."""
    from jax._src import compiler

    compile_or_get_cached = compiler.compile_or_get_cached
    if getattr(compile_or_get_cached, "suite_cpu_compile_options", False):
        return

    def compile_for_suite(backend, computation, devices, options, *args, **kwargs):
        if backend.platform == "cpu":
            classic = not _LOW_PRECISION_FLOAT.search(str(computation))
            compile_for_suite.programs[classic] += 1
            emitters = [("xla_cpu_use_fusion_emitters", False)] if classic else []
            options.env_option_overrides = [
                *options.env_option_overrides,
                *_QUICKER_CPU_COMPILES,
                *emitters,
            ]
        return compile_or_get_cached(backend, computation, devices, options, *args, **kwargs)

    compile_for_suite.suite_cpu_compile_options = True
    # CPU programs compiled since: {True: with the classic emitters, False: with the MLIR ones}.
    compile_for_suite.programs = {True: 0, False: 0}
    compiler.compile_or_get_cached = compile_for_suite


def collect_garbage_less_often() -> None:
    """Python's cyclic garbage collector, run after 20,000 net allocations instead of 700, and
    its full passes rarer: tracing a model allocates millions of short-lived objects, and with
    torch and transformers loaded each full pass walks millions more. Garbage is still
    collected: conftest also collects when it drops the jit caches."""
    gc.set_threshold(20_000, 50, 100)


def short_tiny(**overrides) -> "ed.Config":
    """The embedded tiny model's widths (`Config.tiny(**overrides)`) with every kind of layer and
    both layer drivers in the fewest blocks to trace and compile: a sliding hash-routed layer on
    its own, then a scanned stack of two (CSA, HCA) periods with learned routing. Its
    `to_hf()` leaves out `scan_min_repeats`: read it back with `scan_min_repeats=2`."""
    import equinox_dsv4 as ed  # not at the top: the scripts' start-up imports this file

    S, C, H = ed.config.SLIDING, ed.config.CSA, ed.config.HCA
    return dataclasses.replace(
        ed.Config.tiny(**overrides),
        num_hidden_layers=5,
        layer_types=(S, C, H, C, H),
        mlp_layer_types=(ed.config.HASH_MOE,) + (ed.config.MOE,) * 4,
        scan_min_repeats=2,
    )


def generate_streamed(model, prompts, **kwargs) -> tuple[list[list[int]], dict]:
    """`ed.generate(model, prompts, **kwargs)`'s rows and its stats; the tokens its callback
    streamed, row by row, must be those rows."""
    import equinox_dsv4 as ed  # not at the top: the scripts' start-up imports this file

    seen, stats = [], {}
    rows = ed.generate(
        model,
        prompts,
        callback=lambda tokens, live: seen.append((tokens.copy(), live.copy())),
        stats=stats,
        **kwargs,
    )
    assert [[int(t[b]) for t, r in seen if r[b]] for b in range(len(prompts))] == rows
    return rows, stats


def assert_draws_from(
    pairs, exact: np.ndarray, wrong: np.ndarray, level: float = 1e-3, power: float = 0.99
) -> None:
    """The first two generated tokens of many copies of one prompt (`pairs`) against their
    exact joint distribution `exact` `[vocab, vocab]`, by a chi-square test at `level`, whose
    power against the distribution `wrong` (what a broken sampler would give) must exceed
    `power`. Tokens the filters exclude must never occur; cells expected below 5 are pooled."""
    import scipy.stats

    n = len(pairs)
    counts = np.zeros(exact.shape)
    for x1, x2 in pairs:
        counts[x1, x2] += 1
    assert counts[exact == 0].sum() == 0
    pooled = (exact > 0) & (exact * n < 5)
    kept = exact * n >= 5

    def cells(x):
        return np.append(x[kept], x[pooled].sum()) if pooled.any() else x[kept]

    observed, expected, alternative = cells(counts), cells(exact) * n, cells(wrong) * n
    df = len(observed) - 1
    chi2 = ((observed - expected) ** 2 / expected).sum()
    critical = scipy.stats.chi2.isf(level, df)
    noncentrality = ((alternative - expected) ** 2 / expected).sum()
    test_power = scipy.stats.ncx2.sf(critical, df, noncentrality)
    assert test_power > power, test_power
    p_value = scipy.stats.chi2.sf(chi2, df)
    assert p_value > level, (chi2, df, p_value)


def equations(jaxpr):
    """Every equation of a jaxpr and of the jaxprs in its equations' parameters (loop and
    branch bodies, custom derivatives, inner calls), depth first."""
    for eqn in jaxpr.eqns:
        yield eqn
        for param in eqn.params.values():
            for sub in param if isinstance(param, tuple | list) else (param,):
                if isinstance(sub, jax.extend.core.ClosedJaxpr):
                    yield from equations(sub.jaxpr)
                elif isinstance(sub, jax.extend.core.Jaxpr):
                    yield from equations(sub)


_LOWERED: list[str] = []


def lowered() -> list[str]:
    """The names of the programs lowered in this process since the first call, in order (the
    list grows): one for each miss of a jitted function's cache (a new trace, or arguments of
    other shapes, shardings or commitment), whether or not the persistent compilation cache
    then holds its executable."""
    if not getattr(lowered, "listening", False):
        # Not at import: tests/site imports this module while JAX itself is being imported.
        jax.monitoring.register_event_duration_secs_listener(_count_lowering)
        lowered.listening = True
    return _LOWERED


def _count_lowering(event: str, _seconds: float, **kwargs) -> None:
    if event == "/jax/core/compile/jaxpr_to_mlir_module_duration":
        _LOWERED.append(str(kwargs.get("fun_name")))


# The collectives of an XLA program, as its optimised HLO names them.
_COLLECTIVE = re.compile(
    r"\b(all-to-all|all-gather|all-reduce|collective-permute|reduce-scatter)\("
)


@contextlib.contextmanager
def compiled_collectives():
    """Inside the block, a list of `(program name, its collectives)` for each program this
    process compiles (or reads from the persistent cache), from its partitioned HLO: what it
    sends between devices, which the StableHLO that JAX lowers to does not yet say."""
    from jax._src import compiler

    seen: list[tuple[str, set[str]]] = []
    compile_or_get_cached = compiler.compile_or_get_cached

    def recording(backend, computation, *args, **kwargs):
        executable = compile_or_get_cached(backend, computation, *args, **kwargs)
        text = "\n".join(m.to_string() for m in executable.hlo_modules())
        name = str(computation.operation.attributes["sym_name"]).strip('"')
        seen.append((name, set(_COLLECTIVE.findall(text))))
        return executable

    compiler.compile_or_get_cached = recording
    try:
        yield seen
    finally:
        compiler.compile_or_get_cached = compile_or_get_cached
