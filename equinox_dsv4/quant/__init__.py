"""`equinox_dsv4.quant`: the forms a weight takes in memory: the release's FP8 and FP4 formats,
and a frozen weight with a low-rank adapter beside it.

Weights as the release stores them, kept quantised in memory (`QuantizedWeight`, dequantised
one product's operand at a time; the one dequantisation of FP8/FP4 in the project), which
weights of a model the release quantises (`quantize_model`, `abstract_quantized`, ...), and
the activations' quantisation round trips the release computes with (`act_quant`,
`kv_round_trip`, `index_round_trip`: `Config.numerics == "release"`). A `LoraWeight` is
a weight of either kind (or dense) kept as loaded, with LoRA's two factors beside it
(`equinox_dsv4.lora` adds and removes them).

May import: nothing of the package.
"""

from ._lora import (
    LoraWeight as LoraWeight,
    base_dense as base_dense,
    base_of as base_of,
    factor_specs as factor_specs,
    factors_only as factors_only,
    has_adapters as has_adapters,
    is_weight as is_weight,
    trimmed_spec as trimmed_spec,
)
from ._numerics import (
    ACT_BLOCK as ACT_BLOCK,
    EXACT as EXACT,
    RELEASE as RELEASE,
    act_quant as act_quant,
    bf16_round as bf16_round,
    fp4_round_trip as fp4_round_trip,
    fp8_round_trip as fp8_round_trip,
    hadamard as hadamard,
    index_round_trip as index_round_trip,
    kv_round_trip as kv_round_trip,
)
from ._release import (
    abstract_quantized as abstract_quantized,
    dequantize_model as dequantize_model,
    is_quantized as is_quantized,
    quantize_model as quantize_model,
    release_format as release_format,
    weight_bytes as weight_bytes,
)
from ._weight import (
    FP4 as FP4,
    FP4_BLOCK as FP4_BLOCK,
    FP8 as FP8,
    QuantizedWeight as QuantizedWeight,
    dense as dense,
    dequantize_host as dequantize_host,
    multipliers as multipliers,
    quantize as quantize,
    scale_grid as scale_grid,
    whole_blocks as whole_blocks,
)


__all__ = [
    "QuantizedWeight",
    "LoraWeight",
    "base_dense",
    "base_of",
    "is_weight",
    "has_adapters",
    "factors_only",
    "factor_specs",
    "trimmed_spec",
    "quantize",
    "dense",
    "dequantize_host",
    "scale_grid",
    "whole_blocks",
    "multipliers",
    "FP8",
    "FP4",
    "FP4_BLOCK",
    "quantize_model",
    "dequantize_model",
    "abstract_quantized",
    "is_quantized",
    "weight_bytes",
    "release_format",
    "EXACT",
    "ACT_BLOCK",
    "RELEASE",
    "act_quant",
    "kv_round_trip",
    "index_round_trip",
    "fp8_round_trip",
    "fp4_round_trip",
    "hadamard",
    "bf16_round",
]
