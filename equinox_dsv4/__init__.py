"""DeepSeek-V4 (Flash / Pro) in JAX + Equinox."""

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
from ._model import DeepseekV4 as DeepseekV4, LayerStack as LayerStack, MTPBlock as MTPBlock
from ._moe import Experts as Experts, Gate as Gate, MoE as MoE, SharedExpert as SharedExpert
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


__version__ = "0.1.0"
