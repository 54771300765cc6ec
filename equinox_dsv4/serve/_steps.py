"""The engine's jitted steps: a prefill step on a few rows of the cache (the lanes) and a
decode step on all rows, each row sampled with its own sampling and PRNG stream; with a drafter,
the same two steps feeding it, verifying its drafts and drafting again (`Engine` says when each
runs). Every step's shapes are fixed by the engine, so each compiles once."""

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Int

from ..execution import Policy, with_policy
from ..inference import (
    AbstractDrafter,
    SamplingRows,
    sample_rows,
    speculative_step,
    split_keys,
)
from ..nn import DeepseekV4, KVCache


def rows_of(n: int) -> SamplingRows:
    # A placeholder for `n` rows' sampling (what a drafter's state is shaped by).
    return SamplingRows(jnp.zeros(n), jnp.zeros(n, jnp.int32), jnp.ones(n))


def _keys(seeds: Int[Array, "batch 2"]) -> Array:
    # Each row's key: its request's seed folded with the tokens it has produced.
    return jax.vmap(lambda s: jax.random.fold_in(jax.random.key(s[0]), s[1]))(seeds)


@eqx.filter_jit(donate="all-except-first")
def prefill_step(
    model: DeepseekV4,
    policy: Policy,
    ids: Int[Array, "lanes chunk"],
    counts: Int[Array, " lanes"],
    fresh: Int[Array, " lanes"],
    index: Int[Array, " lanes"],
    cache: KVCache,
    sampling: SamplingRows,
    seeds: Int[Array, "lanes 2"],
) -> tuple[Int[Array, " lanes"], KVCache]:
    # The next chunk of the rows in the lanes (row `index[i]`: `counts[i]` tokens; 0 leaves it
    # as it is), a row starting a new prompt first set back to position 0; the token sampled
    # after each lane's last position in its chunk. Only the lanes' rows are computed.
    model = with_policy(model, policy)
    part = cache.take_rows(index)
    part = part.at_positions(jnp.where(fresh > 0, 0, part.positions))
    logits, part = model.decode_inline(ids, part, counts, last_only=True, checked=False)
    token = sample_rows(logits[:, 0], _keys(seeds), sampling, policy=policy)
    return token, cache.put_rows(index, part)


@eqx.filter_jit(donate="all-except-first")
def decode_step(
    model: DeepseekV4,
    policy: Policy,
    pending: Int[Array, " batch"],
    active: Int[Array, " batch"],
    cache: KVCache,
    sampling: SamplingRows,
    seeds: Int[Array, "batch 2"],
) -> tuple[Int[Array, " batch"], KVCache]:
    # Each active row's pending token appended; the next one sampled.
    model = with_policy(model, policy)
    logits, cache = model.decode_inline(pending[:, None], cache, active, False, checked=False)
    return sample_rows(logits[:, 0], _keys(seeds), sampling, policy=policy), cache


@eqx.filter_jit(donate="all-except-first")
def speculative_prefill_step(
    model: DeepseekV4,
    policy: Policy,
    drafter: AbstractDrafter,
    ids: Int[Array, "lanes chunk"],
    ahead: Int[Array, "lanes chunk_plus_depth"],
    remaining: Int[Array, " lanes"],
    fresh: Int[Array, " lanes"],
    index: Int[Array, " lanes"],
    cache: KVCache,
    drafts: object,
    sampling: SamplingRows,
    seeds: Int[Array, "lanes 2"],
) -> tuple[Int[Array, " lanes"], KVCache, object]:
    # `prefill_step` feeding the drafter too (`remaining[i]`: the lane's prompt tokens from
    # this chunk on, 0 for a lane left as it is; `ahead[i]`: the tokens after the chunk's), and
    # for a lane whose prompt ends in this chunk the first drafts after the sampled token.
    model = with_policy(model, policy)
    part = cache.take_rows(index)
    part = part.at_positions(jnp.where(fresh > 0, 0, part.positions))
    state = _restart(_take(drafts, index), fresh)
    count = jnp.clip(remaining, 0, ids.shape[1])
    x, part, _, taps = model.step(ids, part, count, in_place=True, taps=drafter.taps(model))
    last = jnp.take_along_axis(x, jnp.maximum(count - 1, 0)[:, None, None, None], axis=1)
    state = drafter.prefill(model, x, taps, ahead, remaining, state)
    sample_key, draft_key = split_keys(_keys(seeds), 2)
    token = sample_rows(model.logits(last)[:, 0], sample_key, sampling, policy=policy)
    # Only the lanes whose prompt ends here draft (an idle row's drafter state is unchanged).
    ends = ((remaining > 0) & (remaining <= ids.shape[1])).astype(jnp.int32)
    state = drafter.draft(model, last, None, ends, token[:, None], state, draft_key, sampling)
    return token, cache.put_rows(index, part), _put(drafts, index, state)


@eqx.filter_jit(donate="all-except-first")
def speculative_decode_step(
    model: DeepseekV4,
    policy: Policy,
    drafter: AbstractDrafter,
    pending: Int[Array, " batch"],
    active: Int[Array, " batch"],
    cache: KVCache,
    drafts: object,
    sampling: SamplingRows,
    seeds: Int[Array, "batch 2"],
) -> tuple[Int[Array, "batch depth_plus_one"], Int[Array, " batch"], KVCache, object]:
    # Each active row's pending token and drafts verified, the accepted ones and one more
    # token kept (`tokens[b, :counts[b]]`), and the next drafts.
    model = with_policy(model, policy)
    tokens, counts, _, cache, drafts = speculative_step(
        model, drafter, pending, active, cache, drafts, _keys(seeds), sampling
    )
    return tokens, counts, cache, drafts


def _is_cache(x) -> bool:
    return isinstance(x, KVCache)


def _take(state, index):
    # A drafter state's rows `index` (its arrays' leading axis is the batch; caches know
    # their own).
    def take(x):
        return x.take_rows(index) if _is_cache(x) else jnp.take(x, index, axis=0)

    return jax.tree.map(take, state, is_leaf=_is_cache)


def _put(state, index, part):
    # `state` with rows `index` replaced by `part`'s.
    def put(x, y):
        return x.put_rows(index, y) if _is_cache(x) else x.at[index].set(y, unique_indices=True)

    return jax.tree.map(put, state, part, is_leaf=_is_cache)


def _restart(state, fresh):
    # A drafter state whose caches start over (position 0) in the rows starting a new prompt;
    # positional, as the main cache is: what a row held beyond its position is never read.
    def restart(x):
        return x.at_positions(jnp.where(fresh > 0, 0, x.positions)) if _is_cache(x) else x

    return jax.tree.map(restart, state, is_leaf=_is_cache)
