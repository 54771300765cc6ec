"""What many test files share: running a script in a fresh process, and the tolerances parity is
held to."""

import os
import pathlib
import subprocess
import sys

import numpy as np


ROOT = pathlib.Path(__file__).resolve().parent.parent

# Parity with an independent float32 reference: each component to 1e-5, a whole model's logits
# (dozens of layers of float32 rounding) to 1e-4.
COMPONENT = dict(atol=1e-5, rtol=1e-5)
LOGITS = dict(atol=1e-4, rtol=1e-4)
# Two of our own computations that must agree to float32 rounding (scan vs unrolled, eager vs
# jitted): tighter than any parity.
SAME = dict(atol=1e-6, rtol=1e-6)


def assert_close(actual, expected, tol: dict = COMPONENT, err_msg: str = "") -> None:
    """`np.testing.assert_allclose` at one of the tolerances above."""
    np.testing.assert_allclose(np.asarray(actual), np.asarray(expected), err_msg=err_msg, **tol)


def run_python(
    *args,
    cwd: pathlib.Path = ROOT,
    input: str | None = None,
    env: dict | None = None,
    timeout: float = 900,
) -> subprocess.CompletedProcess:
    """`python *args` in a fresh process: on the CPU, with this session's environment (conftest's
    eight devices and compilation cache, which the process shares) and the repository importable
    from any `cwd`. Returns the finished process (text stdout and stderr)."""
    base = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
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
