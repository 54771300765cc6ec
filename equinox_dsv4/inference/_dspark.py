"""The DSpark drafter in the generation driver (`generate(..., speculative="dspark")`): a block
of `dspark_block_size` drafts per step from the model's DSpark stages (`nn.DSpark`), verified
by one main-model call of `block + 1` tokens as a chain (the longest acceptable prefix, then
one token of the main model's own).

The stages read the main model's context only through their rings, one row per verified
position. A step's main-model call covers the pending token and the drafts; only the rows of
the positions it verifies are written (the ring's positions then advance by that many), so a
rejected draft never reaches a ring and nothing is taken back. The rows of the prompt are
written during the prefill.
"""

from collections.abc import Callable

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, Key, PRNGKeyArray

from ..nn import DeepseekV4, KVCache
from ._drafting import AbstractDrafter, _rows, draw
from ._sampling import Sampling, SamplingRows


class DSparkState(eqx.Module):
    """The DSpark drafter's state: the block of drafts (for the positions after the pending
    token), the distributions they were drawn from (sampling only), their confidences, and the
    stages' rings."""

    tokens: Int[Array, "batch block"]
    probs: Float[Array, "batch block vocab"] | None
    confidence: Float[Array, "batch block"]
    rings: KVCache


class DSparkDrafter(AbstractDrafter):
    """Drafts a block of tokens per step with the model's DSpark stages (see the module
    docstring)."""

    def depth(self, model: DeepseekV4) -> int:
        return _dspark(model).block_size

    def taps(self, model: DeepseekV4) -> tuple[int, ...]:
        return _dspark(model).targets

    def init(
        self,
        model: DeepseekV4,
        batch: int,
        max_len: int,
        sampling: Sampling | SamplingRows,
        place: Callable[[KVCache], KVCache],
    ) -> DSparkState:
        dspark = _dspark(model)
        n, vocab = dspark.block_size, model.config.vocab_size
        return DSparkState(
            tokens=jnp.zeros((batch, n), jnp.int32),
            probs=None if sampling.greedy else jnp.zeros((batch, n, vocab), jnp.float32),
            confidence=jnp.zeros((batch, n), jnp.float32),
            rings=place(dspark.init_cache(batch, max_len, model.embed.weight.dtype)),
        )

    def prefill(
        self,
        model: DeepseekV4,
        streams: Float[Array, "batch chunk streams d_model"],
        taps: Float[Array, "batch chunk taps d_model"],
        ahead: Int[Array, "batch chunk_plus_depth"],
        remaining: Int[Array, " batch"],
        state: DSparkState,
    ) -> DSparkState:
        count = jnp.clip(remaining, 0, taps.shape[1])
        rings = _dspark(model).extend(taps, state.rings, count)
        return eqx.tree_at(lambda s: s.rings, state, rings)

    def draft(
        self,
        model: DeepseekV4,
        streams: Float[Array, "batch rows streams d_model"],
        taps: Float[Array, "batch rows taps d_model"] | None,
        verified: Int[Array, " batch"],
        ahead: Int[Array, "batch rows"],
        state: DSparkState,
        key: PRNGKeyArray | Key[Array, " batch"],
        sampling: Sampling | SamplingRows,
    ) -> DSparkState:
        dspark = _dspark(model)
        rings = state.rings
        if taps is not None:  # the verified positions' rows (the prompt's came with `prefill`)
            rings = dspark.extend(taps, rings, verified)
        # The anchor: the last verified position's next token, the step's pending token.
        anchor = _rows(ahead, jnp.maximum(verified - 1, 0)[:, None])[:, 0]
        probs = []

        def choose(logits, slot):
            token, q = draw(logits, key, slot, sampling, model)
            probs.append(q)
            return token

        block = dspark.draft(anchor, rings, model.embed, model.head, choose)
        # An idle row (nothing verified) keeps its drafts for when it runs again.
        busy = verified > 0

        def keep(new, old):
            return jnp.where(busy.reshape(-1, *(1,) * (new.ndim - 1)), new, old)

        return DSparkState(
            tokens=keep(block.tokens, state.tokens),
            probs=None if state.probs is None else keep(jnp.stack(probs, axis=1), state.probs),
            confidence=keep(block.confidence, state.confidence),
            rings=rings,
        )

    def drafts(
        self, state: DSparkState
    ) -> tuple[Int[Array, "batch depth"], Float[Array, "batch depth vocab"] | None]:
        return state.tokens, state.probs

    def confidence(self, state: DSparkState) -> Float[Array, "batch depth"]:
        return state.confidence


def _dspark(model: DeepseekV4):
    if model.dspark is None:
        raise ValueError(
            "this model has no DSpark drafter (its config has no dspark_* fields, or it was "
            "loaded with load_mtp=False)"
        )
    return model.dspark
