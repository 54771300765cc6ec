"""DeepSeek-V4 (Flash / Pro) in JAX + Equinox."""

from . import train as train  # the namespace `equinox_dsv4.train`
from ._attention import Attention as Attention, attend as attend
from ._block import Block as Block
from ._cache import (
    CompressorState as CompressorState,
    KVCache as KVCache,
    LayerCache as LayerCache,
    cache_bytes as cache_bytes,
    cache_bytes_per_token as cache_bytes_per_token,
)
from ._chat import (
    chat_prompt as chat_prompt,
    decode_text as decode_text,
    encode_text as encode_text,
    load_tokenizer as load_tokenizer,
)
from ._checkpoint import CheckpointError as CheckpointError, load as load, save as save
from ._compressor import (
    AbstractCompressor as AbstractCompressor,
    CSACompressor as CSACompressor,
    HCACompressor as HCACompressor,
)
from ._config import (
    CSA as CSA,
    HASH_MOE as HASH_MOE,
    HCA as HCA,
    MOE as MOE,
    SLIDING as SLIDING,
    Config as Config,
    YarnScaling as YarnScaling,
)
from ._experts import Experts as Experts
from ._generate import (
    Sampling as Sampling,
    decode_step as decode_step,
    generate as generate,
    prefill as prefill,
    sample as sample,
)
from ._hyper import HyperConnection as HyperConnection, HyperHead as HyperHead
from ._indexer import LightningIndexer as LightningIndexer
from ._layers import Embedding as Embedding, Linear as Linear, RMSNorm as RMSNorm
from ._model import (
    REMAT_POLICIES as REMAT_POLICIES,
    DeepseekV4 as DeepseekV4,
    LayerStack as LayerStack,
    MTPBlock as MTPBlock,
)
from ._moe import (
    Gate as Gate,
    MoE as MoE,
    RouterStats as RouterStats,
    SharedExpert as SharedExpert,
)
from ._plan import LayerPlan as LayerPlan, Segment as Segment
from ._rope import RoPE as RoPE
from ._sharding import (
    ShardingRules as ShardingRules,
    logical_axes as logical_axes,
    make_mesh as make_mesh,
    named_shardings as named_shardings,
    partition_specs as partition_specs,
    shard as shard,
    shard_cache as shard_cache,
)
from ._train import (
    Batch as Batch,
    TrainState as TrainState,
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
