"""Drafters for speculative decoding: what proposes the next tokens that one main-model call
then verifies (`generate(..., speculative=True)`). A drafter plugs into the generation driver
as an object (`AbstractDrafter`); the one here drafts with the model's MTP blocks, the DSpark
drafter's is in `_dspark.py`.

With `J` MTP blocks, each step drafts `J` tokens (depth `j` at the last position, fed the token
depth `j - 1` drafted) and the main model verifies the pending token and the drafts in one
call of `J + 1` tokens; `accept_drafts` keeps the longest acceptable prefix and adds one token
of the main model's own, so each step gives every running sequence 1 .. `J + 1` tokens, the
same tokens (greedy) or the same distribution (sampling) as one-token decoding.

Caches are positional (see `nn.KVCache`): taking back the rejected drafts is setting
`positions`. Depth `j` (from 0) at position `t` needs token `t + j + 1`, so it keeps only the
positions whose tokens are all verified, `t <= P - j - 1` for `P` verified tokens, and is fed
the others (ending in drafts) again at the next step. Its chunk of a step starts at
`P_old - j`, where depth `j - 1`'s starts one position later: the output of depth `j - 1` at
that first position is kept from the step before (`Drafts.carry`). Near the start of a
sequence a depth's chunk would start at a negative position; it starts at 0 (`lag` rows
later).
"""

import abc
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, Key, PRNGKeyArray

from ..nn import DeepseekV4, KVCache
from ._sampling import Sampling, SamplingRows, draw_rows, filtered_logits, fold_in, sample


class AbstractDrafter(eqx.Module):
    """What the generation driver asks of a drafter. Its methods are traced inside the
    driver's jitted steps; the drafter itself is static (no arrays), its state a pytree."""

    @abc.abstractmethod
    def depth(self, model: DeepseekV4) -> int:
        """Tokens drafted per step."""

    def taps(self, model: DeepseekV4) -> tuple[int, ...]:
        """Decoder layers after which the drafter reads the main model's streams, averaged
        (`DeepseekV4.step`'s `taps`); none by default."""
        del model
        return ()

    def confidence(self, state: Any) -> Float[Array, "batch depth"] | None:
        """The drafter's estimate, per draft, that it survives verification given that the
        drafts before it do (`None`: the drafter makes none)."""
        del state
        return None

    @abc.abstractmethod
    def init(
        self,
        model: DeepseekV4,
        batch: int,
        max_len: int,
        sampling: Sampling | SamplingRows,
        place: Callable[[KVCache], KVCache],
    ) -> Any:
        """The empty state for `batch` sequences of up to `max_len` positions; `place` puts a
        cache where the main cache is (its sharding)."""

    @abc.abstractmethod
    def prefill(
        self,
        model: DeepseekV4,
        streams: Float[Array, "batch chunk streams d_model"],
        taps: Float[Array, "batch chunk taps d_model"],
        ahead: Int[Array, "batch chunk_plus_depth"],
        remaining: Int[Array, " batch"],
        state: Any,
    ) -> Any:
        """Take in a chunk of the prompts (positions `s ...`, `remaining[b]` = prompt length -
        `s`): the main model's final `streams` there, its stream averages after the layers of
        `taps(model)`, and `ahead[:, i]`, the prompt's token `s + 1 + i`."""

    @abc.abstractmethod
    def draft(
        self,
        model: DeepseekV4,
        streams: Float[Array, "batch rows streams d_model"],
        taps: Float[Array, "batch rows taps d_model"] | None,
        verified: Int[Array, " batch"],
        ahead: Int[Array, "batch rows"],
        state: Any,
        key: PRNGKeyArray | Key[Array, " batch"],
        sampling: Sampling | SamplingRows,
    ) -> Any:
        """Take in the positions just verified and draft the next tokens: `streams[:, i]` are
        the main model's final streams at the `i`-th position of the step (and `taps` its
        stream averages there, `None` for the last prompt position, which `prefill` took in),
        `verified[b]` how many of them are now verified (0: the row is idle, its state then
        unchanged), and `ahead[:, i]` the token after each, verified for `i < verified`. One
        key for the batch with a `Sampling`, one per row with `SamplingRows`."""

    @abc.abstractmethod
    def drafts(
        self, state: Any
    ) -> tuple[Int[Array, "batch depth"], Float[Array, "batch depth vocab"] | None]:
        """The drafted tokens and, when sampling, the distributions they were drawn from."""


class Drafts(eqx.Module):
    """The MTP drafter's state: the drafted tokens (for the positions after the pending token),
    the distributions they were drawn from (sampling only), one cache per MTP depth, and per
    depth but the last its output streams at the position where the next depth's next chunk
    starts."""

    tokens: Int[Array, "batch depth"]
    probs: Float[Array, "batch depth vocab"] | None
    caches: tuple[KVCache, ...]
    carry: tuple[Float[Array, "batch streams d_model"], ...]


class MTPDrafter(AbstractDrafter):
    """Drafts with the model's MTP blocks, one token per depth (see the module docstring)."""

    def depth(self, model: DeepseekV4) -> int:
        return len(model.mtp)

    def init(
        self,
        model: DeepseekV4,
        batch: int,
        max_len: int,
        sampling: Sampling | SamplingRows,
        place: Callable[[KVCache], KVCache],
    ) -> Drafts:
        n = len(model.mtp)
        c = model.config
        dtype = model.embed.weight.dtype
        # Depth j takes back up to j positions (its draft-fed ones).
        caches = model.init_mtp_cache(batch, max_len, rewind=n - 1)
        return Drafts(
            tokens=jnp.zeros((batch, n), jnp.int32),
            probs=None if sampling.greedy else jnp.zeros((batch, n, c.vocab_size), jnp.float32),
            caches=tuple(place(cache) for cache in caches),
            carry=tuple(jnp.zeros((batch, c.hc_mult, c.hidden_size), dtype) for _ in range(n - 1)),
        )

    def prefill(
        self,
        model: DeepseekV4,
        streams: Float[Array, "batch chunk streams d_model"],
        taps: Float[Array, "batch chunk taps d_model"],
        ahead: Int[Array, "batch chunk_plus_depth"],
        remaining: Int[Array, " batch"],
        state: Drafts,
    ) -> Drafts:
        # Each depth as far as its tokens are in the prompt (depth j: positions up to
        # L - j - 2).
        c = streams.shape[1]
        src, caches, carry = streams, [], list(state.carry)
        for j, block in enumerate(model.mtp):
            count = jnp.clip(remaining - j - 1, 0, c)
            _, src, cache = block.decode(
                src, ahead[:, j : j + c], state.caches[j], count, model.embed
            )
            caches.append(cache)
            if j + 1 < len(model.mtp):
                # The output at this depth's last prompt position, L - j - 2 (see `Drafts`).
                row = remaining - j - 2
                here = ((row >= 0) & (row < c))[:, None, None]
                carry[j] = jnp.where(here, _rows(src, row[:, None])[:, 0], carry[j])
        return Drafts(state.tokens, state.probs, tuple(caches), tuple(carry))

    def draft(
        self,
        model: DeepseekV4,
        streams: Float[Array, "batch rows streams d_model"],
        taps: Float[Array, "batch rows taps d_model"] | None,
        verified: Int[Array, " batch"],
        ahead: Int[Array, "batch rows"],
        state: Drafts,
        key: PRNGKeyArray | Key[Array, " batch"],
        sampling: Sampling | SamplingRows,
    ) -> Drafts:
        # `streams[:, i]` is at position P_old + i, P_old being depth 0's cache position (every
        # token before it is in every depth's cache as far as its inputs are verified).
        rows = ahead.shape[1]
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
            h, out, cache = block.decode(
                _rows(src, index), _rows(tokens, index), cache, count, model.embed
            )
            # Keep the positions fed only verified tokens.
            kept = jnp.where(busy, jnp.maximum(p_new - j, start), start)
            caches.append(cache.at_positions(kept))
            last = _rows(h, (p_new - 1 - start)[:, None])
            logits = model.head(last, dtype=jnp.float32)[:, 0]
            token, q = draw(logits, key, j, sampling, model)
            drafted.append(token)
            probs.append(q)
            tokens = jnp.put_along_axis(
                tokens, (verified + j)[:, None], token[:, None], axis=1, inplace=False
            )
            if j + 1 < len(model.mtp):
                # The next depth's input: row 0 at P_old - j - 1 (kept from the step before),
                # row r at P_old - j - 1 + r, which is this depth's output row r - 1 - lag.
                held = _rows(out, (p_new - j - 1 - start)[:, None])[:, 0]
                held = jnp.where(busy[:, None, None], held, state.carry[j])
                outputs = _rows(out, jnp.arange(size + 1)[None] - 1 - lag[:, None])
                src = jnp.concatenate([state.carry[j][:, None], outputs[:, 1:]], axis=1)
                carry.append(held)

        # An idle row keeps its drafts for when it runs again.
        def keep(new, old):
            return jnp.where(busy.reshape(-1, *(1,) * (new.ndim - 1)), new, old)

        return Drafts(
            tokens=keep(jnp.stack(drafted, axis=1), state.tokens),
            probs=None if state.probs is None else keep(jnp.stack(probs, axis=1), state.probs),
            caches=tuple(caches),
            carry=tuple(carry),
        )

    def drafts(
        self, state: Drafts
    ) -> tuple[Int[Array, "batch depth"], Float[Array, "batch depth vocab"] | None]:
        return state.tokens, state.probs


def _rows(x: Array, index: Array) -> Array:
    # x [b, n, ...] at rows index [b, k] (clipped into range).
    index = jnp.clip(index, 0, x.shape[1] - 1)
    return jnp.take_along_axis(x, index.reshape(*index.shape, *(1,) * (x.ndim - 2)), axis=1)


def draw(
    logits: Float[Array, "batch vocab"],
    key: PRNGKeyArray | Key[Array, " batch"],
    salt: int,
    sampling: Sampling | SamplingRows,
    model: DeepseekV4,
) -> tuple[Int[Array, " batch"], Float[Array, "batch vocab"] | None]:
    # A draft token per row and the distribution it came from (None when greedy), from `key`
    # (or each row's) folded with `salt`.
    key = fold_in(key, salt)
    if isinstance(sampling, SamplingRows):
        return draw_rows(logits, key, sampling, policy=model.policy)
    if sampling.greedy:
        return sample(logits, key, sampling, policy=model.policy), None
    logits = filtered_logits(logits, sampling)
    token = jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)
    return token, jax.nn.softmax(logits, axis=-1)
