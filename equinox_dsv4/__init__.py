"""DeepSeek-V4 (Flash / Pro) in JAX + Equinox.

The names here are what a user calls first: the model and its config, generation, the chat
format, loading and saving, meshes, training. Everything else is in the sub-packages, each a
layer of the architecture (lower ones never import higher ones):

- `config`: the `Config`, its config.json dialects and the layer plan;
- `quant`: the release's FP8/FP4 weights and activation round trips;
- `text`: the chat protocol, reply parser and tokenizer;
- `execution`: the execution policy and the backend forms and kernels it chooses;
- `nn`: the model's math as Equinox modules, and its cache;
- `parallel`: meshes, sharding rules, several processes;
- `ckpt`: saving, loading, canonical weight names;
- `inference`: sampling, prefill and decode steps, generation, speculative decoding;
- `train`: losses, optimizer, train step and state;
- `lora`: low-rank adapters (LoRA / QLoRA), merged or saved in PEFT's layout;
- `compile` (a tool, not imported here): `python -m equinox_dsv4.compile`;
- `serve` (the `serve` extra, not imported here): the OpenAI-compatible server with continuous
  batching that `examples/serve.py` runs.
"""

from . import (
    ckpt as ckpt,
    config as config,
    execution as execution,
    inference as inference,
    lora as lora,
    nn as nn,
    parallel as parallel,
    quant as quant,
    text as text,
    train as train,
)
from .ckpt import CheckpointError as CheckpointError, load as load, save as save
from .config import Config as Config
from .inference import Sampling as Sampling, generate as generate
from .nn import DeepseekV4 as DeepseekV4, KVCache as KVCache
from .parallel import make_mesh as make_mesh, shard as shard
from .text import (
    chat_prompt as chat_prompt,
    decode_text as decode_text,
    encode_text as encode_text,
    parse_reply as parse_reply,
)
from .train import (
    Batch as Batch,
    TrainState as TrainState,
    init_train_state as init_train_state,
    make_optimizer as make_optimizer,
    make_train_step as make_train_step,
)


__version__ = "0.1.0"

__all__ = [
    # the model and its config
    "DeepseekV4",
    "Config",
    "KVCache",
    # generation
    "generate",
    "Sampling",
    # chat text
    "chat_prompt",
    "parse_reply",
    "encode_text",
    "decode_text",
    # checkpoints
    "load",
    "save",
    "CheckpointError",
    # meshes
    "make_mesh",
    "shard",
    # training
    "make_train_step",
    "make_optimizer",
    "init_train_state",
    "Batch",
    "TrainState",
    # the layers of the package
    "config",
    "quant",
    "text",
    "execution",
    "nn",
    "parallel",
    "ckpt",
    "inference",
    "train",
    "lora",
]
