"""Training a DSpark drafter on a frozen trunk.

At random anchors of each sequence the drafter runs a block as it would when drafting there
(`nn.DSpark.train_outputs`: the trunk's context before the anchor, the anchor then noise
slots, the Markov head fed the true tokens), and its outputs are scored against the text and
the trunk, per slot `j` (from 0) weighted by `exp(-j / decay)` (the later slots of a block
matter less, as their drafts are verified only if all before them survive):

- `ce`: cross-entropy of the corrected logits against the true next token;
- `tv`: `|p_d - p_t|_1`, the drafter's distribution against the trunk's at the same position
  (the L1 norm; half of it is the total variation, whose complement is the chance that one
  draw from each agrees);
- `confidence`: binary cross-entropy of the confidence logit against `1 - |p_d - p_t|_1 / 2`
  (held constant), the chance the draft would survive verification;

`loss = 0.1 ce + 0.9 tv + 1.0 confidence` (DeepSeek's DSpark recipe: DeepSpec's
`dspark/loss.py`, `loss_decay_gamma` 4).
"""

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jaxtyping import Array, Float, Int

from .._typecheck import typechecked
from ..execution import Policy, with_policy
from ..nn import DeepseekV4
from ._losses import Batch, TrainState, trainable


WEIGHTS = (0.1, 0.9, 1.0)  # ce, tv, confidence


@typechecked
def dspark_loss(
    model: DeepseekV4,
    batch: Batch,
    anchors: Int[Array, "batch anchors"],
    *,
    decay: float = 4.0,
    weights: tuple[float, float, float] = WEIGHTS,
) -> tuple[Float[Array, ""], dict[str, Float[Array, ""]]]:
    """The drafter's objective at `anchors` (positions of `batch.input_ids`), traced where it
    is called. **Returns:** `(loss, terms)`, `terms` holding `ce`, `tv`, `confidence` and
    `accept` (the mean of `1 - tv / 2`: the drafts' estimated survival)."""
    dspark = model.dspark
    if dspark is None:
        raise ValueError("the model has no DSpark drafter to train")
    ids = batch.input_ids
    b, t = ids.shape
    cache = model.init_cache(b, t)
    x, _, _, taps = model.step(ids, cache, jnp.full((b,), t, jnp.int32), taps=dspark.targets)
    taps, x = jax.lax.stop_gradient((taps, x))
    z, c = dspark.train_outputs(taps, ids, anchors, model.embed, model.head)
    q = dspark.block_size
    at = anchors[..., None] + jnp.arange(q, dtype=jnp.int32)[None, None]  # [b, n, q]: slots
    inside = at < t
    at = jnp.clip(at, 0, t - 1).reshape(b, -1)

    def rows(a):  # [b, t, ...] at each slot's position
        return jnp.take_along_axis(a, at.reshape(*at.shape, *(1,) * (a.ndim - 2)), axis=1)

    trunk = jax.lax.stop_gradient(model.logits(rows(x))).reshape(z.shape)
    labels = rows(batch.labels).reshape(z.shape[:-1])
    mask = rows(batch.loss_mask).reshape(z.shape[:-1]) * inside.astype(jnp.float32)
    w = mask * jnp.exp(-jnp.arange(q, dtype=jnp.float32) / decay)[None, None]
    total = jnp.maximum(jnp.sum(w), 1e-6)

    ce = jax.nn.logsumexp(z, axis=-1) - jnp.take_along_axis(z, labels[..., None], -1)[..., 0]
    l1 = jnp.sum(jnp.abs(jax.nn.softmax(z, axis=-1) - jax.nn.softmax(trunk, axis=-1)), axis=-1)
    target = jax.lax.stop_gradient(jnp.clip(1 - l1 / 2, 0.0, 1.0))
    bce = optax.sigmoid_binary_cross_entropy(c, target)
    terms = {
        "ce": jnp.sum(w * ce) / total,
        "tv": jnp.sum(w * l1) / total,
        "confidence": jnp.sum(w * bce) / total,
    }
    loss = sum(k * terms[name] for k, name in zip(weights, ("ce", "tv", "confidence"), strict=True))
    terms["accept"] = jnp.sum(mask * target) / jnp.maximum(jnp.sum(mask), 1.0)
    return loss, terms


@dataclasses.dataclass(frozen=True)
class DSparkObjective:
    """`make_train_step(optimizer, dspark=DSparkObjective(...))`: the step trains the DSpark
    drafter of a frozen trunk (`dspark_loss`) instead of the model.

    **Fields:**

    - `anchors`: blocks per sequence and step, at positions drawn anew each step (from `seed`
      and the step number).
    - `decay`, `weights`: see `dspark_loss`.
    - `seed`: of the anchors' positions.
    """

    anchors: int = 16
    decay: float = 4.0
    weights: tuple[float, float, float] = WEIGHTS
    seed: int = 0

    def __post_init__(self):
        if self.anchors < 1:
            raise ValueError(f"DSparkObjective.anchors must be >= 1, got {self.anchors}")
        if self.decay <= 0:
            raise ValueError(f"DSparkObjective.decay must be > 0, got {self.decay}")


def dspark_step(optimizer: optax.GradientTransformation, objective: DSparkObjective):
    """The unjitted `step(batch, state, policy) -> (state, metrics)` of `make_train_step`
    with `dspark=objective`; `metrics` holds `loss`, `ce`, `tv`, `confidence`, `accept` and
    `grad_norm`."""

    def step(batch: Batch, state: TrainState, policy: Policy):
        if state.model.dspark is None:
            raise ValueError("make_train_step(dspark=...) needs a model with a DSpark drafter")
        params, frozen = eqx.partition(state.model, trainable(state.model, drafter_only=True))
        b, t = batch.input_ids.shape
        key = jax.random.fold_in(jax.random.key(objective.seed), state.step)
        at = jax.random.randint(key, (b, objective.anchors), 0, t, jnp.int32)

        def loss(params):
            model = with_policy(eqx.combine(params, frozen), policy)
            return dspark_loss(model, batch, at, decay=objective.decay, weights=objective.weights)

        (value, terms), grads = jax.value_and_grad(loss, has_aux=True)(params)
        with jax.numpy_dtype_promotion("standard"):
            updates, opt_state = optimizer.update(grads, state.opt_state, params)
        model = eqx.combine(eqx.apply_updates(params, updates), frozen)
        grads32 = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
        metrics = {"loss": value, **terms, "grad_norm": optax.tree.norm(grads32)}
        return TrainState(model, opt_state, state.step + 1), metrics

    return step
