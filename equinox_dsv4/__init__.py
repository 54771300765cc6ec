"""DeepSeek-V4 (Flash / Pro) in JAX + Equinox.

The names here are what a user calls: the model and its config, the cache, generation and
sampling, the chat format, loading and saving, sharding, several processes, training. The
components are in `equinox_dsv4.nn`; everything else stays importable from its private module.
"""

from . import nn as nn
from ._cache import (
    KVCache as KVCache,
    cache_bytes as cache_bytes,
    cache_bytes_per_token as cache_bytes_per_token,
)
from ._chat import chat_prompt as chat_prompt
from ._checkpoint import CheckpointError as CheckpointError, load as load, save as save
from ._config import (
    CSA as CSA,
    HASH_MOE as HASH_MOE,
    HCA as HCA,
    MOE as MOE,
    SLIDING as SLIDING,
    Config as Config,
    YarnScaling as YarnScaling,
)
from ._distributed import (
    add_distributed_arguments as add_distributed_arguments,
    barrier as barrier,
    initialize as initialize,
    initialize_from_args as initialize_from_args,
    is_primary as is_primary,
)
from ._flops import (
    active_parameters as active_parameters,
    forward_flops as forward_flops,
    train_flops as train_flops,
)
from ._generate import (
    decode_step as decode_step,
    generate as generate,
    prefill as prefill,
)
from ._model import REMAT_POLICIES as REMAT_POLICIES, DeepseekV4 as DeepseekV4
from ._moe import RouterStats as RouterStats
from ._plan import LayerPlan as LayerPlan
from ._policy import Policy as Policy
from ._quant import QuantizedWeight as QuantizedWeight
from ._release import (
    abstract_quantized as abstract_quantized,
    dequantize_model as dequantize_model,
    is_quantized as is_quantized,
    quantize_model as quantize_model,
    weight_bytes as weight_bytes,
)
from ._reply import parse_reply as parse_reply
from ._sampling import Sampling as Sampling, accept_drafts as accept_drafts, sample as sample
from ._sharding import (
    ShardingRules as ShardingRules,
    logical_axes as logical_axes,
    make_mesh as make_mesh,
    named_shardings as named_shardings,
    partition_specs as partition_specs,
    shard as shard,
    shard_cache as shard_cache,
)
from ._tokenizer import (
    decode_text as decode_text,
    encode_text as encode_text,
    load_tokenizer as load_tokenizer,
)
from ._train import (
    Batch as Batch,
    TrainState as TrainState,
    abstract_train_state as abstract_train_state,
    balance_loss as balance_loss,
    cross_entropy as cross_entropy,
    init_train_state as init_train_state,
    loss_and_stats as loss_and_stats,
    make_optimizer as make_optimizer,
    make_train_step as make_train_step,
    restore_train_state as restore_train_state,
    save_train_state as save_train_state,
    trainable as trainable,
    update_router_bias as update_router_bias,
)


__version__ = "0.1.0"

__all__ = [
    # the model and its config
    "DeepseekV4",
    "Config",
    "YarnScaling",
    "LayerPlan",
    "Policy",
    "SLIDING",
    "CSA",
    "HCA",
    "HASH_MOE",
    "MOE",
    "nn",
    # the cache
    "KVCache",
    "cache_bytes",
    "cache_bytes_per_token",
    # generation and sampling
    "Sampling",
    "generate",
    "prefill",
    "decode_step",
    "sample",
    "accept_drafts",
    # the chat protocol and the tokenizer
    "chat_prompt",
    "parse_reply",
    "encode_text",
    "decode_text",
    "load_tokenizer",
    # loading and saving
    "load",
    "save",
    "CheckpointError",
    # the release's quantised weights
    "QuantizedWeight",
    "quantize_model",
    "dequantize_model",
    "abstract_quantized",
    "is_quantized",
    "weight_bytes",
    # sharding
    "ShardingRules",
    "make_mesh",
    "shard",
    "shard_cache",
    "named_shardings",
    "partition_specs",
    "logical_axes",
    # several processes
    "initialize",
    "initialize_from_args",
    "add_distributed_arguments",
    "is_primary",
    "barrier",
    # training
    "Batch",
    "TrainState",
    "REMAT_POLICIES",
    "RouterStats",
    "make_optimizer",
    "make_train_step",
    "init_train_state",
    "abstract_train_state",
    "forward_flops",
    "train_flops",
    "active_parameters",
    "save_train_state",
    "restore_train_state",
    "trainable",
    "loss_and_stats",
    "cross_entropy",
    "balance_loss",
    "update_router_bias",
]
