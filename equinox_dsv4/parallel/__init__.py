"""`equinox_dsv4.parallel`: models and caches on device meshes, and several processes.

Meshes of the four named axes (`make_mesh`), the logical-axis rules that place every weight
(`ShardingRules`, `shard`, `named_shardings`) and every cache (`shard_cache`), and joining the
processes of a TPU slice or GPU cluster (`initialize`, `barrier`, `is_primary`).

May import: config, quant, execution, nn.
"""

from ._distributed import (
    add_distributed_arguments as add_distributed_arguments,
    barrier as barrier,
    initialize as initialize,
    initialize_from_args as initialize_from_args,
    is_primary as is_primary,
    replace_directory as replace_directory,
    shared_token as shared_token,
)
from ._mesh import (
    AXES as AXES,
    make_mesh as make_mesh,
    parse_mesh as parse_mesh,
    parse_rules as parse_rules,
)
from ._sharding import (
    DEFAULT_RULES as DEFAULT_RULES,
    EXCHANGE_RULES as EXCHANGE_RULES,
    FSDP_EXPERT_RULES as FSDP_EXPERT_RULES,
    ShardingRules as ShardingRules,
    cache_shardings as cache_shardings,
    committed as committed,
    logical_axes as logical_axes,
    named_shardings as named_shardings,
    partition_specs as partition_specs,
    shard as shard,
    shard_cache as shard_cache,
)


__all__ = [
    "AXES",
    "make_mesh",
    "parse_mesh",
    "parse_rules",
    "ShardingRules",
    "DEFAULT_RULES",
    "EXCHANGE_RULES",
    "FSDP_EXPERT_RULES",
    "shard",
    "shard_cache",
    "cache_shardings",
    "named_shardings",
    "partition_specs",
    "logical_axes",
    "committed",
    "initialize",
    "initialize_from_args",
    "add_distributed_arguments",
    "is_primary",
    "barrier",
    "replace_directory",
    "shared_token",
]
