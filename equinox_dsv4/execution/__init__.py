"""`equinox_dsv4.execution`: how the model's math runs on the backend it is compiled for.

The math (`equinox_dsv4.nn`) says what is computed; this package holds every form that exists
for a backend or a layout rather than for the math, chosen by the execution `Policy` that the
model carries (`with_policy`): the products' 16-bit forms and the grouped projection's, cache
writes, the greedy argmax, the routed experts' kernels (the expert loop with its written-out
gradient, `ragged_dot`, the decode forms, expert parallelism over a mesh), the layer-loop
drivers, chunked maps, and what the forward pass reads of the device mesh. Every form computes
the same numbers as the plain one; docs/design.md says why each exists and what guards it.

May import: config, quant.
"""

from ._attention import attend_blocks as attend_blocks
from ._dispatch import dispatch as dispatch
from ._exchange import held_whole as held_whole
from ._expert_loop import expert_mlps as expert_mlps, swiglu as swiglu
from ._experts import expert_parallel as expert_parallel, routed_experts as routed_experts
from ._loop import (
    REMAT_POLICIES as REMAT_POLICIES,
    InPlace as InPlace,
    run_layers as run_layers,
    with_remat as with_remat,
)
from ._mesh import (
    EMBED_AXES as EMBED_AXES,
    Q_LORA_AXES as Q_LORA_AXES,
    batch_axes as batch_axes,
    constrain_batch as constrain_batch,
    constrain_features as constrain_features,
    mesh_axis as mesh_axis,
    sequence_parts as sequence_parts,
)
from ._policy import (
    Policy as Policy,
    error_if as error_if,
    platform_of as platform_of,
    policy_field as policy_field,
    resolve as resolve,
    with_policy as with_policy,
)
from ._products import (
    argmax as argmax,
    blocked_argmax as blocked_argmax,
    grouped_linear as grouped_linear,
    linear as linear,
    wider_dtype as wider_dtype,
)
from ._schedule import (
    index_after as index_after,
    map_chunks as map_chunks,
    take_layer as take_layer,
    zeros_after as zeros_after,
)
from ._writes import set_rows as set_rows


__all__ = [
    "Policy",
    "with_policy",
    "policy_field",
    "error_if",
    "resolve",
    "platform_of",
    "linear",
    "grouped_linear",
    "wider_dtype",
    "argmax",
    "blocked_argmax",
    "set_rows",
    "map_chunks",
    "attend_blocks",
    "zeros_after",
    "index_after",
    "take_layer",
    "swiglu",
    "routed_experts",
    "dispatch",
    "expert_mlps",
    "expert_parallel",
    "run_layers",
    "InPlace",
    "REMAT_POLICIES",
    "with_remat",
    "mesh_axis",
    "batch_axes",
    "constrain_batch",
    "constrain_features",
    "sequence_parts",
    "EMBED_AXES",
    "Q_LORA_AXES",
]
