"""Sampling and generation with the compressed KV cache.

One jitted prefill per prompt-batch shape, then one jitted decode step (fixed shapes, the cache
donated) per new token. Prompts of different lengths share a batch: each sequence keeps its own
position in the cache (no left padding, which would shift the position-based compression
windows), and a finished sequence stops advancing.
"""

import contextlib
import dataclasses
from collections.abc import Callable, Sequence

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jaxtyping import Array, Float, Int, PRNGKeyArray

from ._cache import KVCache
from ._forms import blocked_argmax
from ._model import DeepseekV4, _check_ids
from ._parallel import committed, mesh_axis
from ._policy import Policy, resolve
from ._sharding import shard_cache


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How to pick the next token: greedy when `temperature == 0`, otherwise from the softmax of
    `logits / temperature` restricted to the `top_k` most likely tokens (0: all) and to the
    smallest set whose probability reaches `top_p` (nucleus sampling)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self):
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


def sample(
    logits: Float[Array, "batch vocab"],
    key: PRNGKeyArray,
    sampling: Sampling,
    *,
    policy: Policy | None = None,
) -> Int[Array, " batch"]:
    """One token per row (see `Sampling`); greedy takes the first largest logit (NaN counting
    as largest), in the form `policy` says (default: the one for `logits`' platform)."""
    if sampling.temperature == 0:
        # The blocked form needs the whole vocabulary on each device, and int32 keys (no
        # float64 logits).
        policy = resolve(policy, logits)
        if policy.blocked_argmax and mesh_axis("tensor") == 1 and logits.dtype.itemsize <= 4:
            return blocked_argmax(logits)
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits.astype(jnp.float32) / sampling.temperature
    if 0 < sampling.top_k < logits.shape[-1]:
        kth = jax.lax.top_k(logits, sampling.top_k)[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if sampling.top_p < 1:
        order = jnp.argsort(-logits, axis=-1)
        sorted_probs = jax.nn.softmax(jnp.take_along_axis(logits, order, axis=-1), axis=-1)
        # Keep a token if the mass of the tokens before it is below top_p (the first always).
        before = jnp.cumsum(sorted_probs, axis=-1) - sorted_probs
        keep_sorted = before < sampling.top_p
        keep = (
            jnp.zeros_like(keep_sorted)
            .at[jnp.arange(logits.shape[0])[:, None], order]
            .set(keep_sorted)
        )
        logits = jnp.where(keep, logits, -jnp.inf)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


@eqx.filter_jit(donate="all-except-first")
def _prefill_chunk(
    model: DeepseekV4,
    ids: Int[Array, "batch chunk"],
    count: Int[Array, " batch"],
    cache: KVCache,
    policy: Policy,
    checked: bool,
) -> tuple[Float[Array, "batch vocab"], KVCache]:
    logits, cache = model._decode(ids, cache, count, True, policy, checked)
    return logits[:, 0], cache


_sample = eqx.filter_jit(sample)


def prefill(
    model: DeepseekV4,
    ids: Int[Array, "batch seq"],
    lengths: Int[Array, " batch"],
    cache: KVCache,
    key: PRNGKeyArray,
    sampling: Sampling,
    chunk: int = 512,
    *,
    policy: Policy | None = None,
) -> tuple[Int[Array, " batch"], KVCache]:
    """Run the prompts (row `b`: its first `lengths[b]` tokens) in chunks of `chunk` tokens
    (one compiled step whatever the prompt length; activations bounded by the chunk) and
    sample each one's next token. Appending past the cache's `max_len` is an error.
    **Returns:** `(tokens, cache)`."""
    policy = resolve(policy, model.embed.weight)
    return _prefill(model, ids, lengths, cache, key, sampling, chunk, policy, checked=True)


def _prefill(model, ids, lengths, cache, key, sampling, chunk, policy, checked):
    lengths = jnp.asarray(lengths, jnp.int32)
    last = None
    for start in range(0, ids.shape[1], chunk):
        part = ids[:, start : start + chunk]
        if part.shape[1] < chunk and start > 0:
            part = jnp.pad(part, ((0, 0), (0, chunk - part.shape[1])))
        count = jnp.clip(lengths - start, 0, part.shape[1])
        ends_here = ((count > 0) & (start + count == lengths))[:, None]
        # Donates count and cache.
        logits, cache = _prefill_chunk(model, part, count, cache, policy, checked)
        last = logits if last is None else jnp.where(ends_here, logits, last)
    assert last is not None
    return _sample(last, key, sampling, policy=policy), cache


@eqx.filter_jit(donate="all-except-first")
def decode_step(
    model: DeepseekV4,
    tokens: Int[Array, " batch"],
    active: Int[Array, " batch"],
    cache: KVCache,
    key: PRNGKeyArray,
    sampling: Sampling,
    policy: Policy | None = None,
) -> tuple[Int[Array, " batch"], KVCache]:
    """Append one token per active row (`active[b]` 1 or 0) and sample the next, laid out by
    `policy` (default: the platform's). Appending past the cache's `max_len` is an error."""
    return _step(model, tokens, active, cache, key, sampling, resolve(policy, model.embed.weight))


def _step(model, tokens, active, cache, key, sampling, policy, checked=True):
    _check_ids(tokens[:, None])
    logits, cache = model._decode(tokens[:, None], cache, active, False, policy, checked)
    return sample(logits[:, 0], key, sampling, policy=policy), cache


# `generate`'s step: its loop stops each row before the cache is full.
_unchecked_step = eqx.filter_jit(
    lambda *args: _step(*args, checked=False), donate="all-except-first"
)


def generate(
    model: DeepseekV4,
    prompts: Sequence[Sequence[int | np.integer]],
    *,
    max_new_tokens: int,
    sampling: Sampling = Sampling(),
    key: PRNGKeyArray | None = None,
    stop_tokens: Sequence[int] | None = None,
    max_len: int | None = None,
    callback: Callable[[np.ndarray, np.ndarray], None] | None = None,
    prefill_chunk: int = 512,
    policy: Policy | None = None,
) -> list[list[int]]:
    """Generate continuations of a batch of prompts.

    **Arguments:**

    - `model`: the model.
    - `prompts`: token ids per prompt (any lengths, none empty).
    - `max_new_tokens`: how many tokens to generate at most per prompt.
    - `sampling`: greedy by default (see `Sampling`); `key` is required otherwise.
    - `stop_tokens`: ids that end a sequence (default: the config's `eos_token_id`); the stop
      token itself is not returned.
    - `max_len`: cache length (default: the longest prompt plus `max_new_tokens`, rounded up to
      a multiple of 64 so that repeated calls reuse compiled steps); a sequence also stops when
      prompt plus generated tokens reach it.
    - `callback`: called after every step with the new tokens `[batch]` and which rows are
      still running (for streaming).
    - `prefill_chunk`: prompts are run in chunks of this many tokens (see `prefill`).
    - `policy`: the execution `Policy` (default: the one for the model's platform).

    **Returns:** the generated ids per prompt, without the prompt.
    """
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if sampling.temperature > 0 and key is None:
        raise ValueError("sampling with temperature > 0 needs a PRNG key")
    key = jax.random.key(0) if key is None else key
    longest = max(len(p) for p in prompts)
    if max_len is None:
        max_len = _bucket(longest + max_new_tokens, 64)
    if longest > max_len:
        raise ValueError(f"prompt of {longest} tokens does not fit max_len={max_len}")
    if stop_tokens is None:
        eos = model.config.eos_token_id
        stop_tokens = () if eos is None else ((eos,) if isinstance(eos, int) else eos)
    stops = np.asarray(list(stop_tokens), np.int64)

    batch = len(prompts)
    # Prompts padded to a bucketed length: fewer distinct shapes, fewer compilations.
    ids = np.zeros((batch, min(_bucket(longest, 32), max_len)), np.int32)
    for b, p in enumerate(prompts):
        ids[b, : len(p)] = p
    lengths = np.array([len(p) for p in prompts], np.int32)
    mesh = _mesh_of(model)
    if mesh is None:
        # Committed, as a loaded model is: a built and a loaded model share compiled steps.
        model = committed(model)
    cache = model.init_cache(batch, max_len)
    key, prefill_key = jax.random.split(key)
    policy = resolve(policy, model.embed.weight)
    if mesh is not None:
        cache = shard_cache(cache, mesh)
    with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
        # Unchecked (no host callback, so its programs are cached across processes): the
        # prompts fit `max_len` (checked above) in a fresh cache, and `_decode_loop` stops each
        # row before the cache is full.
        tokens, cache = _prefill(
            model,
            jnp.asarray(ids),
            jnp.asarray(lengths),
            cache,
            prefill_key,
            sampling,
            prefill_chunk,
            policy,
            checked=False,
        )
        return _decode_loop(
            model,
            tokens,
            lengths,
            cache,
            key,
            sampling,
            stops,
            max_new_tokens,
            max_len,
            callback,
            policy,
        )


def _mesh_of(model: DeepseekV4) -> Mesh | None:
    sharding = getattr(model.embed.weight, "sharding", None)
    return sharding.mesh if isinstance(sharding, NamedSharding) else None


def _decode_loop(
    model, tokens, lengths, cache, key, sampling, stops, max_new_tokens, max_len, callback, policy
):
    batch = len(lengths)
    out: list[list[int]] = [[] for _ in range(batch)]
    running = np.ones(batch, bool)
    position = lengths.copy()
    for step in range(max_new_tokens):
        new = np.asarray(tokens)
        stopped = np.isin(new, stops)
        for b in np.flatnonzero(running & ~stopped):
            out[b].append(int(new[b]))
        running &= ~stopped
        if callback is not None:
            callback(new, running.copy())
        # A sequence is done once prompt and generation fill the cache length.
        running &= position + 1 < max_len
        if step == max_new_tokens - 1 or not running.any():
            break
        key, sub = jax.random.split(key)
        active = jnp.asarray(running.astype(np.int32))
        tokens, cache = _unchecked_step(
            model, jnp.asarray(new), active, cache, sub, sampling, policy
        )
        position += running
    return out


def _bucket(n: int, size: int) -> int:
    return -(-n // size) * size
