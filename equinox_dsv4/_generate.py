"""Generation with the compressed KV cache.

One jitted prefill per prompt-batch shape, then one jitted decode step (fixed shapes, the cache
donated) per new token, or per speculative step (`_speculative.py`). Prompts of different
lengths share a batch: each sequence keeps its own position in the cache (no left padding,
which would shift the position-based compression windows), and a finished sequence stops
advancing.
"""

import contextlib
from collections.abc import Callable, Sequence

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jaxtyping import Array, Float, Int, PRNGKeyArray

from ._cache import KVCache
from ._model import DeepseekV4, _check_ids
from ._parallel import committed
from ._policy import Policy, resolve
from ._sampling import Sampling, sample
from ._sharding import shard_cache
from ._speculative import generate_speculative


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
    speculative: bool = False,
    stats: dict | None = None,
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
    - `callback`: called with every new token, as `callback(tokens, running)`: `tokens[b]`
      is row `b`'s new token where `running[b]`; a row that stops gets its stop token with
      `running[b]` False (for streaming). A speculative step gives a row up to
      `num_nextn_predict_layers + 1` tokens: one call per token column, `running[b]` False
      for a row with fewer.
    - `prefill_chunk`: prompts are run in chunks of this many tokens (see `prefill`).
    - `policy`: the execution `Policy` (default: the one for the model's platform).
    - `speculative`: draft with the model's MTP blocks and verify the drafts with one main
      model call per step (see `_speculative.py`): the same tokens when greedy, the same
      distribution when sampling, in fewer main-model calls where drafts are accepted.
    - `stats`: a dict to fill with `steps` (main-model calls after the prefill), `tokens`
      (generated), and when speculative `drafted` / `accepted` (draft tokens of running
      rows, and how many were accepted) and `histogram` (steps by accepted drafts).

    **Returns:** the generated ids per prompt, without the prompt.
    """
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if sampling.temperature > 0 and key is None:
        raise ValueError("sampling with temperature > 0 needs a PRNG key")
    if speculative and not model.mtp:
        raise ValueError(
            "speculative=True drafts with the MTP blocks, and this model has none "
            "(num_nextn_predict_layers == 0, or loaded without them)"
        )
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
    policy = resolve(policy, model.embed.weight)
    if not speculative:
        cache = model.init_cache(batch, max_len)
        if mesh is not None:
            cache = shard_cache(cache, mesh)
    with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
        if speculative:
            return generate_speculative(
                model,
                ids,
                lengths,
                max_new_tokens=max_new_tokens,
                max_len=max_len,
                sampling=sampling,
                key=key,
                stops=stops,
                callback=callback,
                prefill_chunk_size=prefill_chunk,
                policy=policy,
                place=(lambda c: c) if mesh is None else (lambda c: shard_cache(c, mesh)),
                stats=stats,
            )
        key, prefill_key = jax.random.split(key)
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
            stats,
        )


def _mesh_of(model: DeepseekV4) -> Mesh | None:
    sharding = getattr(model.embed.weight, "sharding", None)
    return sharding.mesh if isinstance(sharding, NamedSharding) else None


def _decode_loop(
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
    stats,
):
    batch = len(lengths)
    out: list[list[int]] = [[] for _ in range(batch)]
    running = np.ones(batch, bool)
    position = lengths.copy()
    steps = 0
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
        steps += 1
    if stats is not None:
        stats.update(steps=steps, tokens=sum(len(o) for o in out))
    return out


def _bucket(n: int, size: int) -> int:
    return -(-n // size) * size
