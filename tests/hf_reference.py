"""The PyTorch reference (transformers' DeepSeek-V4) for parity tests: tiny configs, full
randomisation of every parameter and buffer, and copying weights into our modules through the
converter's name table."""

import dataclasses
import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import torch
import transformers
from helpers import on_device
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf

import equinox_dsv4 as ed
from convert import fill, hf_to_canonical
from equinox_dsv4.ckpt import block_path


S, C, H = ed.config.SLIDING, ed.config.CSA, ed.config.HCA
# `tiny_config` overrides for every kind of layer and both layer drivers in the fewest blocks: a
# sliding hash-routed layer on its own, then a scanned stack of two (CSA, HCA) periods with
# learned routing (`helpers.short_tiny` is the same shape at `Config.tiny()`'s widths).
FIVE_LAYERS = dict(layer_types=(S, C, H, C, H), num_hash_layers=1, scan_min_repeats=2)


def tiny_config(**overrides) -> ed.Config:
    """A small V4-Flash-shaped config: two sliding layers, a hash-routed CSA layer, then
    (HCA, CSA) pairs with learned routing; HCA ratio 8, window 8, YaRN on the compress rope.

    Three Sinkhorn iterations, as `Config.tiny()` (the release has 20; the loop is unrolled,
    and its rounds are much of every compiled program); three keep the column-first order and
    a repeated (row, column) round. The mHC parity tests (tests/test_hyper.py) use 20."""
    layer_types = overrides.pop("layer_types", (S, S, C, H, C, H, C, H, C))
    n = overrides.pop("num_hidden_layers", len(layer_types))
    layer_types = layer_types[:n]
    hashed = overrides.pop("num_hash_layers", 3)
    base = dict(
        vocab_size=97,
        hidden_size=32,
        num_hidden_layers=n,
        num_attention_heads=4,
        head_dim=32,
        qk_rope_head_dim=8,
        q_lora_rank=16,
        o_groups=2,
        o_lora_rank=8,
        sliding_window=8,
        layer_types=layer_types,
        mlp_layer_types=(ed.config.HASH_MOE,) * min(n, hashed)
        + (ed.config.MOE,) * max(0, n - hashed),
        compress_rate_csa=4,
        compress_rate_hca=8,
        index_n_heads=8,
        index_head_dim=16,
        index_topk=3,
        hc_mult=4,
        n_routed_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        routed_scaling_factor=1.5,
        swiglu_limit=10.0,
        rope_scaling=ed.config.YarnScaling(factor=4.0, original_max_position_embeddings=32),
        max_position_embeddings=128,
        num_nextn_predict_layers=1,
        hc_sinkhorn_iters=3,
    )
    base.update(overrides)
    return ed.Config(**base)


def hf_config(config: ed.Config) -> transformers.DeepseekV4Config:
    return transformers.DeepseekV4Config(**config.to_hf())


def randomize(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Overwrite every parameter and persistent buffer with random values, including those
    transformers initialises to constants (sinks, slot biases, hc base/scale, router bias,
    tid2eid), so that no term of the computation can hide behind a zero or a one."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in module.state_dict().items():
            leaf = name.rsplit(".", 1)[-1]
            if leaf == "tid2eid":
                n_experts = _n_experts(module)
                rows = [
                    torch.randperm(n_experts, generator=g)[: t.shape[1]] for _ in range(t.shape[0])
                ]
                t.copy_(torch.stack(rows))
            elif name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                t.copy_(1 + 0.2 * torch.randn(t.shape, generator=g))
            elif leaf == "scale" or leaf == "hc_scale":
                t.copy_(0.5 + torch.rand(t.shape, generator=g))
            elif t.ndim >= 2:
                t.copy_(torch.randn(t.shape, generator=g) / t.shape[-1] ** 0.5)
            else:
                t.copy_(0.5 * torch.randn(t.shape, generator=g))
    return module


def _n_experts(module: torch.nn.Module) -> int:
    for sub in module.modules():
        if isinstance(sub, hf.DeepseekV4HashRouter):
            return sub.num_experts
    raise ValueError("no hash router in module")


def abstract(cls, *args, **kwargs):
    """The module's shapes only (`eqx.filter_eval_shape`): no random init, which compiles one
    kernel per weight shape and dominates test time on CPU. Traced once per process for each
    (class, arguments): the suite asks for the same few skeletons many times, and a skeleton
    (shapes and static fields) cannot be changed in place."""
    signature = (cls, args, tuple(sorted(kwargs.items())))
    try:
        hash(signature)
    except TypeError:  # an unhashable argument: traced every time
        return eqx.filter_eval_shape(cls, *args, key=jax.random.key(0), **kwargs)
    return _abstract(*signature)


@functools.lru_cache(maxsize=512)
def _abstract(cls, args: tuple, kwargs: tuple):
    return eqx.filter_eval_shape(cls, *args, key=jax.random.key(0), **dict(kwargs))


def decode_temporaries(model: ed.DeepseekV4, max_len: int = 64) -> int:
    """Bytes of temporaries XLA's compiled one-token decode step of (abstract) `model` holds,
    batch 1, cache of `max_len`."""
    cache = eqx.filter_eval_shape(lambda m: m.init_cache(1, max_len), model)
    ids = jax.ShapeDtypeStruct((1, 1), jnp.int32)
    step = jax.jit(lambda m, i, c: m.decode(i, c)).lower(model, ids, cache).compile()
    return step.memory_analysis().temp_size_in_bytes


def random_fill(module, seed: int, n_experts: int = 8):
    """Concrete random weights for an (abstract) module: float leaves ~ N(0, 1/fan_in) (vectors
    N(1, 0.2^2) for norm weights, N(0, 0.5^2) otherwise), integer leaves (tid2eid) in
    `[0, n_experts)`."""
    rng = np.random.default_rng(seed)
    values = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(module)[0]:
        key = jax.tree_util.keystr(path)
        if jnp.issubdtype(leaf.dtype, jnp.integer):
            value = rng.integers(0, n_experts, leaf.shape)
        elif key.endswith("norm.weight"):
            value = 1 + 0.2 * rng.standard_normal(leaf.shape)
        elif len(leaf.shape) >= 2:
            value = rng.standard_normal(leaf.shape) / np.sqrt(leaf.shape[-1])
        else:
            value = 0.5 * rng.standard_normal(leaf.shape)
        values[key] = value
    return fill_paths(module, values)


def fill_paths(module, values: dict[str, np.ndarray]):
    """Replace every array leaf of `module` by `values[keystr(path)]`; all used, shapes equal."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(module)
    values = dict(values)
    new = []
    for path, leaf in leaves:
        key = jax.tree_util.keystr(path)
        assert key in values, f"no reference value for {key}"
        value = values.pop(key)
        assert value.shape == leaf.shape, (key, value.shape, leaf.shape)
        new.append(on_device(value, leaf.dtype))
    assert not values, f"unused reference values: {sorted(values)}"
    return jax.tree_util.tree_unflatten(treedef, new)


def load_component(
    ours, reference: torch.nn.Module, hf_prefix: str, block_prefix: str, skip: str | None = None
):
    """Copy `reference`'s weights into our matching component.

    `hf_prefix` is the reference component's name inside a transformers model (e.g.
    `model.layers.0.self_attn.`); `block_prefix` our component's path inside a `Block` (e.g.
    `.attn`), so the converter's name table does the mapping. Reference tensors whose name
    starts with `skip` belong to a submodule we keep elsewhere and are left out."""
    values = {}
    for key, tensor in reference.state_dict().items():
        if skip is not None and key.startswith(skip):
            continue
        targets = hf_to_canonical(hf_prefix + key)
        assert targets is not None, f"name table has no row for {hf_prefix + key}"
        for name, transform in targets:
            path, index = block_path(name.split(".", 2)[2])
            assert index == () and path.startswith(block_prefix), (name, path)
            values[path[len(block_prefix) :]] = transform(tensor.detach().numpy())
    return fill_paths(ours, values)


def load_model(skeleton: ed.DeepseekV4, reference: torch.nn.Module) -> ed.DeepseekV4:
    """Our model with the weights of a transformers `DeepseekV4ForCausalLM` (no MTP there: the
    skeleton must have `num_nextn_predict_layers=0`)."""

    def tensors():
        for key, tensor in reference.state_dict().items():
            targets = hf_to_canonical(key)
            assert targets is not None, f"name table has no row for {key}"
            for name, transform in targets:
                yield name, transform(tensor.detach().numpy())

    return fill(skeleton, tensors())


def reference_model(config: ed.Config, seed: int) -> transformers.DeepseekV4ForCausalLM:
    torch.manual_seed(seed)
    model = transformers.DeepseekV4ForCausalLM(hf_config(config)).eval()
    return randomize(model, seed)


def our_model(config: ed.Config, reference: torch.nn.Module) -> ed.DeepseekV4:
    config = dataclasses.replace(config, num_nextn_predict_layers=0)
    skeleton = eqx.filter_eval_shape(ed.DeepseekV4, config, key=jax.random.key(0))
    return load_model(skeleton, reference)


def reference_logits(model: torch.nn.Module, ids: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        ids_t = torch.from_numpy(np.array(ids, dtype=np.int64))
        out = model(input_ids=ids_t, attention_mask=torch.ones_like(ids_t))
    return out.logits.numpy()


def window_mask(seq: int, window: int, batch: int) -> torch.Tensor:
    """Additive sliding-window causal mask `[batch, 1, seq, seq]` for the reference attention."""
    q = torch.arange(seq)[:, None]
    k = torch.arange(seq)[None, :]
    allowed = (k <= q) & (q - k < window)
    mask = torch.where(allowed, 0.0, torch.finfo(torch.float32).min)
    return mask.expand(batch, 1, seq, seq).contiguous()


def to_torch(x) -> torch.Tensor:
    return torch.from_numpy(np.array(x))


def to_numpy(t: torch.Tensor) -> np.ndarray:
    return t.detach().numpy()
