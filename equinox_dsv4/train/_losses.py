"""Training: the losses, DeepSeek-V3/V4 load balancing, the optimizer and the jitted step.

One step: the causal forward (optionally rematerialised per layer), next-token cross-entropy
under a loss mask, the MTP loss (position `t` predicts token `t + 2`), the sequence-wise
balance loss of the learned-routing layers; gradients with respect to the trainable leaves only;
an optax update; then the auxiliary-loss-free update of each learned router's selection bias
from the step's expert load (`bias += rate * sign(mean_load - load)`, DeepSeek-V3 §2.1.2),
which no gradient touches.

Frozen leaves: the routers' `bias` (updated by the rule above), the hash layers' `tid2eid`
(integer) and everything that is not a floating-point array. RoPE tables are not leaves (they
are computed from static config values).
"""

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int, PyTree, Shaped

from .._typecheck import typechecked
from ..nn import Block, DeepseekV4, RouterStats, Stats
from ..quant import LoraWeight, QuantizedWeight, has_adapters, is_weight


class Batch(eqx.Module):
    """One training batch.

    - `input_ids`: int32 `[batch, seq]`.
    - `labels`: int32 `[batch, seq]`, the token that follows each input token.
    - `loss_mask`: `[batch, seq]`, 1 where the label counts (0 for padding, prompts, ...).
    """

    input_ids: Int[Array, "batch seq"]
    labels: Int[Array, "batch seq"]
    loss_mask: Float[Array, "batch seq"]

    @classmethod
    def from_tokens(
        cls,
        tokens: Int[Array | np.ndarray, "batch seq_plus_one"],
        mask: Shaped[Array | np.ndarray, "batch seq_plus_one"] | None = None,
    ) -> "Batch":
        """A batch from `[batch, seq + 1]` token rows: inputs are `tokens[:, :-1]`, labels
        `tokens[:, 1:]`; `mask` (`[batch, seq + 1]`, default all ones) marks real tokens, and a
        label counts when it and its input are both real."""
        tokens = jnp.asarray(tokens, jnp.int32)
        if tokens.ndim != 2 or tokens.shape[1] < 2:
            raise ValueError(f"tokens must be [batch, seq + 1] with seq >= 1, got {tokens.shape}")
        m = jnp.ones(tokens.shape, jnp.float32) if mask is None else jnp.asarray(mask, jnp.float32)
        if m.shape != tokens.shape:
            raise ValueError(f"mask shape {m.shape} != tokens shape {tokens.shape}")
        return cls(tokens[:, :-1], tokens[:, 1:], m[:, :-1] * m[:, 1:])


class TrainState(eqx.Module):
    """Everything a training run carries from step to step."""

    model: DeepseekV4
    opt_state: PyTree
    step: Int[Array, ""]


@typechecked
def trainable(model: DeepseekV4, *, drafter_only: bool = False) -> PyTree[bool]:
    """The filter of the leaves the optimizer trains: every floating-point array except the
    routers' selection biases and the release's quantised weights (`QuantizedWeight` values
    and scales stay frozen: a model loaded with `quantized=True` fine-tunes its dense
    leaves). A model with adapters (`equinox_dsv4.lora`) trains its adapters' factors and
    nothing else. A DSpark drafter's leaves are trained only with `drafter_only`, and then
    only they (a frozen trunk): the main model's losses do not read them, and weight decay
    would shrink them."""
    adapted = has_adapters(model)

    def visit(path, leaf):
        key = jax.tree_util.keystr(path)
        drafter = key.startswith(".dspark")
        if isinstance(leaf, LoraWeight):
            train = drafter == drafter_only
            return LoraWeight(jax.tree.map(lambda _: False, leaf.base), train, train, leaf.scale)
        if isinstance(leaf, QuantizedWeight) or adapted:
            return jax.tree.map(lambda _: False, leaf)
        frozen = key.endswith(".ffn.gate.bias") or drafter != drafter_only
        return eqx.is_inexact_array(leaf) and not frozen

    return jax.tree_util.tree_map_with_path(visit, model, is_leaf=is_weight)


@typechecked
def cross_entropy(
    logits: Float[Array, "batch seq vocab"],
    labels: Int[Array, "batch seq"],
    mask: Float[Array, "batch seq"],
) -> tuple[Float[Array, ""], Float[Array, ""]]:
    """Mean next-token cross-entropy (nats) over the positions where `mask` is 1, in float32.

    **Returns:** `(mean loss, number of counted positions)`.
    """
    logits = logits.astype(jnp.float32)
    nll = jax.nn.logsumexp(logits, axis=-1) - jnp.take_along_axis(
        logits, labels[..., None], axis=-1
    ).squeeze(-1)
    mask = mask.astype(jnp.float32)
    count = jnp.sum(mask)
    return jnp.sum(nll * mask) / jnp.maximum(count, 1.0), count


def _all_stats(model: DeepseekV4, stats: Stats) -> list[tuple[Any, RouterStats]]:
    """(gate, stats) of every period position of every segment, stacked along its repeats."""
    return [
        (b.ffn.gate, st)
        for layer, s in zip(model.layers, stats, strict=True)
        for b, st in zip(layer.blocks, s, strict=True)
    ]


@typechecked
def balance_loss(model: DeepseekV4, stats: Stats) -> Float[Array, ""]:
    """The sequence-wise balance losses of the learned-routing layers, summed over layers."""
    return sum(
        (jnp.sum(s.balance) for g, s in _all_stats(model, stats) if g.bias is not None),
        start=jnp.zeros((), jnp.float32),
    )


@typechecked
def update_router_bias(
    model: DeepseekV4, stats: Stats, rate: float, mtp_stats: RouterStats | None = None
) -> DeepseekV4:
    """The auxiliary-loss-free balancing step: each learned router's bias moves by `rate`
    towards its under-loaded experts, `bias += rate * sign(mean(load) - load)`."""

    def new_bias(bias, load):
        target = jnp.mean(load, axis=-1, keepdims=True)
        return (bias + rate * jnp.sign(target - load)).astype(bias.dtype)

    def block(b: Block, s: RouterStats) -> Block:
        if b.ffn.gate.bias is None:
            return b
        return eqx.tree_at(lambda b: b.ffn.gate.bias, b, new_bias(b.ffn.gate.bias, s.load))

    layers = tuple(
        eqx.tree_at(
            lambda stack: stack.blocks,
            layer,
            tuple(block(b, st) for b, st in zip(layer.blocks, s, strict=True)),
        )
        for layer, s in zip(model.layers, stats, strict=True)
    )
    model = eqx.tree_at(lambda m: m.layers, model, layers)
    if mtp_stats is not None and model.mtp:
        first = eqx.tree_at(lambda m: m.block, model.mtp[0], block(model.mtp[0].block, mtp_stats))
        model = eqx.tree_at(lambda m: m.mtp, model, (first, *model.mtp[1:]))
    return model


@typechecked
def loss_and_stats(
    model: DeepseekV4,
    batch: Batch,
    *,
    mtp_weight: float = 0.0,
    balance_weight: float = 0.0,
    remat: str | None = None,
) -> tuple[Float[Array, ""], dict[str, Any]]:
    """The training objective `lm + mtp_weight * mtp + balance_weight * balance`, traced where
    it is called (a train step), in the model's execution policy.

    **Returns:** `(loss, aux)` with `aux` holding the separate terms (`lm`, `mtp`, `balance`),
    `tokens` (counted positions) and the routing statistics (`stats`, `mtp_stats`).
    """
    streams, stats = model.forward(batch.input_ids, remat=remat)
    logits = model.logits(streams)
    lm, tokens = cross_entropy(logits, batch.labels, batch.loss_mask)
    loss = lm
    aux: dict[str, Any] = {"lm": lm, "tokens": tokens, "stats": stats, "mtp_stats": None}
    if mtp_weight and model.mtp:
        # Position t sees token t + 1 (its label) and predicts token t + 2 (the next label);
        # the last position has no such target.
        h, _, mtp_stats = model.mtp[0].with_stats(streams, batch.labels, model.embed)
        targets = jnp.roll(batch.labels, -1, axis=1)
        mask = batch.loss_mask * jnp.roll(batch.loss_mask, -1, axis=1)
        mask = mask.at[:, -1].set(0.0)
        mtp, _ = cross_entropy(model.head(h, dtype=jnp.float32), targets, mask)
        loss = loss + mtp_weight * mtp
        aux["mtp"], aux["mtp_stats"] = mtp, mtp_stats
        aux["mtp_tokens"] = jnp.sum(mask)
    if balance_weight:
        balance = balance_loss(model, stats)
        loss = loss + balance_weight * balance
        aux["balance"] = balance
    return loss, aux
