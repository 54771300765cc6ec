"""`equinox_dsv4.nn`: DeepSeek-V4's math as Equinox modules.

The components (attention with its compressors and Lightning Indexer, mHC, the MoE and its
routed experts, the decoder block, the MTP block, the DSpark drafter), the layer stack, the
whole model `DeepseekV4`, and the decoding state they read and write (`KVCache`). Each reads as the
DeepSeek-V4 report's equations; how a computation runs on a backend is `execution`'s.

May import: config, quant, execution.
"""

from ._attention import Attention as Attention, attend as attend, selection_mask as selection_mask
from ._block import Block as Block
from ._cache import (
    Chunk as Chunk,
    CompressorState as CompressorState,
    KVCache as KVCache,
    LayerCache as LayerCache,
    ring_slots as ring_slots,
    window_slots as window_slots,
)
from ._compressor import CSACompressor as CSACompressor, HCACompressor as HCACompressor
from ._dspark import DraftBlock as DraftBlock, DSpark as DSpark
from ._experts import Experts as Experts
from ._hyper import HyperConnection as HyperConnection, HyperHead as HyperHead, sinkhorn as sinkhorn
from ._indexer import LightningIndexer as LightningIndexer
from ._layers import (
    Embedding as Embedding,
    Linear as Linear,
    RMSNorm as RMSNorm,
    rms_normalize as rms_normalize,
)
from ._model import DeepseekV4 as DeepseekV4, Stats as Stats
from ._moe import Gate as Gate, MoE as MoE, RouterStats as RouterStats, SharedExpert as SharedExpert
from ._mtp import MTPBlock as MTPBlock
from ._rope import RoPE as RoPE, inverse_frequencies as inverse_frequencies
from ._stack import LayerStack as LayerStack


__all__ = [
    "DeepseekV4",
    "KVCache",
    "Chunk",
    "LayerCache",
    "CompressorState",
    "LayerStack",
    "Block",
    "Attention",
    "CSACompressor",
    "HCACompressor",
    "LightningIndexer",
    "HyperConnection",
    "HyperHead",
    "MoE",
    "Gate",
    "SharedExpert",
    "Experts",
    "RouterStats",
    "Stats",
    "MTPBlock",
    "DSpark",
    "DraftBlock",
    "Embedding",
    "Linear",
    "RMSNorm",
    "RoPE",
    "attend",
    "selection_mask",
    "sinkhorn",
    "rms_normalize",
    "inverse_frequencies",
    "ring_slots",
    "window_slots",
]
