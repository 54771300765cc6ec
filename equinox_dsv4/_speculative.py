"""Speculative decoding with the MTP blocks as the draft model.

With `J` MTP blocks, each step drafts `J` tokens (depth `j` at the last position, fed the token
depth `j - 1` drafted) and the main model verifies the pending token and the drafts in one
`decode` call of `J + 1` tokens. `accept_drafts` keeps the longest acceptable prefix and adds
one token of the main model's own, so each step gives every running sequence 1 .. `J + 1`
tokens, the same tokens (greedy) or the same distribution (sampling) as one-token decoding.

Caches are positional (see `_cache.py`): taking back the rejected drafts is setting
`positions`. Depth `j` (from 0) at position `t` needs token `t + j + 1`, so it keeps only the
positions whose tokens are all verified, `t <= P - j - 1` for `P` verified tokens, and is fed
the others (ending in drafts) again at the next step. Its chunk of a step starts at
`P_old - j`, where depth `j - 1`'s starts one position later: the output of depth `j - 1` at
that first position is kept from the step before (`Drafts.carry`). Near the start of a
sequence a depth's chunk would start at a negative position; it starts at 0 (`lag` rows
later).
"""

from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int, PRNGKeyArray

from ._cache import KVCache
from ._model import DeepseekV4
from ._mtp import mtp_decode
from ._policy import Policy
from ._sampling import Sampling, accept_drafts, filtered_logits, sample


class Drafts(eqx.Module):
    """The draft side of speculative decoding: the drafted tokens (for the positions after the
    pending token), the distributions they were drawn from (sampling only), one cache per MTP
    depth, and per depth but the last its output streams at the position where the next
    depth's next chunk starts."""

    tokens: Int[Array, "batch depth"]
    probs: Float[Array, "batch depth vocab"] | None
    caches: tuple[KVCache, ...]
    carry: tuple[Float[Array, "batch streams d_model"], ...]

    @classmethod
    def empty(cls, model: DeepseekV4, batch: int, max_len: int, sampling: Sampling) -> "Drafts":
        n = len(model.mtp)
        c = model.config
        dtype = model.embed.weight.dtype
        return cls(
            tokens=jnp.zeros((batch, n), jnp.int32),
            probs=None if sampling.greedy else jnp.zeros((batch, n, c.vocab_size), jnp.float32),
            # Depth j takes back up to j positions (its draft-fed ones).
            caches=model.init_mtp_cache(batch, max_len, rewind=n - 1),
            carry=tuple(jnp.zeros((batch, c.hc_mult, c.hidden_size), dtype) for _ in range(n - 1)),
        )


def _rows(x: Array, index: Array) -> Array:
    # x [b, n, ...] at rows index [b, k] (clipped into range).
    index = jnp.clip(index, 0, x.shape[1] - 1)
    return jnp.take_along_axis(x, index.reshape(*index.shape, *(1,) * (x.ndim - 2)), axis=1)


def _draw(logits, key, sampling, policy):
    # A draft token per row and the distribution it came from (None when greedy).
    if sampling.greedy:
        return sample(logits, key, sampling, policy=policy), None
    logits = filtered_logits(logits, sampling)
    token = jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)
    return token, jax.nn.softmax(logits, axis=-1)


def draft(
    model: DeepseekV4,
    streams: Float[Array, "batch rows streams d_model"],
    verified: Int[Array, " batch"],
    ahead: Int[Array, "batch rows"],
    state: Drafts,
    key: PRNGKeyArray,
    sampling: Sampling,
    policy: Policy,
) -> Drafts:
    """Feed the MTP depths the positions just verified and draft the next tokens.

    `streams[:, i]` are the main model's final streams at position `P_old + i`, `P_old` being
    depth 0's cache position (every token before it is in every depth's cache as far as its
    inputs are verified), `verified[b]` how many of them are now verified (0: the row is idle),
    and `ahead[:, i]` the token at `P_old + 1 + i`, verified for `i < verified`."""
    b, rows = ahead.shape
    p_old = state.caches[0].positions
    p_new = p_old + verified
    busy = verified > 0
    # Token at P_old + 1 + i, the drafts going after the verified ones.
    tokens = jnp.pad(ahead, ((0, 0), (0, len(model.mtp))))
    src = streams  # depth j's input, row r at position P_old - j + r
    caches, carry, drafted, probs = [], [], [], []
    for j, block in enumerate(model.mtp):
        cache = state.caches[j]
        start = cache.positions
        lag = start - (p_old - j)
        size = rows + j
        index = jnp.arange(size)[None] + lag[:, None]
        count = jnp.where(busy, p_new - start, 0)
        h, out, cache = mtp_decode(
            block, model.embed, _rows(src, index), _rows(tokens, index), cache, count, policy
        )
        # Keep the positions fed only verified tokens.
        caches.append(cache.at_positions(jnp.where(busy, jnp.maximum(p_new - j, start), start)))
        last = _rows(h, (p_new - 1 - start)[:, None])
        logits = model.head(last, dtype=jnp.float32, policy=policy)[:, 0]
        token, q = _draw(logits, jax.random.fold_in(key, j), sampling, policy)
        drafted.append(token)
        probs.append(q)
        tokens = jnp.put_along_axis(
            tokens, (verified + j)[:, None], token[:, None], axis=1, inplace=False
        )
        if j + 1 < len(model.mtp):
            # The next depth's input: row 0 at P_old - j - 1 (kept from the step before), row
            # r at P_old - j - 1 + r, which is this depth's output row r - 1 - lag.
            held = _rows(out, (p_new - j - 1 - start)[:, None])[:, 0]
            held = jnp.where(busy[:, None, None], held, state.carry[j])
            outputs = _rows(out, jnp.arange(size + 1)[None] - 1 - lag[:, None])
            src = jnp.concatenate([state.carry[j][:, None], outputs[:, 1:]], axis=1)
            carry.append(held)
    return Drafts(
        tokens=jnp.stack(drafted, axis=1),
        probs=None if sampling.greedy else jnp.stack(probs, axis=1),
        caches=tuple(caches),
        carry=tuple(carry),
    )


@eqx.filter_jit(donate="all-except-first")
def prefill_chunk(
    model: DeepseekV4,
    ids: Int[Array, "batch chunk"],
    ahead: Int[Array, "batch chunk_plus_depth"],
    remaining: Int[Array, " batch"],
    cache: KVCache,
    state: Drafts,
    policy: Policy,
) -> tuple[Float[Array, "batch vocab"], Float[Array, "batch streams d_model"], KVCache, Drafts]:
    """A chunk of the prompts (positions `s ...`, `remaining[b]` = prompt length - `s`) into
    the main cache and into each MTP depth as far as its tokens are in the prompt (depth `j`:
    positions up to `L - j - 2`). `ahead[:, i]` is the prompt's token `s + 1 + i`.

    **Returns:** the logits and final streams at each row's last position in the chunk, and
    the caches."""
    c = ids.shape[1]
    count = jnp.clip(remaining, 0, c)
    x, cache, _ = model._forward(ids, cache, count, policy=policy, in_place=True)
    last = _rows(x, jnp.maximum(count - 1, 0)[:, None])
    logits = model.logits(last, policy=policy)[:, 0]
    src, caches, carry = x, [], list(state.carry)
    for j, block in enumerate(model.mtp):
        count_j = jnp.clip(remaining - j - 1, 0, c)
        _, src, mtp_cache = mtp_decode(
            block, model.embed, src, ahead[:, j : j + c], state.caches[j], count_j, policy
        )
        caches.append(mtp_cache)
        if j + 1 < len(model.mtp):
            # The output at this depth's last prompt position, L - j - 2 (see `Drafts`).
            row = remaining - j - 2
            here = ((row >= 0) & (row < c))[:, None, None]
            carry[j] = jnp.where(here, _rows(src, row[:, None])[:, 0], carry[j])
    state = Drafts(state.tokens, state.probs, tuple(caches), tuple(carry))
    return logits, last[:, 0], cache, state


@eqx.filter_jit(donate="all-except-first")
def first_drafts(
    model: DeepseekV4,
    logits: Float[Array, "batch vocab"],
    streams: Float[Array, "batch streams d_model"],
    state: Drafts,
    sample_key: PRNGKeyArray,
    draft_key: PRNGKeyArray,
    sampling: Sampling,
    policy: Policy,
) -> tuple[Int[Array, " batch"], Drafts]:
    """After the prompts: the first generated token, drawn from the main model's `logits` at
    the last prompt position as one-token decoding draws it, then the MTP depths at that
    position (main streams `streams`) with it, and the first drafts. **Returns:** `(first,
    drafts)`."""
    first = sample(logits, sample_key, sampling, policy=policy)
    ones = jnp.ones_like(first)
    state = draft(model, streams[:, None], ones, first[:, None], state, draft_key, sampling, policy)
    return first, state


def step_fn(
    model: DeepseekV4,
    pending: Int[Array, " batch"],
    active: Int[Array, " batch"],
    cache: KVCache,
    state: Drafts,
    key: PRNGKeyArray,
    sampling: Sampling,
    policy: Policy,
) -> tuple[
    Int[Array, "batch depth_plus_one"], Int[Array, " batch"], Int[Array, " batch"], KVCache, Drafts
]:
    """One speculative step: verify `[pending, drafts]` of each active row, keep what is
    accepted, draft again. **Returns:** `(tokens, counts, pending, cache, drafts)`: row `b`'s
    new tokens are `tokens[b, :counts[b]]` (`counts[b] = 0` for an idle row), the last of them
    the next step's `pending` (not yet in the cache)."""
    n = len(model.mtp)
    ids = jnp.concatenate([pending[:, None], state.tokens], axis=1)
    start = cache.positions
    x, cache, _ = model._forward(ids, cache, active * (n + 1), policy=policy, in_place=True)
    logits = model.logits(x, policy=policy)
    v_key, d_key = jax.random.split(key)
    accepted, tokens = accept_drafts(
        logits, state.tokens, state.probs, v_key, sampling, policy=policy
    )
    counts = active * (accepted + 1)
    cache = cache.at_positions(start + counts)
    last = jnp.take_along_axis(tokens, jnp.maximum(counts - 1, 0)[:, None], axis=1)[:, 0]
    pending = jnp.where(active > 0, last, pending)
    state = draft(model, x, counts, tokens, state, d_key, sampling, policy)
    return tokens, counts, pending, cache, state


step = eqx.filter_jit(step_fn, donate="all-except-first")


def generate_speculative(
    model: DeepseekV4,
    ids: np.ndarray,
    lengths: np.ndarray,
    *,
    max_new_tokens: int,
    max_len: int,
    sampling: Sampling,
    key: PRNGKeyArray,
    stops: np.ndarray,
    callback: Callable[[np.ndarray, np.ndarray], None] | None,
    prefill_chunk_size: int,
    policy: Policy,
    place: Callable[[KVCache], KVCache],
    stats: dict | None,
) -> list[list[int]]:
    """`generate(..., speculative=True)` after its checks (see there)."""
    batch, depth = len(lengths), len(model.mtp)
    # Room for the drafts verified past the last kept token.
    cache = place(model.init_cache(batch, max_len + depth, rewind=depth))
    state = Drafts.empty(model, batch, max_len + depth, sampling)
    state = eqx.tree_at(lambda s: s.caches, state, tuple(place(c) for c in state.caches))
    width = ids.shape[1]
    ahead = np.pad(ids, ((0, 0), (0, prefill_chunk_size + depth)))
    key, prefill_key, draft_key = jax.random.split(key, 3)
    last_logits = last_streams = None
    for s in range(0, width, prefill_chunk_size):
        part = ids[:, s : s + prefill_chunk_size]
        if part.shape[1] < prefill_chunk_size and s > 0:
            part = np.pad(part, ((0, 0), (0, prefill_chunk_size - part.shape[1])))
        c = part.shape[1]
        remaining = lengths - s
        logits, streams, cache, state = prefill_chunk(
            model,
            jnp.asarray(part),
            jnp.asarray(ahead[:, s + 1 : s + 1 + c + depth]),
            jnp.asarray(remaining),
            cache,
            state,
            policy,
        )
        ends = jnp.asarray((remaining > 0) & (remaining <= c))
        if last_logits is None:
            last_logits, last_streams = logits, streams
        else:
            last_logits = jnp.where(ends[:, None], logits, last_logits)
            last_streams = jnp.where(ends[:, None, None], streams, last_streams)
    first, state = first_drafts(
        model, last_logits, last_streams, state, prefill_key, draft_key, sampling, policy
    )

    out: list[list[int]] = [[] for _ in range(batch)]
    produced = np.zeros(batch, np.int64)
    # As one-token decoding: the first token always, then while prompt + output < max_len.
    limit = np.minimum(max_new_tokens, np.maximum(max_len - lengths, 1))
    running = np.ones(batch, bool)
    counters = {"steps": 0, "drafted": 0, "accepted": 0, "histogram": [0] * (depth + 1)}

    def take(tokens: np.ndarray, has: np.ndarray) -> None:
        stopped = has & np.isin(tokens, stops)
        kept = has & ~stopped
        for b in np.flatnonzero(kept):
            out[b].append(int(tokens[b]))
        produced[kept] += 1
        if callback is not None:
            callback(tokens, kept)
        running[stopped | (produced >= limit)] = False

    take(np.asarray(first), running.copy())
    pending = first
    while running.any():
        key, sub = jax.random.split(key)
        active = running.copy()
        tokens, counts, pending, cache, state = step(
            model,
            pending,
            jnp.asarray(active.astype(np.int32)),
            cache,
            state,
            sub,
            sampling,
            policy,
        )
        tokens_np, counts_np = jax.device_get((tokens, counts))
        accepted = counts_np[active] - 1
        counters["steps"] += 1
        counters["drafted"] += depth * int(active.sum())
        counters["accepted"] += int(accepted.sum())
        for a, n in zip(*np.unique(accepted, return_counts=True), strict=True):
            counters["histogram"][a] += int(n)
        for i in range(depth + 1):
            take(tokens_np[:, i], running & (counts_np > i))
    if stats is not None:
        counters["tokens"] = sum(len(o) for o in out)
        stats.update(counters)
    return out
