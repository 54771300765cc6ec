"""The DeepSeek-V4 model: embedding, `hc_mult` residual streams, the planned layer stack, the
stream collapse, the final norm and the head; plus the multi-token-prediction (MTP) blocks."""

import dataclasses
import functools
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
from jax.typing import DTypeLike
from jaxtyping import Array, Float, Int, PRNGKeyArray

from .._typecheck import typechecked
from ..config import Config, LayerPlan
from ..execution import (
    Policy,
    constrain_batch,
    error_if,
    held_whole,
    policy_field,
    with_policy,
)
from ._cache import Chunk, KVCache
from ._dspark import DSpark
from ._hyper import HyperHead
from ._layers import Embedding, Linear, RMSNorm
from ._moe import RouterStats
from ._mtp import MTPBlock, check_mtp_depth
from ._stack import LayerStack


# Per plan segment, per period position: the layers' stats, stacked along `repeats`.
Stats = tuple[tuple[RouterStats, ...], ...]


class DeepseekV4(eqx.Module):
    """DeepSeek-V4 (Flash / Pro and any config of the family) as one Equinox module.

    `model(input_ids)` runs the full causal forward pass: the embedding is copied into
    `hc_mult` streams, the decoder layers run in the order of `plan` (one `LayerStack` per
    segment: a scanned run of repeating layers, or a layer on its own), `hc_head` collapses
    the streams, then the final norm and the head give float32 logits.

    Build a full-size model abstractly with `eqx.filter_eval_shape(DeepseekV4, config, key=...)`
    and fill it from a checkpoint; random initialisation is for tiny models and tests.

    How the computation is laid out on a backend is the model's execution `policy` (see
    `execution.with_policy`): unless the model carries one, each entry point uses the policy
    of the platform its weights live on. Every policy computes the same numbers.
    """

    embed: Embedding
    layers: tuple[LayerStack, ...]
    hc_head: HyperHead
    norm: RMSNorm
    head: Linear
    mtp: tuple[MTPBlock, ...]
    dspark: DSpark | None
    config: Config = eqx.field(static=True)
    plan: LayerPlan = eqx.field(static=True)
    policy: Policy | None = policy_field()

    def __init__(self, config: Config, *, key: PRNGKeyArray, dtype: DTypeLike = jnp.float32):
        """**Arguments:**

        - `config`: the model config.
        - `key`: PRNG key. Layer `l`'s weights come from `fold_in(key, l)`, so they do not depend
          on how the plan groups layers.
        - `dtype`: dtype of the embedding, linear and expert weights (`float32` or `bfloat16`);
          norm weights, mHC parameters, sinks, slot biases and router biases stay float32.
        """
        if jnp.dtype(dtype) not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
            raise ValueError(f"dtype must be float32 or bfloat16, got {jnp.dtype(dtype)}")
        e_key, h_key, hc_key, layers_key, mtp_key = jr.split(key, 5)
        # A DSpark drafter's key: not a sixth split, so the other weights stay those of the
        # same config without one.
        d_key = jr.fold_in(key, 1 << 20)
        layer_keys = jax.vmap(lambda i: jr.fold_in(layers_key, i))(
            jnp.arange(config.num_hidden_layers)
        )
        plan = LayerPlan.from_config(config)
        layers = [LayerStack(config, seg, layer_keys, dtype=dtype) for seg in plan.segments]
        self.embed = Embedding(config.vocab_size, config.hidden_size, key=e_key, dtype=dtype)
        self.layers = tuple(layers)
        self.hc_head = HyperHead(config, key=hc_key)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.head = Linear(
            config.hidden_size, config.vocab_size, ("vocab", "embed"), key=h_key, dtype=dtype
        )
        self.mtp = tuple(
            MTPBlock(config, key=k, dtype=dtype) for k in jr.split(mtp_key, config.mtp_blocks)
        )
        self.dspark = DSpark(config, key=d_key, dtype=dtype) if config.dspark else None
        self.config = config
        self.plan = plan
        self.policy = None

    @typechecked
    def __call__(self, input_ids: Int[Array, "batch seq"]) -> Float[Array, "batch seq vocab"]:
        """**Arguments:** `input_ids`, int32 token ids `[batch, seq]` at positions `0 .. seq-1`.

        **Returns:** float32 logits `[batch, seq, vocab_size]`.

        Compiled once per input shape (see `decode`), so calling it eagerly is safe.
        """
        _check_ids(input_ids)
        return _jitted_call(self, input_ids, self.resolved_policy())

    @typechecked
    def streams(
        self, input_ids: Int[Array, "batch seq"]
    ) -> Float[Array, "batch seq streams d_model"]:
        """The residual streams after the last decoder layer (the MTP block's input), for a full
        causal forward from position 0. Compiled once per input shape, as `__call__`."""
        _check_ids(input_ids)
        return _jitted_streams(self, input_ids, self.resolved_policy())

    def forward(
        self, input_ids: Int[Array, "batch seq"], *, remat: str | None = None
    ) -> tuple[Float[Array, "batch seq streams d_model"], Stats]:
        """The full causal forward for training: the final streams (see `streams`) and each
        layer's `RouterStats`, in the structure of `layers` (per segment, per period position,
        stacked along its repeats). Traced where it is called (a train step), in the model's
        policy.

        **Arguments:**

        - `input_ids`: int32 `[batch, seq]` at positions `0 .. seq-1`.
        - `remat`: `None` (keep every activation for the backward pass) or a policy of
          `REMAT_POLICIES`, applied to each period of each segment.
        """
        _check_ids(input_ids)
        b, s = input_ids.shape
        cache = self.init_cache(b, s, self.embed.weight.dtype)
        x, _, stats, _ = self.step(input_ids, cache, jnp.full((b,), s, jnp.int32), remat=remat)
        return x, stats

    @typechecked
    def init_cache(
        self, batch: int, max_len: int, dtype: DTypeLike | None = None, *, rewind: int = 0
    ) -> KVCache:
        """An empty cache for `batch` sequences of up to `max_len` tokens each.

        **Arguments:**

        - `batch`, `max_len`: the fixed shape of every decode call with this cache.
        - `dtype`: dtype of the cached keys and entries (default: the parameters'); compressor
          buffers are float32.
        - `rewind`: how many tokens of one `decode` call `KVCache.rewind` may take back
          (speculative decoding); each ring holds `rewind - 1` slots more.
        """
        _check_cache_shape(batch, max_len)
        if rewind < 0:
            raise ValueError(f"rewind must be >= 0, got {rewind}")
        dtype = self.embed.weight.dtype if dtype is None else dtype

        def empty():
            layers = tuple(layer.init_cache(batch, max_len, dtype, rewind) for layer in self.layers)
            return KVCache(layers, jnp.zeros((batch,), jnp.int32), max_len, rewind)

        return _zeros_like_trace(empty)

    @typechecked
    def decode(
        self,
        input_ids: Int[Array, "batch chunk"],
        cache: KVCache,
        num_tokens: Int[Array, " batch"] | None = None,
        *,
        last_only: bool = False,
    ) -> tuple[Float[Array, "batch _ vocab"], KVCache]:
        """Append a chunk of tokens to each sequence in `cache` (a whole prompt, or one token)
        and return their logits.

        **Arguments:**

        - `input_ids`: `[batch, chunk]` token ids; sequence `b`'s tokens go at positions
          `cache.positions[b] ...`.
        - `cache`: from `init_cache` or a previous `decode`.
        - `num_tokens`: how many of each row's tokens are real (default: all). The rest is
          padding: its logits are meaningless and nothing of it is cached, so prompts of
          different lengths share one call.
        - `last_only`: return only each row's last real token's logits, `[batch, 1, vocab]`
          (a prefill needs no more; the head over a whole long prompt is large).

        **Returns:** `(logits, cache)`: float32 `[batch, chunk, vocab]` and the updated cache.
        Fixed shapes: decoding step after step never recompiles. Appending past `max_len` is a
        runtime error.

        The step is compiled once per shape and reused, so a plain Python loop of eager calls
        is safe; inside an outer `jit` the call is inlined. (Run op by op, the layer scan would
        be compiled afresh on every call, each program holding its own memory mappings.) The
        cache is not donated: `generate`'s steps donate it.
        """
        _check_ids(input_ids)
        return _jitted_decode(self, input_ids, cache, num_tokens, last_only, self.resolved_policy())

    def decode_inline(
        self,
        input_ids: Int[Array, "batch chunk"],
        cache: KVCache,
        num_tokens: Int[Array, " batch"] | None,
        last_only: bool,
        *,
        checked: bool = True,
    ) -> tuple[Float[Array, "batch _ vocab"], KVCache]:
        """`decode`, traced where it is called (inlined into the caller's `jit`, e.g. a step of
        `inference`), in the model's policy. `checked=False` leaves out the runtime check that
        the chunk fits the cache, for callers whose own bookkeeping keeps within it: the check
        is a host callback, and JAX never writes a program holding one to its persistent
        compilation cache."""
        b, t = input_ids.shape
        count = jnp.full((b,), t, jnp.int32) if num_tokens is None else num_tokens
        if checked:
            cache = _checked(cache, count, t)
        x, cache, _, _ = self.step(input_ids, cache, count, in_place=True)
        if last_only:
            last = jnp.maximum(count - 1, 0)[:, None, None, None]
            x = jnp.take_along_axis(x, last, axis=1)
        return self.logits(x), cache

    def step(
        self,
        input_ids: Int[Array, "batch chunk"],
        cache: KVCache,
        count: Int[Array, " batch"],
        *,
        remat: str | None = None,
        in_place: bool = False,
        taps: tuple[int, ...] = (),
    ) -> tuple[
        Float[Array, "batch chunk streams d_model"],
        KVCache,
        Stats,
        Float[Array, "batch chunk taps d_model"],
    ]:
        """The decoder layers on a chunk appended to `cache` (the first `count[b]` tokens of
        row `b` real, at positions `cache.positions[b] ...`): the final streams, the cache,
        each layer's `RouterStats`, and the streams averaged after each layer of `taps` (the
        DSpark drafter's context; `[batch, chunk, 0, d_model]` for none). `remat`: see
        `forward`; `in_place`: see `LayerStack.step`."""
        chunk = Chunk(cache.positions, count)
        e = self.embed(input_ids)
        x = jnp.broadcast_to(e[:, :, None, :], (*e.shape[:2], self.config.hc_mult, e.shape[-1]))
        x = constrain_batch(x, self.policy)
        new, stats, tapped = [], [], {}
        for layer, layer_cache in zip(self.layers, cache.layers, strict=True):
            x, layer_cache, s, t = layer.step(
                x, input_ids, chunk, layer_cache, remat=remat, in_place=in_place, taps=taps
            )
            x = constrain_batch(x, self.policy)
            new.append(layer_cache)
            stats.append(s)
            tapped.update(t)
        new_cache = KVCache(tuple(new), chunk.start + count, cache.max_len, cache.max_rewind)
        out = jnp.stack([tapped[i] for i in taps], axis=2) if taps else x[:, :, :0, :]
        return x, new_cache, tuple(stats), out

    def logits(
        self, streams: Float[Array, "batch seq streams d_model"]
    ) -> Float[Array, "batch seq vocab"]:
        """Stream collapse, final norm and head; float32 logits."""
        # Laid out as at a block boundary: a few positions (a decode step, or each row's last
        # position after a prefill) split along `d_model` as the head is, so that the head
        # stays where it is; taken from a prefill's rows, each device would gather all of it.
        streams = constrain_batch(streams, self.policy)
        return self.head(self.norm(self.hc_head(streams)), dtype=jnp.float32)

    @typechecked
    def mtp_logits(
        self, streams: Float[Array, "batch seq streams d_model"], next_ids: Int[Array, "batch seq"]
    ) -> Float[Array, "batch seq vocab"]:
        """Logits of the first MTP block: position `t` predicts token `t + 2` from the final
        streams at `t` and `next_ids[:, t]` (token `t + 1`). Compiled once per input shape."""
        check_mtp_depth(len(self.mtp), 0)
        _check_ids(next_ids)
        return _jitted_mtp_logits(self, streams, next_ids, self.resolved_policy())

    @typechecked
    def init_mtp_cache(
        self, batch: int, max_len: int, dtype: DTypeLike | None = None, *, rewind: int = 0
    ) -> tuple[KVCache, ...]:
        """Empty caches of the MTP blocks, one per depth (arguments as for `init_cache`)."""
        _check_cache_shape(batch, max_len)
        dtype = self.embed.weight.dtype if dtype is None else dtype
        return _zeros_like_trace(
            lambda: tuple(block.init_cache(batch, max_len, dtype, rewind) for block in self.mtp)
        )

    @typechecked
    def mtp_decode(
        self,
        streams: Float[Array, "batch chunk streams d_model"],
        next_ids: Int[Array, "batch chunk"],
        cache: KVCache,
        num_tokens: Int[Array, " batch"] | None = None,
        *,
        depth: int = 0,
    ) -> tuple[
        Float[Array, "batch chunk vocab"], Float[Array, "batch chunk streams d_model"], KVCache
    ]:
        """Append a chunk of positions to MTP depth `depth`'s cache (see `init_mtp_cache`) and
        return their logits, as `decode` does for the main model.

        **Arguments:**

        - `streams`: the input streams at positions `cache.positions[b] ...`: the main model's
          final streams for depth 0, the previous depth's output streams otherwise.
        - `next_ids`: token `t + depth + 1` for position `t`.
        - `cache`: this depth's cache; `num_tokens`: as for `decode`.
        - `depth`: which MTP block (0: the first).

        **Returns:** `(logits, streams', cache)`: float32 logits (position `t` predicts token
        `t + depth + 2`), this depth's output streams and the updated cache. Appending past
        `max_len` is a runtime error.
        """
        check_mtp_depth(len(self.mtp), depth)
        _check_ids(next_ids)
        policy = self.resolved_policy()
        return _jitted_mtp_decode(self, streams, next_ids, cache, num_tokens, depth, policy)

    def resolved_policy(self) -> Policy:
        """The policy the jitted entry points compile with: the model's own, or the policy of
        the platform its weights live on, with `expert_exchange` where the routed experts are
        placed whole over `expert` and `fsdp` (`parallel.EXCHANGE_RULES`), the placement it
        takes: the placement chooses the form, so the two cannot disagree."""
        if self.policy is not None:
            return self.policy
        policy = Policy.for_arrays(self.embed.weight)
        if self.layers and held_whole(self.layers[0].blocks[0].ffn.experts.w1):
            policy = dataclasses.replace(policy, expert_exchange=True)
        return policy


# The jitted entry points: the policy set across the tree inside the trace, one compiled program
# per shape and policy, inlined when the caller is already being traced.
@eqx.filter_jit
def _jitted_streams(model: DeepseekV4, ids: Array, policy: Policy) -> Array:
    return with_policy(model, policy).forward(ids)[0]


@eqx.filter_jit
def _jitted_call(model: DeepseekV4, ids: Array, policy: Policy) -> Array:
    model = with_policy(model, policy)
    return model.logits(model.forward(ids)[0])


@eqx.filter_jit
def _jitted_mtp_logits(model: DeepseekV4, streams: Array, next_ids: Array, policy: Policy):
    model = with_policy(model, policy)
    h, _, _ = model.mtp[0].with_stats(streams, next_ids, model.embed)
    return model.head(h, dtype=jnp.float32)


@eqx.filter_jit
def _jitted_decode(model, ids, cache, num_tokens, last_only, policy):
    return with_policy(model, policy).decode_inline(ids, cache, num_tokens, last_only)


@eqx.filter_jit
def _jitted_mtp_decode(model, streams, next_ids, cache, num_tokens, depth, policy):
    model = with_policy(model, policy)
    b, t = next_ids.shape
    count = jnp.full((b,), t, jnp.int32) if num_tokens is None else num_tokens
    cache = _checked(cache, count, t)
    h, x, cache = model.mtp[depth].decode(streams, next_ids, cache, count, model.embed)
    return model.head(h, dtype=jnp.float32), x, cache


def _checked(cache: KVCache, count: Array, t: int) -> KVCache:
    bad = (cache.positions + count > cache.max_len) | (count < 0) | (count > t)
    # Checked on a scalar, so that the check does not pull the (sharded) positions through a
    # single-device conditional. Only in decoding: a forward from position 0 cannot overflow.
    ok = error_if(
        jnp.zeros((), jnp.int32),
        jnp.any(bad),
        "decode: num_tokens out of range, or the cache is full (more than max_len tokens)",
    )
    return cache.at_positions(cache.positions + ok)


def _check_cache_shape(batch: int, max_len: int) -> None:
    if max_len <= 0 or batch <= 0:
        raise ValueError(f"batch and max_len must be positive, got {batch}, {max_len}")


def _check_ids(ids: Array) -> None:
    if ids.ndim != 2 or not jnp.issubdtype(ids.dtype, jnp.integer):
        raise ValueError(
            f"input_ids must be an integer array [batch, seq], got {ids.dtype}{list(ids.shape)}"
        )
    if ids.shape[1] == 0:
        raise ValueError("input_ids is empty (seq length 0)")


def _zeros_like_trace(empty: Any) -> Any:
    # An empty cache is zeros throughout: its shapes from a trace of `empty`, then every array
    # in one program (kept per set of shapes), rather than a small program per array and shape.
    leaves, treedef = jax.tree.flatten(jax.eval_shape(empty))
    return jax.tree.unflatten(treedef, _zeros(tuple((x.shape, x.dtype) for x in leaves)))


@functools.partial(jax.jit, static_argnums=0)
def _zeros(specs: tuple[tuple[tuple[int, ...], Any], ...]) -> tuple[Array, ...]:
    return tuple(jnp.zeros(shape, dtype) for shape, dtype in specs)
