import gc
import os


# The tests run on the CPU. libtpu (a test dependency, for compiling to TPU topologies) would
# otherwise make JAX probe for a TPU at start-up; topologies work without that.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Eight simulated CPU devices for the sharding tests; must be set before JAX initialises.
os.environ.setdefault("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"

import jax  # noqa: E402
import pytest  # noqa: E402


jax.config.update("jax_numpy_dtype_promotion", "strict")
jax.config.update("jax_numpy_rank_promotion", "raise")
# Parity tests compare float32 against torch float32: no reduced-precision matmul passes.
jax.config.update("jax_default_matmul_precision", "highest")


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


@pytest.fixture(autouse=True)
def _release_compiled_code():
    """Every XLA:CPU executable keeps its own memory mappings alive while its jit cache entry
    lives; over the whole suite they exceed Linux's vm.max_map_count (65530) and the next
    compile dies with SIGSEGV. Dropping the caches once mappings pile up keeps well below it."""
    yield
    if _mapped_regions() > 20000:
        jax.clear_caches()
        gc.collect()
