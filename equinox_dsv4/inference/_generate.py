"""Generation with the compressed KV cache: one driver for plain and speculative decoding.

The prompts run in chunks through one jitted prefill step (one compiled program whatever the
prompt length), then one host loop runs one jitted step per iteration (fixed shapes, the caches
donated): a plain step appends each running row's pending token and samples the next; with a
drafter (`speculative="mtp"`: the MTP blocks, `_drafting.py`; `"dspark"`: the DSpark
drafter, `_dspark.py`) a step verifies the pending token and the drafts in one main-model
call and drafts again. The loop owns stops, length limits, the streaming callback and the
statistics. Prompts of different lengths share a batch: each sequence keeps its own position
in the cache (no left padding, which would shift the position-based compression windows), and
a finished sequence stops advancing.
"""

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jaxtyping import Array, Float, Int, Key, PRNGKeyArray

from .._typecheck import typechecked
from ..execution import Policy, with_policy
from ..nn import DeepseekV4, KVCache
from ..parallel import committed, shard_cache
from ._drafting import AbstractDrafter, MTPDrafter, _rows
from ._dspark import DSparkDrafter
from ._sampling import Sampling, SamplingRows, accept_drafts, sample, sample_rows, split_keys


@typechecked
def prefill(
    model: DeepseekV4,
    ids: Int[Array, "batch seq"],
    lengths: Int[Array, " batch"],
    cache: KVCache,
    key: PRNGKeyArray,
    sampling: Sampling,
    chunk: int = 512,
    *,
    checked: bool = True,
) -> tuple[Int[Array, " batch"], KVCache]:
    """Run the prompts (row `b`: its first `lengths[b]` tokens) in chunks of `chunk` tokens
    (one compiled step whatever the prompt length; activations bounded by the chunk) and
    sample each one's next token. Appending past the cache's `max_len` is an error, unless
    `checked=False`: for a caller that keeps within the cache itself (as `generate` does),
    whose programs then hold no host callback, which JAX never writes to its persistent
    compilation cache. **Returns:** `(tokens, cache)`."""
    _check_ids(ids)
    policy = model.resolved_policy()
    logits, _, cache, _ = _prefill(model, policy, None, ids, lengths, cache, None, chunk, checked)
    return _sample(logits, key, sampling, policy=policy), cache


@typechecked
def decode_step(
    model: DeepseekV4,
    tokens: Int[Array, " batch"],
    active: Int[Array, " batch"],
    cache: KVCache,
    key: PRNGKeyArray,
    sampling: Sampling,
    *,
    checked: bool = True,
) -> tuple[Int[Array, " batch"], KVCache]:
    """Append one token per active row (`active[b]` 1 or 0) and sample the next, jitted with
    the cache donated. Appending past the cache's `max_len` is an error, unless
    `checked=False` (see `prefill`)."""
    _check_ids(tokens[:, None])
    policy = model.resolved_policy()
    _, _, token, cache, _, _ = _step(
        model, policy, None, tokens, active, cache, None, key, sampling, checked
    )
    return token, cache


@typechecked
def speculative_step(
    model: DeepseekV4,
    drafter: AbstractDrafter,
    pending: Int[Array, " batch"],
    active: Int[Array, " batch"],
    cache: KVCache,
    drafts: Any,
    key: PRNGKeyArray | Key[Array, " batch"],
    sampling: Sampling | SamplingRows,
) -> tuple[
    Int[Array, "batch depth_plus_one"], Int[Array, " batch"], Int[Array, " batch"], KVCache, Any
]:
    """One step of speculative generation, as `generate` runs it: append each active row's
    pending token and the drafts after it (`drafter.drafts(drafts)`) in one main-model call,
    keep the accepted ones, draft again. Jitted with the caches donated.

    **Returns:** `(tokens, counts, pending, cache, drafts)`: row `b`'s new tokens are
    `tokens[b, :counts[b]]` (0 for an idle row), the last of them the next step's pending
    token; the cache (from `model.init_cache(..., rewind=depth)`) and the drafter's state.
    With `SamplingRows` and a key per row, each row samples, drafts and is verified with its
    own (the drafter's state from `drafter.init` given the same `SamplingRows`)."""
    _check_ids(pending[:, None])
    policy = model.resolved_policy()
    out = _step(model, policy, drafter, pending, active, cache, drafts, key, sampling, False)
    return out[:5]


@typechecked
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
    speculative: bool | str | AbstractDrafter = False,
    stats: dict | None = None,
) -> list[list[int]]:
    """Generate continuations of a batch of prompts.

    **Arguments:**

    - `model`: the model (its execution policy: see `DeepseekV4`).
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
      `depth + 1` tokens: one call per token column, `running[b]` False for a row with fewer.
    - `prefill_chunk`: prompts are run in chunks of this many tokens (see `prefill`).
    - `speculative`: `"mtp"` (or `True`) drafts with the model's MTP blocks (`MTPDrafter`),
      `"dspark"` with its DSpark drafter (`DSparkDrafter`, a block of `dspark_block_size`
      drafts per step), or give a drafter; one main-model call per step verifies the drafts:
      the same tokens when greedy, the same distribution when sampling, in fewer main-model
      calls where drafts are accepted.
    - `stats`: a dict to fill with `steps` (main-model calls after the prefill), `tokens`
      (generated), and when speculative `drafted` / `accepted` (draft tokens of running
      rows, and how many were accepted) and `histogram` (steps by accepted drafts); with a
      drafter that rates its drafts (DSpark), `confidence_accepted` / `confidence_rejected`:
      the mean confidence of the accepted drafts and of the drafts verification rejected
      (the first wrong one of a step; the drafts after it are never judged); NaN where
      there were none.

    **Returns:** the generated ids per prompt, without the prompt.
    """
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if sampling.temperature > 0 and key is None:
        raise ValueError("sampling with temperature > 0 needs a PRNG key")
    drafter = drafter_for(model, speculative)
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
    policy = model.resolved_policy()

    def place(cache: KVCache) -> KVCache:
        # Committed as the steps' outputs are (else the first prefill chunk compiles apart).
        return committed(cache) if mesh is None else shard_cache(cache, mesh)

    depth = 0 if drafter is None else drafter.depth(model)
    with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
        # Room for the drafts verified past the last kept token.
        cache = place(model.init_cache(batch, max_len + depth, rewind=depth))
        drafts = draft_key = None
        if drafter is None:
            key, prefill_key = jax.random.split(key)
        else:
            key, prefill_key, draft_key = jax.random.split(key, 3)
            drafts = drafter.init(model, batch, max_len + depth, sampling, place)
            drafts = committed(drafts) if mesh is None else drafts
        # Unchecked, as `prefill(..., checked=False)` (no host callback, so its programs are
        # cached across processes): the prompts fit `max_len` (checked above) in a fresh
        # cache, and the loop stops each row before the cache is full.
        logits, streams, cache, drafts = _prefill(
            model, policy, drafter, ids, lengths, cache, drafts, prefill_chunk, False
        )
        first, drafts = _first(
            model, policy, drafter, logits, streams, drafts, prefill_key, draft_key, sampling
        )
        loop = _Loop(batch, depth, stops, max_new_tokens, max_len, lengths, callback)
        loop.take(np.asarray(first), loop.running.copy())
        pending = first
        while loop.running.any():
            key, sub = jax.random.split(key)
            active = loop.running.copy()
            tokens, counts, pending, cache, drafts, confidence = _step(
                model,
                policy,
                drafter,
                pending,
                jnp.asarray(active.astype(np.int32)),
                cache,
                drafts,
                sub,
                sampling,
                False,
            )
            loop.step(*jax.device_get((tokens, counts, confidence)), active)
    if stats is not None:
        stats.update(loop.stats(speculative=drafter is not None))
    return loop.out


class _Loop:
    # The host side of the loop: what each row has produced, which rows still run (stop tokens,
    # `max_new_tokens`, the cache length), the callback, the counts.

    def __init__(self, batch, depth, stops, max_new_tokens, max_len, lengths, callback):
        self.out: list[list[int]] = [[] for _ in range(batch)]
        self.running = np.ones(batch, bool)
        self.produced = np.zeros(batch, np.int64)
        # The first token always, then while prompt + output < max_len.
        self.limit = np.minimum(max_new_tokens, np.maximum(max_len - lengths, 1))
        self.depth, self.stops, self.callback = depth, stops, callback
        self.counters = {"steps": 0, "drafted": 0, "accepted": 0, "histogram": [0] * (depth + 1)}
        self.confidence = {"accepted": [0.0, 0], "rejected": [0.0, 0]}  # sum, count

    def take(self, tokens: np.ndarray, has: np.ndarray) -> None:
        stopped = has & np.isin(tokens, self.stops)
        kept = has & ~stopped
        for b in np.flatnonzero(kept):
            self.out[b].append(int(tokens[b]))
        self.produced[kept] += 1
        if self.callback is not None:
            self.callback(tokens, kept)
        self.running[stopped | (self.produced >= self.limit)] = False

    def step(self, tokens, counts, confidence, active: np.ndarray) -> None:
        accepted = counts[active] - 1
        if confidence is not None:
            rated = confidence[active]
            kept = np.arange(self.depth)[None] < accepted[:, None]
            first_wrong = np.arange(self.depth)[None] == accepted[:, None]
            for name, where in (("accepted", kept), ("rejected", first_wrong)):
                self.confidence[name][0] += float(rated[where].sum())
                self.confidence[name][1] += int(where.sum())
        self.counters["steps"] += 1
        self.counters["drafted"] += self.depth * int(active.sum())
        self.counters["accepted"] += int(accepted.sum())
        for a, n in zip(*np.unique(accepted, return_counts=True), strict=True):
            self.counters["histogram"][a] += int(n)
        for i in range(self.depth + 1):
            self.take(tokens[:, i], self.running & (counts > i))

    def stats(self, speculative: bool) -> dict[str, Any]:
        tokens = sum(len(o) for o in self.out)
        if not speculative:
            return {"steps": self.counters["steps"], "tokens": tokens}
        rated = {
            f"confidence_{name}": total / count if count else float("nan")
            for name, (total, count) in self.confidence.items()
        }
        rated = rated if any(count for _, count in self.confidence.values()) else {}
        return {**self.counters, **rated, "tokens": tokens}


def _prefill(model, policy, drafter, ids, lengths, cache, drafts, chunk, checked):
    # The prompts in chunks: each row's logits (and with a drafter its final streams) at its
    # last prompt position.
    ids, lengths = jnp.asarray(ids), jnp.asarray(lengths, jnp.int32)
    depth = 0 if drafter is None else drafter.depth(model)
    ahead = None if drafter is None else jnp.pad(ids, ((0, 0), (0, chunk + depth)))
    last_logits = last_streams = None
    for s in range(0, ids.shape[1], chunk):
        part = ids[:, s : s + chunk]
        if part.shape[1] < chunk and s > 0:
            part = jnp.pad(part, ((0, 0), (0, chunk - part.shape[1])))
        c = part.shape[1]
        remaining = lengths - s
        window = None if ahead is None else ahead[:, s + 1 : s + 1 + c + depth]
        ends = (remaining > 0) & (remaining <= c)  # before the step donates `remaining`
        logits, streams, cache, drafts = _prefill_chunk(
            model, policy, drafter, part, window, remaining, cache, drafts, checked
        )
        if last_logits is None:
            last_logits, last_streams = logits, streams
        else:
            last_logits = jnp.where(ends[:, None], logits, last_logits)
            if streams is not None:
                last_streams = jnp.where(ends[:, None, None], streams, last_streams)
    return last_logits, last_streams, cache, drafts


@eqx.filter_jit(donate="all-except-first")
def _prefill_chunk(
    model: DeepseekV4,
    policy: Policy,
    drafter: AbstractDrafter | None,
    ids: Int[Array, "batch chunk"],
    ahead: Int[Array, "batch chunk_plus_depth"] | None,
    remaining: Int[Array, " batch"],
    cache: KVCache,
    drafts: Any,
    checked: bool,
) -> tuple[Float[Array, "batch vocab"], Any, KVCache, Any]:
    # A chunk of the prompts (positions s ..., `remaining[b]` = prompt length - s) into the
    # main cache and the drafter: the logits (and with a drafter the final streams) at each
    # row's last position in the chunk.
    model = with_policy(model, policy)
    count = jnp.clip(remaining, 0, ids.shape[1])
    if drafter is None:
        logits, cache = model.decode_inline(ids, cache, count, last_only=True, checked=checked)
        return logits[:, 0], None, cache, None
    x, cache, _, taps = model.step(ids, cache, count, in_place=True, taps=drafter.taps(model))
    last = _rows(x, jnp.maximum(count - 1, 0)[:, None])
    drafts = drafter.prefill(model, x, taps, ahead, remaining, drafts)
    return model.logits(last)[:, 0], last[:, 0], cache, drafts


@eqx.filter_jit(donate="all-except-first")
def _first(model, policy, drafter, logits, streams, drafts, sample_key, draft_key, sampling):
    # After the prompts: the first generated token, drawn from the main model's logits at the
    # last prompt position, and (with a drafter) the first drafts at that position.
    model = with_policy(model, policy)
    first = sample(logits, sample_key, sampling, policy=policy)
    if drafter is not None:
        ones = jnp.ones_like(first)
        drafts = drafter.draft(
            model, streams[:, None], None, ones, first[:, None], drafts, draft_key, sampling
        )
    return first, drafts


@eqx.filter_jit(donate="all-except-first")
def _step(
    model: DeepseekV4,
    policy: Policy,
    drafter: AbstractDrafter | None,
    pending: Int[Array, " batch"],
    active: Int[Array, " batch"],
    cache: KVCache,
    drafts: Any,
    key: PRNGKeyArray | Key[Array, " batch"],
    sampling: Sampling | SamplingRows,
    checked: bool,
) -> tuple[
    Int[Array, "batch depth_plus_one"],
    Int[Array, " batch"],
    Int[Array, " batch"],
    Any,
    Any,
    Float[Array, "batch depth"] | None,
]:
    # One step: append each active row's pending token (and verify the drafts after it), keep
    # what is accepted, draft again. Returns (tokens, counts, pending, cache, drafts,
    # confidence): row b's new tokens are tokens[b, :counts[b]] (counts[b] = 0 for an idle
    # row), the last of them the next step's pending token (not yet in the cache);
    # `confidence` the drafter's rating of the drafts this step verified (or None).
    model = with_policy(model, policy)
    if drafter is None:
        logits, cache = model.decode_inline(pending[:, None], cache, active, False, checked=checked)
        if isinstance(sampling, SamplingRows):
            token = sample_rows(logits[:, 0], key, sampling, policy=policy)
        else:
            token = sample(logits[:, 0], key, sampling, policy=policy)
        return token[:, None], active, token, cache, None, None
    tokens, probs = drafter.drafts(drafts)
    confidence = drafter.confidence(drafts)
    ids = jnp.concatenate([pending[:, None], tokens], axis=1)
    start = cache.positions
    x, cache, _, taps = model.step(
        ids, cache, active * ids.shape[1], in_place=True, taps=drafter.taps(model)
    )
    v_key, d_key = split_keys(key, 2)
    accepted, out = accept_drafts(model.logits(x), tokens, probs, v_key, sampling, policy=policy)
    counts = active * (accepted + 1)
    cache = cache.at_positions(start + counts)
    last = jnp.take_along_axis(out, jnp.maximum(counts - 1, 0)[:, None], axis=1)[:, 0]
    pending = jnp.where(active > 0, last, pending)
    drafts = drafter.draft(model, x, taps, counts, out, drafts, d_key, sampling)
    return out, counts, pending, cache, drafts, confidence


_sample = eqx.filter_jit(sample)


@typechecked
def drafter_for(
    model: DeepseekV4, speculative: bool | str | AbstractDrafter
) -> AbstractDrafter | None:
    """The drafter `speculative` (`generate`'s argument) names for `model`: `None` for `False`,
    `MTPDrafter` for `True` or `"mtp"`, `DSparkDrafter` for `"dspark"`, a drafter as it is;
    `ValueError` for another value, or for a drafter whose blocks the model lacks."""
    if isinstance(speculative, AbstractDrafter):
        drafter = speculative
    elif speculative is False:
        return None
    elif speculative in (True, "mtp", "dspark"):
        drafter = DSparkDrafter() if speculative == "dspark" else MTPDrafter()
    else:
        raise ValueError(
            f"speculative must be False, True, 'mtp', 'dspark' or an AbstractDrafter, got "
            f"{speculative!r}"
        )
    if isinstance(drafter, MTPDrafter) and not model.mtp:
        raise ValueError(
            f"speculative={speculative!r} drafts with the MTP blocks, and this model has none "
            "(num_nextn_predict_layers == 0, a DSpark release, or loaded without them)"
            + ('; use speculative="dspark"' if model.dspark is not None else "")
        )
    if isinstance(drafter, DSparkDrafter) and model.dspark is None:
        raise ValueError(
            f"speculative={speculative!r} drafts with the DSpark drafter, and this model has "
            "none (its config has no dspark_* fields, or it was loaded without it)"
        )
    return drafter


def _check_ids(ids: Array) -> None:
    if ids.ndim != 2 or not jnp.issubdtype(ids.dtype, jnp.integer):
        raise ValueError(f"token ids must be an integer array, got {ids.dtype}{list(ids.shape)}")


def _mesh_of(model: DeepseekV4) -> Mesh | None:
    sharding = getattr(model.embed.weight, "sharding", None)
    return sharding.mesh if isinstance(sharding, NamedSharding) else None


def _bucket(n: int, size: int) -> int:
    return -(-n // size) * size
