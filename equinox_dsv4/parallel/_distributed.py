"""Several processes, one mesh: joining them, and what they must do together.

At size JAX runs as one process per host (a TPU pod slice's workers, a GPU cluster's nodes),
all joined by `jax.distributed`, each holding its own devices of one global mesh. Every process
runs the same program: each jitted call, each `equinox_dsv4.save` / `load` is made by all of
them together. What only one of them may do (write a shared file, rename a directory, print) is
done by the primary process (index 0), between barriers.
"""

import argparse
import os
import pathlib
import secrets
import shutil
import socket
import time
from collections.abc import Sequence

import jax
import numpy as np
from jax.experimental import multihost_utils

from .._typecheck import typechecked


ENV_COORDINATOR = "JAX_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "JAX_NUM_PROCESSES"
ENV_PROCESS_ID = "JAX_PROCESS_ID"


@typechecked
def initialize(
    coordinator: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    timeout_s: int = 300,
    heartbeat_timeout_s: int = 100,
    local_device_ids: Sequence[int] | None = None,
) -> None:
    """Join this process to the others (`jax.distributed.initialize`); call it before anything
    else touches JAX.

    **Arguments:**

    - `coordinator`: `HOST:PORT` of process 0 (it serves there); default the environment's
      `JAX_COORDINATOR_ADDRESS`.
    - `num_processes`, `process_id`: default `JAX_NUM_PROCESSES` / `JAX_PROCESS_ID`. Left unset
      (arguments and environment), JAX detects them and the coordinator on SLURM, Open MPI,
      Cloud TPU and Kubernetes.
    - `timeout_s`: how long to wait for every process to join.
    - `heartbeat_timeout_s`: a process silent this long is taken for dead; the others then
      stop with an error ("another task died") instead of waiting for it forever.
    - `local_device_ids`: the accelerators this process uses (default: all it sees).

    Raises `ConnectionError` naming the coordinator when it cannot be reached within
    `timeout_s`; if the coordinator is reached but not every process joins in time, JAX ends
    the processes with its own error ("DEADLINE_EXCEEDED ... RegisterTask").
    """
    if jax.distributed.is_initialized():
        raise RuntimeError("this process has already joined the others (initialize ran before)")
    coordinator = coordinator or os.environ.get(ENV_COORDINATOR)
    num_processes = _int_from(num_processes, ENV_NUM_PROCESSES)
    process_id = _int_from(process_id, ENV_PROCESS_ID)
    if num_processes is not None and num_processes < 1:
        raise ValueError(f"the number of processes must be positive, got {num_processes}")
    if process_id is not None and num_processes is not None and not 0 <= process_id < num_processes:
        raise ValueError(f"process id {process_id} is not in 0..{num_processes - 1}")
    if coordinator is not None and process_id not in (None, 0):
        # JAX aborts the process (no Python error) when the coordinator cannot be reached.
        _wait_for(coordinator, timeout_s, f"process {process_id} of {num_processes}")
    jax.distributed.initialize(
        coordinator,
        num_processes,
        process_id,
        local_device_ids=local_device_ids,
        initialization_timeout=timeout_s,
        heartbeat_timeout_seconds=heartbeat_timeout_s,
    )


def _wait_for(address: str, timeout_s: float, who: str) -> None:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"coordinator address {address!r} is not HOST:PORT")
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host.strip("[]"), int(port)), timeout=5):
                return
        except OSError as e:
            if time.monotonic() > deadline:
                raise ConnectionError(
                    f"{who} could not join the coordinator at {address} within {timeout_s} s: "
                    f"{e.strerror or e}"
                ) from None
        time.sleep(0.5)


def _int_from(value: int | None, env: str) -> int | None:
    if value is not None:
        return value
    text = os.environ.get(env)
    if text is None:
        return None
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{env}={text!r} is not an integer") from None


@typechecked
def is_primary() -> bool:
    """Whether this is the process that writes shared files and prints (process 0)."""
    return jax.process_index() == 0


@typechecked
def barrier(name: str) -> None:
    """Wait until every process has reached the barrier of this name (no-op in one process)."""
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)


@typechecked
def shared_token() -> str:
    """A random token, the same in every process (process 0's), e.g. for a temporary name that
    all of them write into."""
    token = np.frombuffer(secrets.token_bytes(4), np.uint32)
    if jax.process_count() > 1:
        token = multihost_utils.broadcast_one_to_all(token)
    return f"{int(np.asarray(token)[0]):08x}"


@typechecked
def replace_directory(tmp: pathlib.Path, path: pathlib.Path) -> None:
    """Put the finished directory `tmp` at `path` (the primary's last step of a save). An
    existing `path` stays whole until `tmp` is in place: it is renamed aside, then removed."""
    if not path.exists():
        tmp.rename(path)
        return
    old = path.with_name(f".{path.name}.old")
    shutil.rmtree(old, ignore_errors=True)
    path.rename(old)
    tmp.rename(path)
    shutil.rmtree(old)


@typechecked
def add_distributed_arguments(parser: argparse.ArgumentParser) -> None:
    """`--coordinator HOST:PORT`, `--num-processes N`, `--process-id I` (see `initialize`),
    `--distributed` (let JAX detect them), `--join-timeout`."""
    group = parser.add_argument_group(
        "several processes (one per host of a TPU slice or GPU cluster)",
        "every process runs the same command with its own --process-id; defaults: "
        f"{ENV_COORDINATOR}, {ENV_NUM_PROCESSES}, {ENV_PROCESS_ID}",
    )
    group.add_argument("--coordinator", metavar="HOST:PORT", help="process 0's address")
    group.add_argument("--num-processes", type=int, metavar="N")
    group.add_argument("--process-id", type=int, metavar="I")
    group.add_argument(
        "--distributed",
        action="store_true",
        help="join even without the three above: JAX detects them (SLURM, Open MPI, Cloud TPU, "
        "Kubernetes)",
    )
    group.add_argument(
        "--join-timeout", type=int, default=300, metavar="S", help="seconds to wait for all"
    )


@typechecked
def initialize_from_args(args: argparse.Namespace) -> bool:
    """`initialize` when the arguments (or the environment) ask for several processes and this
    process has not joined them yet (e.g. a script's `main` called from a joined program);
    returns whether it did."""
    if jax.distributed.is_initialized():
        return False
    wanted = (
        args.distributed
        or args.coordinator is not None
        or args.num_processes is not None
        or args.process_id is not None
        or ENV_COORDINATOR in os.environ
    )
    if wanted:
        initialize(
            args.coordinator, args.num_processes, args.process_id, timeout_s=args.join_timeout
        )
    return wanted
