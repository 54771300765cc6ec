"""Choosing tokens from logits: greedy, or sampling with temperature, top-k and top-p; and the
speculative-sampling rule that accepts or replaces drafted tokens without changing the
distribution of the output (Leviathan et al. 2023, Chen et al. 2023)."""

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, Key, PRNGKeyArray

from .._typecheck import typechecked
from ..execution import Policy, argmax


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How to pick the next token: greedy when `temperature == 0`, otherwise from the softmax of
    `logits / temperature` restricted to the `top_k` most likely tokens (0: all) and to the
    smallest set whose probability reaches `top_p` (nucleus sampling)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self):
        for name, kinds in (
            ("temperature", (int, float)),
            ("top_k", (int,)),
            ("top_p", (int, float)),
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, kinds):
                expected = " or ".join(k.__name__ for k in kinds)
                raise TypeError(f"Sampling.{name} must be {expected}, got {value!r}")
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@typechecked
def filtered_logits(
    logits: Float[Array, "*batch vocab"], sampling: Sampling
) -> Float[Array, "*batch vocab"]:
    """float32 `logits / temperature`, `-inf` outside the top-k and top-p sets: the
    distribution `sample` draws from is their softmax. Not for greedy `sampling`."""
    assert not sampling.greedy
    logits = logits.astype(jnp.float32) / sampling.temperature
    if 0 < sampling.top_k < logits.shape[-1]:
        kth = jax.lax.top_k(logits, sampling.top_k)[0][..., -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if sampling.top_p < 1:
        order = jnp.argsort(-logits, axis=-1)
        sorted_probs = jax.nn.softmax(jnp.take_along_axis(logits, order, axis=-1), axis=-1)
        # Keep a token if the mass of the tokens before it is below top_p (the first always).
        before = jnp.cumsum(sorted_probs, axis=-1) - sorted_probs
        keep_sorted = before < sampling.top_p
        keep = jnp.put_along_axis(
            jnp.zeros_like(keep_sorted), order, keep_sorted, axis=-1, inplace=False
        )
        logits = jnp.where(keep, logits, -jnp.inf)
    return logits


@typechecked
def sample(
    logits: Float[Array, "batch vocab"],
    key: PRNGKeyArray,
    sampling: Sampling,
    *,
    policy: Policy | None = None,
) -> Int[Array, " batch"]:
    """One token per row (see `Sampling`); greedy takes the first largest logit (NaN counting
    as largest), in the form `policy` says (`execution.argmax`; default: the one for the
    target platform)."""
    if sampling.greedy:
        return argmax(logits, policy)
    logits = filtered_logits(logits, sampling)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


class SamplingRows(eqx.Module):
    """Each row's own `Sampling`, as arrays (a server's batch holds requests with different
    ones): row `b` samples as `Sampling(temperature[b], top_k[b], top_p[b])` would, greedy
    where `temperature[b] == 0`. Where a `Sampling` goes with one PRNG key for the batch, this
    goes with one key per row (`keys[b]`)."""

    temperature: Float[Array, " batch"]
    top_k: Int[Array, " batch"]
    top_p: Float[Array, " batch"]

    @property
    def greedy(self) -> bool:
        # Which rows are greedy is known only when the arrays are: never greedy as a whole
        # (a drafter keeps the distributions its drafts came from).
        return False

    def repeat(self, n: int) -> "SamplingRows":
        """Each row's sampling `n` times over, for `n` positions per row flattened."""
        return jax.tree.map(lambda a: jnp.repeat(a, n), self)


@typechecked
def filtered_rows(
    logits: Float[Array, "batch vocab"], rows: SamplingRows
) -> Float[Array, "batch vocab"]:
    """`filtered_logits` with each row's own sampling: row `b` equals `filtered_logits(logits[b],
    Sampling(temperature[b], top_k[b], top_p[b]))` where `temperature[b] > 0`; a greedy row's is
    unspecified."""
    temperature, top_k, top_p = rows.temperature, rows.top_k, rows.top_p
    scale = jnp.where(temperature > 0, temperature, 1.0)
    logits = logits.astype(jnp.float32) / scale[:, None]
    vocab = logits.shape[-1]

    def top_k_filter(logits):
        ranked = -jnp.sort(-logits, axis=-1)
        kth = jnp.take_along_axis(ranked, jnp.clip(top_k - 1, 0, vocab - 1)[:, None], axis=-1)
        kth = jnp.where(((top_k > 0) & (top_k < vocab))[:, None], kth, -jnp.inf)
        return jnp.where(logits < kth, -jnp.inf, logits)

    def top_p_filter(logits):
        order = jnp.argsort(-logits, axis=-1)
        sorted_probs = jax.nn.softmax(jnp.take_along_axis(logits, order, axis=-1), axis=-1)
        before = jnp.cumsum(sorted_probs, axis=-1) - sorted_probs
        # top_p == 1 keeps every token, as `filtered_logits` skips the filter (the mass before
        # the last tokens can round to 1).
        keep_sorted = (before < top_p[:, None]) | (top_p >= 1)[:, None]
        keep = jnp.put_along_axis(
            jnp.zeros_like(keep_sorted), order, keep_sorted, axis=-1, inplace=False
        )
        return jnp.where(keep, logits, -jnp.inf)

    # The sorts over the vocabulary only when a row asks for a filter.
    any_k = jnp.any((top_k > 0) & (top_k < vocab))
    logits = jax.lax.cond(any_k, top_k_filter, lambda x: x, logits)
    return jax.lax.cond(jnp.any(top_p < 1), top_p_filter, lambda x: x, logits)


@typechecked
def sample_rows(
    logits: Float[Array, "batch vocab"],
    keys: Key[Array, " batch"],
    rows: SamplingRows,
    *,
    policy: Policy | None = None,
) -> Int[Array, " batch"]:
    """One token per row, each row with its own sampling (`filtered_rows`) and its own PRNG
    key (`keys[b]`): greedy where `temperature[b] == 0`, as `sample` is."""
    return draw_rows(logits, keys, rows, policy=policy)[0]


@typechecked
def draw_rows(
    logits: Float[Array, "batch vocab"],
    keys: Key[Array, " batch"],
    rows: SamplingRows,
    *,
    policy: Policy | None = None,
) -> tuple[Int[Array, " batch"], Float[Array, "batch vocab"]]:
    """`sample_rows`'s tokens and the distribution each row's came from: a sampling row's
    filtered softmax, a greedy row's all on its token (so that the speculative rule, given
    those, accepts a greedy row's draft exactly when it is the target's greedy token)."""
    greedy = argmax(logits, policy)
    one_hot = jax.nn.one_hot(greedy, logits.shape[-1], dtype=jnp.float32)
    sampled = rows.temperature > 0

    def draw():
        filtered = filtered_rows(logits, rows)
        drawn = jax.vmap(jax.random.categorical)(keys, filtered).astype(jnp.int32)
        probs = jnp.where(sampled[:, None], jax.nn.softmax(filtered, axis=-1), one_hot)
        return jnp.where(sampled, drawn, greedy), probs

    # A batch of greedy rows draws nothing.
    return jax.lax.cond(jnp.any(sampled), draw, lambda: (greedy, one_hot))


@typechecked
def split_keys(key: PRNGKeyArray | Key[Array, " batch"], n: int) -> tuple[Array, ...]:
    """`jax.random.split(key, n)` for one key, or for each of a batch of keys (the `i`-th of
    the result then a batch too)."""
    if key.ndim == 0:
        return tuple(jax.random.split(key, n))
    return tuple(jnp.moveaxis(jax.vmap(lambda k: jax.random.split(k, n))(key), 1, 0))


def fold_in(key: PRNGKeyArray | Key[Array, " batch"], data: int) -> Array:
    """`jax.random.fold_in` for one key or for each of a batch of keys."""
    if key.ndim == 0:
        return jax.random.fold_in(key, data)
    return jax.vmap(jax.random.fold_in, (0, None))(key, data)


@typechecked
def accept_drafts(
    logits: Float[Array, "batch drafts_plus_one vocab"],
    drafts: Int[Array, "batch drafts"],
    draft_probs: Float[Array, "batch drafts vocab"] | None,
    key: PRNGKeyArray | Key[Array, " batch"],
    sampling: Sampling | SamplingRows,
    *,
    policy: Policy | None = None,
) -> tuple[Int[Array, " batch"], Int[Array, "batch drafts_plus_one"]]:
    """Speculative decoding's verdict on `drafts`, given the target model's logits at the
    position before each draft and after the last (`logits[:, i]` scores the token `drafts[:,
    i]` stands for).

    Greedy: a draft is accepted while it equals the target's greedy token. Otherwise draft `i`
    is accepted with probability `min(1, p_i(d) / q_i(d))`, `p_i` the target's distribution
    after `sampling`'s filters and `q_i = draft_probs[:, i]` the one the draft was drawn from;
    the first rejected one is replaced by a draw from `max(0, p_i - q_i)` (normalised), and if
    all are accepted one more token is drawn from the last `p`. The tokens so produced are
    distributed exactly as tokens drawn one by one from the target.

    With `SamplingRows` (and a key per row), row `b` is judged as a batch of that row alone
    with `Sampling(temperature[b], top_k[b], top_p[b])` and `keys[b]` would be; `draft_probs`
    are then required, a greedy row's all on its draft (as `draw_rows` gives them).

    **Returns:** `(accepted, tokens)`: per row the number of accepted drafts `a`, and the
    tokens produced, the first `a + 1` of `tokens[b]` (the accepted drafts, then the
    replacement or the extra token); the rest is unspecified.
    """
    b, n, v = logits.shape
    if isinstance(sampling, SamplingRows):
        if draft_probs is None or key.shape != (b,):
            raise ValueError("SamplingRows needs the drafts' distributions and a key per row")
        flat = logits.reshape(b * n, v)
        greedy = jax.nn.one_hot(argmax(flat, policy), v, dtype=jnp.float32)
        rows = sampling.repeat(n)
        sampled = (rows.temperature > 0)[:, None]
        p = jnp.where(sampled, jax.nn.softmax(filtered_rows(flat, rows), axis=-1), greedy)
        accepted, tokens = jax.vmap(lambda p, d, q, k: _verdict(p[None], d[None], q[None], k))(
            p.reshape(b, n, v), drafts, draft_probs, key
        )
        return accepted[:, 0], tokens[:, 0]
    if sampling.greedy:
        target = sample(logits.reshape(b * n, v), key, sampling, policy=policy).reshape(b, n)
        matches = drafts == target[:, :-1]
        accepted = jnp.sum(jnp.cumprod(matches, axis=1), axis=1).astype(jnp.int32)
        return accepted, target
    assert draft_probs is not None
    p = jax.nn.softmax(filtered_logits(logits, sampling), axis=-1)
    return _verdict(p, drafts, draft_probs, key)


def _verdict(p, drafts, draft_probs, key):
    # The sampling rule of `accept_drafts` given the target's distributions `p`.
    n = p.shape[1]
    u_key, r_key = jax.random.split(key)
    p_draft = jnp.take_along_axis(p[:, :-1], drafts[..., None], axis=-1)[..., 0]
    q_draft = jnp.take_along_axis(draft_probs, drafts[..., None], axis=-1)[..., 0]
    # u < p/q, as u q < p: no division, and a draft q gave no mass is rejected.
    u = jax.random.uniform(u_key, drafts.shape)
    accepted = jnp.sum(jnp.cumprod(u * q_draft < p_draft, axis=1), axis=1).astype(jnp.int32)
    # What replaces a rejected draft i: max(0, p_i - q_i); after the last draft: p.
    residual = jnp.maximum(p[:, :-1] - draft_probs, 0.0)
    # A rejection has probability 0 where the residual is all zero (p_i == q_i); any
    # distribution will do there.
    empty = jnp.sum(residual, axis=-1, keepdims=True) <= 0
    residual = jnp.where(empty, p[:, :-1], residual)
    weights = jnp.concatenate([residual, p[:, -1:]], axis=1)
    replace = jax.random.categorical(r_key, jnp.log(weights), axis=-1).astype(jnp.int32)
    tokens = jnp.concatenate([drafts, replace[:, -1:]], axis=1)
    at = jnp.arange(n)[None]
    tokens = jnp.where(at == accepted[:, None], replace, tokens)
    return accepted, tokens
