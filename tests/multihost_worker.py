"""One process of a multi-process run (`multihost.launch` starts N of them on loopback).

`python tests/multihost_worker.py SPEC.json PROCESS_ID`: joins the others, builds the spec's
mesh over all processes' devices and runs the spec's steps in order, every process the same
program. Each process writes what it saw to `OUT/process-I.json`; process 0 also writes the
gathered arrays to `OUT/arrays.npz`. Steps:

- `load_hf`: the release-layout checkpoint onto the mesh (bytes read by this process);
- `load_dspark`: the release-layout checkpoint with a DSpark drafter (V4-Flash-0731's
  layout) onto the mesh; the drafter's tensors gathered, by release name;
- `forward`: logits of `ids`; `generate`: greedy tokens of `prompts` (each process's own);
- `train`: one SGD step from the loaded model; its state saved, restored and compared here;
  the new model saved (`OUT/trained`);
- `load_saved`: `equinox_dsv4.load` of `saved` (written by one process) onto the mesh, logits;
- `convert`: `python -m convert` of the checkpoint into `OUT/converted` (its `main`);
- `generate_script`: `examples/generate.py` (its `main`) on the embedded default, fsdp over all
  devices; what each process printed;
- `die`: process 1 exits; process 0 then waits for it in a collective (the test expects JAX
  to stop it with an error).
"""

import json
import os
import pathlib
import sys
import time


spec = json.loads(pathlib.Path(sys.argv[1]).read_text())
process = int(sys.argv[2])
out = pathlib.Path(spec["out"])

import jax  # noqa: E402

import equinox_dsv4 as ed  # noqa: E402


ed.parallel.initialize(
    spec["coordinator"],
    spec["processes"],
    process,
    timeout_s=spec.get("join_timeout", 60),
    heartbeat_timeout_s=spec.get("heartbeat_timeout", 10),
)

import equinox as eqx  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from helpers import run_main  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

import convert  # noqa: E402


report: dict = {
    "process": process,
    "devices": jax.device_count(),
    "local": jax.local_device_count(),
}
arrays: dict[str, np.ndarray] = {}


def script(name: str, argv: list[str]) -> dict:
    """Exit status and output of a script's `main(argv)`, run here (`helpers.run_main`)."""
    done = run_main(name, *argv)
    return {"status": done.returncode, "stdout": done.stdout, "stderr": done.stderr}


def gathered(x) -> np.ndarray:
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def mesh_of(shape: dict[str, int], interleave: bool):
    """`shape` over all devices; `interleave`: the last axis runs across processes (device k of
    every process first), so that a weight split on it is split between the processes."""
    devices = jax.devices()
    if interleave:
        per = jax.local_device_count()
        devices = [devices[p * per + k] for k in range(per) for p in range(jax.process_count())]
    return ed.make_mesh(**shape, devices=devices)


mesh = mesh_of(spec["mesh"], spec.get("interleave", False))
ids = jnp.asarray(spec["ids"], jnp.int32)
logits = eqx.filter_jit(lambda m, x: m(x))
model = None
for step in spec["steps"]:
    t0 = time.perf_counter()
    if step == "load_hf":
        stats: dict = {}
        model = convert.load_hf(
            spec["release"], mesh=mesh, numerics="exact", load_mtp=False, stats=stats
        )
        report["load_hf"] = stats
    elif step == "load_dspark":
        stats = {}
        drafting = convert.load_hf(spec["dspark_release"], mesh=mesh, numerics="exact", stats=stats)
        report["load_dspark"] = stats
        for name, x in ed.ckpt.canonical_pieces(drafting):
            if name.startswith("mtp."):
                arrays[f"dspark:{name}"] = gathered(x)
        report["dspark_split"] = len(drafting.dspark.stages[0].ffn.experts.w1.sharding.device_set)
    elif step == "forward":
        arrays["logits"] = gathered(logits(model, ids))
    elif step == "generate":
        tokens = ed.generate(model, spec["prompts"], max_new_tokens=spec["new_tokens"])
        report["tokens"] = [list(map(int, row)) for row in tokens]
    elif step == "train":
        opt = optax.sgd(0.5)
        train_step = ed.make_train_step(opt, donate=False, remat=None)
        batch = ed.Batch.from_tokens(np.asarray(spec["train_tokens"], np.int32))
        with jax.set_mesh(mesh):
            start = ed.init_train_state(model, opt)
            new, metrics = train_step(start, batch)
            report["train"] = {k: float(metrics[k]) for k in ("loss", "grad_norm")}
            leaves = jax.tree.leaves(eqx.filter(new.model, eqx.is_array))
            split = [x for x in leaves if not x.sharding.is_fully_replicated]
            report["split_after_step"] = [len(split), len(leaves)]
            ed.train.save_train_state(out / "state", new, data_position=7)
            restored, position = ed.train.restore_train_state(out / "state", start)
        # One program for the whole state (leaf by leaf, each shape and placement would be
        # a program of its own).
        same = eqx.filter_jit(lambda a, b: jax.tree.map(jnp.array_equal, a, b))(
            eqx.filter(restored, eqx.is_array), eqx.filter(new, eqx.is_array)
        )
        report["state_restored_equal"] = all(map(bool, jax.tree.leaves(same))) and position == 7
        ed.save(out / "trained", new.model)
    elif step == "lora":
        # A one-process adapter onto the two-process model, one SGD step of it (its loss is
        # the adapted forward's), saved by both.
        adapted = ed.lora.load(model, spec["adapter"])
        opt = optax.sgd(0.5)
        train_step = ed.make_train_step(opt, donate=False, remat=None)
        batch = ed.Batch.from_tokens(np.asarray(spec["train_tokens"], np.int32))
        with jax.set_mesh(mesh):
            new, metrics = train_step(ed.init_train_state(adapted, opt), batch)
        report["lora_train"] = {k: float(metrics[k]) for k in ("loss", "grad_norm")}
        ed.lora.save(new.model, out / "adapter_trained")
    elif step == "load_saved":
        saved = ed.load(spec["saved"], mesh=mesh)
        arrays["saved_logits"] = gathered(logits(saved, ids))
    elif step == "convert":
        argv = [spec["release"], str(out / "converted"), "--dtype", "float32", "--no-mtp"]
        report["convert"] = script("convert", argv + spec["flags"])
    elif step == "generate_script":
        argv = ["--max-new-tokens", "3", "--max-len", "48", "--layers", "1"]
        report["generate_script"] = script("examples/generate.py", argv + spec["flags"])
    elif step == "die":
        if process == 1:
            os._exit(3)
        ed.parallel.barrier("process-1-never-comes")
    else:
        raise ValueError(f"unknown step {step!r}")
    report.setdefault("seconds", {})[step] = round(time.perf_counter() - t0, 2)

(out / f"process-{process}.json").write_text(json.dumps(report))
if ed.parallel.is_primary():
    np.savez(out / "arrays.npz", **arrays)
ed.parallel.barrier("worker-done")
