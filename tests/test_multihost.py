"""Several processes, one mesh: two processes of four CPU devices each on loopback, as two
hosts, against one process. Load a sharded release-layout checkpoint (each process reading only
its experts; one with a DSpark drafter too), forward, greedy generation, a train step with its
state saved and restored, saves restored in the other number of processes, the converter; and
the failures: a process that dies, a coordinator that is not there."""

import dataclasses
import re
import sys

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import COMPONENT, LOGITS, adapted_weights, random_adapters
from hf_reference import C, H, S, reference_model, tiny_config
from multihost import free_port, launch, start
from release_layout import write_release_checkpoint

import convert
import equinox_dsv4 as ed


# Expert-heavy (64 routed experts of 128 hidden units beside 32-wide attention), so that splitting
# the experts between the processes halves most of the bytes; HCA ratio 128 (transformers reads
# only 0 / 4 / 128 from a release config).
CONFIG = tiny_config(
    layer_types=(S, C, H),
    num_hash_layers=1,
    compress_rate_hca=128,
    n_routed_experts=64,
    moe_intermediate_size=128,
    num_attention_heads=8,
    o_groups=4,
    num_nextn_predict_layers=1,
)
rng = np.random.default_rng(25)
IDS = rng.integers(0, CONFIG.vocab_size, (4, 24)).tolist()
PROMPTS = [rng.integers(1, CONFIG.vocab_size, 9).tolist(), rng.integers(1, 97, 5).tolist()]
NEW_TOKENS = 6
TRAIN_TOKENS = rng.integers(0, CONFIG.vocab_size, (8, 17)).tolist()
# The same trunk with a DSpark drafter (V4-Flash-0731's layout: three stages under mtp.<i>).
DSPARK = dataclasses.replace(
    CONFIG,
    dspark_block_size=5,
    dspark_markov_rank=8,
    dspark_target_layer_ids=(0, 1, 2),
    dspark_noise_token_id=96,
    dspark_stages=3,
)
# fsdp inside each process, the experts split between the two processes.
MESH = {"fsdp": 4, "expert": 2}


def logits(model, ids=IDS):
    return np.asarray(eqx.filter_jit(lambda m, x: m(x))(model, jnp.asarray(ids, jnp.int32)))


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The checkpoint, a one-process save of it, the two-process run, and the one-process
    model the results are compared with."""
    root = tmp_path_factory.mktemp("multihost")
    reference = reference_model(CONFIG, seed=25)
    write_release_checkpoint(root / "release", CONFIG, reference, shards=3)
    write_release_checkpoint(root / "dspark", DSPARK, reference, shards=3)
    single = convert.load_hf(root / "release", numerics="exact", load_mtp=False)
    ed.save(root / "saved", single)
    adapter = ed.lora.add(single, rank=2, alpha=4.0, key=jax.random.key(3))
    ed.lora.save(random_adapters(adapter, seed=4), root / "adapter")
    spec = {
        "release": str(root / "release"),
        "saved": str(root / "saved"),
        "dspark_release": str(root / "dspark"),
        "adapter": str(root / "adapter"),
        "mesh": MESH,
        "interleave": True,
        "ids": IDS,
        "prompts": PROMPTS,
        "new_tokens": NEW_TOKENS,
        "train_tokens": TRAIN_TOKENS,
        "steps": [
            "load_hf",
            "load_dspark",
            "forward",
            "generate",
            "load_saved",
            "train",
            "lora",
            "convert",
            "generate_script",
        ],
        # What each script is given (a joined process ignores them; they must parse).
        "flags": ["--coordinator", "127.0.0.1:1", "--num-processes", "2", "--process-id", "0"],
    }
    reports = launch(spec, root / "out", timeout=900)
    return root, single, reports, dict(np.load(root / "out" / "arrays.npz"))


def test_two_processes_of_four_devices(run):
    _, _, reports, _ = run
    assert [(r["devices"], r["local"]) for r in reports] == [(8, 4), (8, 4)]


def test_each_process_reads_its_experts_only(run):
    _, _, reports, _ = run
    fractions = [r["load_hf"]["bytes_read"] / r["load_hf"]["bytes_total"] for r in reports]
    print(f"bytes read per process: {fractions} of {reports[0]['load_hf']['bytes_total']}")
    assert all(f <= 0.6 for f in fractions)


def test_dspark_drafter_loads_in_two_processes(run):
    # Every drafter tensor as one process loads it; each process reads about half the bytes
    # (the drafter's stages' experts split between the processes as the trunk's).
    root, _, reports, arrays = run
    single = convert.load_hf(root / "dspark", numerics="exact")
    drafter = {n: x for n, x in ed.ckpt.canonical_pieces(single) if n.startswith("mtp.")}
    assert sorted(drafter) == sorted(n[len("dspark:") :] for n in arrays if n.startswith("dspark:"))
    assert {"mtp.0.main_proj.weight", "mtp.2.markov_head.markov_w1.weight"} <= set(drafter)
    for name, x in drafter.items():
        np.testing.assert_array_equal(arrays[f"dspark:{name}"], np.asarray(x), err_msg=name)
    for r in reports:
        assert r["dspark_split"] == 8
        assert r["load_dspark"]["bytes_read"] <= 0.6 * r["load_dspark"]["bytes_total"]


def test_forward_equals_one_process(run):
    _, single, _, arrays = run
    np.testing.assert_allclose(arrays["logits"], logits(single), **LOGITS)


def test_generate_equals_one_process(run):
    _, single, reports, _ = run
    expected = ed.generate(single, PROMPTS, max_new_tokens=NEW_TOKENS)
    expected = [list(map(int, row)) for row in expected]
    assert [r["tokens"] for r in reports] == [expected, expected]


def test_one_process_save_loads_in_two(run):
    _, single, _, arrays = run
    np.testing.assert_allclose(arrays["saved_logits"], logits(single), **LOGITS)


# The workers' optimizer: plain SGD, whose update is the gradient itself (Adam's first step,
# g / |g|, would magnify float32 summation-order noise in near-zero gradient entries into
# full-size updates).
SGD = optax.sgd(0.5)


def _one_sgd_step(model, reports, key: str):
    # One process's step on the workers' batch; its loss and gradient norm equal what each
    # worker reported under `key`.
    step = ed.make_train_step(SGD, donate=False, remat=None)
    batch = ed.Batch.from_tokens(np.asarray(TRAIN_TOKENS, np.int32))
    new, metrics = step(ed.init_train_state(model, SGD), batch)
    for r in reports:
        np.testing.assert_allclose(r[key]["loss"], metrics["loss"], rtol=1e-6)
        np.testing.assert_allclose(r[key]["grad_norm"], metrics["grad_norm"], rtol=1e-5)
    return new, metrics


def test_train_step_equals_one_process_and_its_save_loads_in_one(run):
    # FSDP inside each process, experts split between them (plain SGD, `SGD`).
    root, single, reports, _ = run
    new, metrics = _one_sgd_step(single, reports, "train")
    for r in reports:
        assert r["state_restored_equal"]
        split, leaves = r["split_after_step"]
        assert split > leaves // 3  # the weights stay sharded after the update
    trained = ed.load(root / "out" / "trained")
    for a, b in zip(
        jax.tree.leaves(eqx.filter(new.model, eqx.is_array)),
        jax.tree.leaves(eqx.filter(trained, eqx.is_array)),
        strict=True,
    ):
        np.testing.assert_allclose(b, a, **COMPONENT)
    # The train state written by two processes, restored in one.
    restored, position = ed.train.restore_train_state(
        root / "out" / "state", ed.init_train_state(single, SGD)
    )
    assert position == 7 and int(restored.step) == 1


def test_lora_in_two_processes(run):
    # An adapter on the model split over two processes: one SGD step of the adapters alone
    # (its loss, the adapted forward's, and gradient norm) and the adapter both processes
    # saved, against one process.
    root, single, reports, _ = run
    adapted = ed.lora.load(single, root / "adapter")
    new, _ = _one_sgd_step(adapted, reports, "lora_train")
    saved = ed.lora.load(single, root / "out" / "adapter_trained")
    pairs = zip(adapted_weights(new.model), adapted_weights(saved), strict=True)
    for one, two in pairs:
        np.testing.assert_allclose(two.merged(), one.merged(), **COMPONENT)


def test_convert_in_two_processes(run):
    root, single, reports, _ = run
    # Onto `expert` over all eight devices (the default with several processes): each process
    # reads its half of the experts. Only process 0 reports.
    first, second = (r["convert"] for r in reports)
    assert first["status"] == second["status"] == 0, first["stderr"] + second["stderr"]
    assert "converted" in first["stderr"] and second["stderr"] == ""
    read, total = re.search(
        r"([\d.]+) MiB \(this process; all: ([\d.]+) MiB\)", first["stderr"]
    ).groups()
    assert float(read) <= 0.6 * float(total)
    converted = ed.load(root / "out" / "converted")
    for a, b in zip(
        jax.tree.leaves(eqx.filter(single, eqx.is_array)),
        jax.tree.leaves(eqx.filter(converted, eqx.is_array)),
        strict=True,
    ):
        np.testing.assert_array_equal(b, a)


def test_generate_script_in_two_processes(run):
    _, _, reports, _ = run
    first, second = (r["generate_script"] for r in reports)
    assert first["status"] == second["status"] == 0, first["stderr"] + second["stderr"]
    assert "decode: 2 tokens" in first["stderr"] and first["stdout"].strip()
    assert second["stdout"] == second["stderr"] == ""  # only process 0 prints


def test_a_dead_process_stops_the_others(tmp_path):
    spec = {"mesh": {"fsdp": 8}, "ids": IDS, "steps": ["die"], "heartbeat_timeout": 5}
    with pytest.raises(AssertionError) as failed:
        launch(spec, tmp_path, timeout=120)
    text = str(failed.value)
    assert "process 1: exit 3" in text
    # Process 0 is stopped by JAX (heartbeats missed for 5 s), not by the time limit.
    assert "process 0: exit None" not in text and "another task died" in text, text


def test_an_absent_coordinator_is_an_error(tmp_path):
    command = [sys.executable, "examples/generate.py", "--coordinator", f"127.0.0.1:{free_port()}"]
    command += ["--num-processes", "2", "--process-id", "1", "--join-timeout", "5"]
    (finished,) = start([command], devices=4, timeout=120)
    assert finished.returncode == 1, finished.stderr
    assert "error: process 1 of 2 could not join the coordinator at 127.0.0.1:" in finished.stderr
    assert finished.seconds < 60


def test_replace_directory_keeps_the_old_one_until_the_new_is_in_place(tmp_path):
    # The primary's last step of `save_train_state` and `lora.save`: a new directory at `path`,
    # the old one gone, nothing left beside them; with no old one, the new one is moved there.
    path, new = tmp_path / "state", tmp_path / ".state.tmp"
    new.mkdir()
    (new / "file").write_text("first")
    ed.parallel.replace_directory(new, path)
    new.mkdir()
    (new / "file").write_text("second")
    ed.parallel.replace_directory(new, path)
    assert (path / "file").read_text() == "second"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state"]
