"""`equinox_dsv4.config`: what a model is, before any array exists.

The frozen `Config` (its fields, invariants and presets), the two config.json dialects it is
read from and written to, and the `LayerPlan` derived from it (which decoder layers are stacked
and scanned together).

May import: nothing of the package.
"""

from ._config import (
    CSA as CSA,
    DSPARK_FIELDS as DSPARK_FIELDS,
    HASH_MOE as HASH_MOE,
    HCA as HCA,
    LAYER_TYPES as LAYER_TYPES,
    MLP_LAYER_TYPES as MLP_LAYER_TYPES,
    MOE as MOE,
    SLIDING as SLIDING,
    Config as Config,
    YarnScaling as YarnScaling,
)
from ._hf import IGNORED_HF_KEYS as IGNORED_HF_KEYS
from ._plan import LayerPlan as LayerPlan, Segment as Segment


__all__ = [
    "Config",
    "YarnScaling",
    "LayerPlan",
    "Segment",
    "SLIDING",
    "CSA",
    "HCA",
    "LAYER_TYPES",
    "HASH_MOE",
    "MOE",
    "MLP_LAYER_TYPES",
    "IGNORED_HF_KEYS",
    "DSPARK_FIELDS",
]
