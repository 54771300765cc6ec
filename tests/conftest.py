import atexit
import gc
import os
import shutil
import tempfile


# The tests run on the CPU. libtpu (a test dependency, for compiling to TPU topologies) would
# otherwise make JAX probe for a TPU at start-up; topologies work without that.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Eight simulated CPU devices for the sharding tests; must be set before JAX initialises.
os.environ.setdefault("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"
# Tests compile far more than they run: LLVM's optimisation passes on XLA:CPU's generated loops
# are most of a compile and buy little here, where the matmuls are library calls. The parity
# tests hold at their tolerances either way; benchmarks do not use it.
if "xla_backend_optimization_level" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_backend_optimization_level=0"

# One persistent compilation cache per test session, made by the first process (pytest's, or
# xdist's controller) and inherited by the workers and by the processes the tests start (the
# README's blocks, several processes, the server): a program they compile alike is compiled
# once.
# Every program into it, not only those that took a second to compile: the workers and the
# subprocesses compile many of the same small ones.
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="equinox_dsv4-jax-cache-")
    atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)

# Parity tests compare float32 against torch float32: no reduced-precision matmul passes. In the
# environment too: the lowered products carry the precision, so the processes the tests start
# compile the programs this process does (and read them from the cache) only if they agree.
os.environ.setdefault("JAX_DEFAULT_MATMUL_PRECISION", "highest")

import jax  # noqa: E402
import pytest  # noqa: E402
from helpers import collect_garbage_less_often, set_suite_cpu_compile_options  # noqa: E402


# `pytest --compile-report`: seconds spent tracing and compiling, per test file.
pytest_plugins = ("compile_report",)

# The suite compiles far more than it runs (helpers.py says why, and what is kept apart).
set_suite_cpu_compile_options()
collect_garbage_less_often()


jax.config.update(
    "jax_persistent_cache_min_compile_time_secs",
    float(os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"]),
)
jax.config.update("jax_numpy_dtype_promotion", "strict")
jax.config.update("jax_numpy_rank_promotion", "raise")
jax.config.update("jax_default_matmul_precision", os.environ["JAX_DEFAULT_MATMUL_PRECISION"])


@pytest.fixture
def getkey():
    """Fresh PRNG keys, deterministic per test."""
    keys = iter(jax.random.split(jax.random.key(0), 1000))
    return lambda: next(keys)


def _mapped_regions() -> int:
    try:
        with open("/proc/self/maps") as f:
            return sum(1 for _ in f)
    except OSError:
        return 0


@pytest.hookimpl(trylast=True)  # after the test's fixtures are torn down
def pytest_runtest_teardown(item, nextitem):
    """Every XLA:CPU executable keeps its own memory mappings alive while its jit cache entry
    lives; over the whole suite they exceed Linux's vm.max_map_count (65530) and the next
    compile dies with SIGSEGV. Dropping the caches once mappings pile up keeps well below it.
    Between a file's tests only near the limit: a file's tests may share warm programs (the
    server's tests hold that a warm engine compiles nothing more)."""
    same_file = nextitem is not None and nextitem.path == item.path
    if _mapped_regions() > (45000 if same_file else 20000):
        jax.clear_caches()
        gc.collect()


# The longest files, and the files whose tests run together (below), start first; the many
# short tests then even out the workers' ends.
_FIRST = (
    "test_readme.py",
    "test_multihost.py",
    "test_train.py",
    "test_decode.py",
    "test_tpu.py",
    "test_gpu.py",
    "test_sharding.py",
    "test_convert.py",
    "test_quantized.py",
    "test_numerics.py",
    "test_speculative.py",
    "test_dspark.py",
    "test_serve.py",
)
# Tests that share a costly module fixture (or, for the TPU compiles, libtpu's one-process
# lock) run on one worker; every other test goes to whichever worker is free.
_TOGETHER = {
    "test_convert.py": "convert",
    "test_multihost.py": "multihost",
    "test_decode.py": "decode",
    "test_sharding.py": "sharding",
    "test_tpu.py": "tpu",
    "test_quantized.py": "quantized",
    "test_numerics.py": "numerics",
    "test_serve.py": "serve",
    "test_speculative.py": "speculative",
    "test_train.py::test_bias_update_and_frozen_leaves": "train-one-pass",
    "test_train.py::test_resume_is_bit_exact": "train-one-pass",
    "test_train.py::test_restore_rejects_another_model": "train-one-pass",
    "test_train.py::test_micro_batches_on_a_data_fsdp_expert_mesh_equal_one_pass_on_one_device": (
        "train-one-pass"
    ),
    "test_lora.py::test_adapter_gradients_equal_autograd_of_merged": "lora-gradients",
}


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(_FIRST)))


@pytest.hookimpl(optionalhook=True)  # `-p no:xdist` runs without it
def pytest_xdist_make_scheduler(config, log):
    # xdist's own `loadgroup` does not group under pytest 9.2 (its node-id suffix is lost).
    from xdist.scheduler import LoadScopeScheduling

    class Scheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            name = nodeid.rsplit("/", 1)[-1]
            for key, group in _TOGETHER.items():
                if name == key or name.startswith(key + "::") or name.startswith(key + "["):
                    return group
            return nodeid

    return Scheduling(config, log)
