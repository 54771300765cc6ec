"""Starting N processes of one JAX program on loopback, as on N hosts: simulated CPU devices
(`JAX_NUM_CPU_DEVICES`) per process, a free port for the coordinator, and a time limit after
which every process still running is killed (so that a hang fails a test instead of blocking
the suite)."""

import dataclasses
import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time

from helpers import PYTHONPATH, ROOT


WORKER = pathlib.Path(__file__).resolve().parent / "multihost_worker.py"


@dataclasses.dataclass
class Finished:
    """One process's end: exit status (`None`: killed at the time limit), output, seconds."""

    returncode: int | None
    stdout: str
    stderr: str
    seconds: float


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def environment(devices: int) -> dict[str, str]:
    """This environment for a process with `devices` CPU devices of its own (the test session's
    device-count flag removed; its compilation cache and compiler setting kept)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES=str(devices))
    flags = env.get("XLA_FLAGS", "").split()
    env["XLA_FLAGS"] = " ".join(f for f in flags if "force_host_platform_device_count" not in f)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [PYTHONPATH, env.get("PYTHONPATH")]))
    return env


def start(commands: list[list[str]], devices: int, timeout: float) -> list[Finished]:
    """Run `commands` at once (one per process), each with `devices` CPU devices; after
    `timeout` seconds every process still running is killed (its `returncode` is `None`)."""
    started = time.perf_counter()
    procs = [
        subprocess.Popen(
            cmd,
            cwd=ROOT,
            env=environment(devices),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,  # killed with its children
        )
        for cmd in commands
    ]
    ends: list[float | None] = [None] * len(procs)
    while any(e is None for e in ends) and time.perf_counter() - started < timeout:
        for i, p in enumerate(procs):
            if ends[i] is None and p.poll() is not None:
                ends[i] = time.perf_counter() - started
        time.sleep(0.1)
    finished = []
    for i, p in enumerate(procs):
        killed = ends[i] is None
        if killed:
            os.killpg(p.pid, signal.SIGKILL)
        stdout, stderr = p.communicate()
        seconds = time.perf_counter() - started if killed else ends[i]
        finished.append(Finished(None if killed else p.returncode, stdout, stderr, seconds))
    return finished


def launch(
    spec: dict, out: pathlib.Path, *, processes: int = 2, devices: int = 4, timeout: float = 600
) -> list[dict]:
    """Run the worker's `spec` in `processes` processes of `devices` devices each; returns each
    process's report. Raises `AssertionError` with the processes' output when one fails or
    outlives `timeout`."""
    out.mkdir(parents=True, exist_ok=True)
    spec = dict(spec, out=str(out), processes=processes, coordinator=f"127.0.0.1:{free_port()}")
    spec_file = out / "spec.json"
    spec_file.write_text(json.dumps(spec))
    commands = [[sys.executable, str(WORKER), str(spec_file), str(i)] for i in range(processes)]
    finished = start(commands, devices, timeout)
    if any(f.returncode != 0 for f in finished):
        raise AssertionError(
            "\n".join(
                f"process {i}: exit {f.returncode} after {f.seconds:.0f} s (None: killed at the "
                f"{timeout:.0f} s limit)\n{f.stderr[-3000:]}"
                for i, f in enumerate(finished)
            )
        )
    return [json.loads((out / f"process-{i}.json").read_text()) for i in range(processes)]
