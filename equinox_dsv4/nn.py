"""`equinox_dsv4.nn`: DeepSeek-V4's components as Equinox modules, for building or probing
models piece by piece (`equinox_dsv4.DeepseekV4` assembles them)."""

from ._attention import Attention as Attention
from ._block import Block as Block
from ._compressor import CSACompressor as CSACompressor, HCACompressor as HCACompressor
from ._experts import Experts as Experts
from ._hyper import HyperConnection as HyperConnection, HyperHead as HyperHead
from ._indexer import LightningIndexer as LightningIndexer
from ._layers import Embedding as Embedding, Linear as Linear, RMSNorm as RMSNorm
from ._moe import MoE as MoE, SharedExpert as SharedExpert
from ._mtp import MTPBlock as MTPBlock
from ._rope import RoPE as RoPE


__all__ = [
    "Attention",
    "Block",
    "CSACompressor",
    "Embedding",
    "Experts",
    "HCACompressor",
    "HyperConnection",
    "HyperHead",
    "LightningIndexer",
    "Linear",
    "MTPBlock",
    "MoE",
    "RMSNorm",
    "RoPE",
    "SharedExpert",
]
