"""`python -m equinox_dsv4.compile`: compile full-size programs without weights, and say what
they need per device (see `python -m equinox_dsv4.compile --help`); `run` is the tool without
its command line (`parse_args` reads one), `target` the devices of a `--topology` (TPU, or
NVIDIA GPUs).

May import: everything in the package.
"""

from ._cli import DoesNotFit as DoesNotFit, main as main, parse_args as parse_args, run as run
from ._targets import (
    GPU_CONFIGS as GPU_CONFIGS,
    GPU_PEAKS as GPU_PEAKS,
    TPU_PEAKS as TPU_PEAKS,
    Target as Target,
    gpu_config_field as gpu_config_field,
    parse_topology as parse_topology,
    target as target,
)


__all__ = [
    "main",
    "run",
    "parse_args",
    "DoesNotFit",
    "Target",
    "target",
    "parse_topology",
    "gpu_config_field",
    "GPU_CONFIGS",
    "TPU_PEAKS",
    "GPU_PEAKS",
]
