"""`equinox_dsv4.lora`: low-rank adapters (LoRA, and QLoRA over the release's FP8/FP4 weights).

`add` puts an adapter beside each targeted weight (`quant.LoraWeight`: the weight kept as
loaded, quantised or not, and the two factors); a model with adapters trains only them by
default (`train.trainable`); `merge` folds them in, `base` drops them; `save` and `load` write
and read the adapters alone in PEFT's layout under transformers' module names.

May import: config, quant, execution, nn, parallel, ckpt.
"""

from ..quant import LoraWeight as LoraWeight, has_adapters as has_adapters
from ._adapters import (
    DEFAULT_TARGETS as DEFAULT_TARGETS,
    TARGETS as TARGETS,
    add as add,
    base as base,
    merge as merge,
    target_of as target_of,
)
from ._peft import load as load, save as save


__all__ = [
    "add",
    "merge",
    "base",
    "save",
    "load",
    "has_adapters",
    "target_of",
    "TARGETS",
    "DEFAULT_TARGETS",
    "LoraWeight",
]
