"""The training step: the optimizer, the train state (fresh, or abstract for compiling ahead
of time), and the jitted step with gradient accumulation and the router-bias update."""

import functools
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec

from .._typecheck import typechecked
from ..execution import Policy, with_policy
from ..nn import DeepseekV4
from ..parallel import committed
from ..quant import has_adapters
from ._dspark import DSparkObjective, dspark_step
from ._losses import (
    Batch,
    TrainState,
    _all_stats,
    loss_and_stats,
    trainable as default_trainable,
    update_router_bias,
)


@typechecked
def make_optimizer(
    learning_rate: float = 3e-4,
    *,
    warmup_steps: int = 100,
    total_steps: int = 10_000,
    final_fraction: float = 0.1,
    weight_decay: float = 0.1,
    clip_norm: float = 1.0,
    b1: float = 0.9,
    b2: float = 0.95,
) -> optax.GradientTransformation:
    """AdamW with linear warmup (step `i < warmup_steps` uses `(i + 1) / warmup_steps` of the
    peak) then cosine decay to `final_fraction * learning_rate` at `total_steps`, after
    clipping the gradients' global norm to `clip_norm`. Weight decay applies to matrices (and
    stacks of them) only, not to norms, biases, sinks or mHC scales."""
    if not 0 <= warmup_steps < total_steps:
        raise ValueError(f"need 0 <= warmup_steps < total_steps, got {warmup_steps}, {total_steps}")
    peak, final = float(learning_rate), float(learning_rate * final_fraction)

    def schedule(count):
        # Written out in float32 (optax's own mixes Python floats with the int32 count, which
        # strict dtype promotion rejects).
        t = jnp.asarray(count, jnp.float32)
        warm = peak * (t + 1.0) / float(max(warmup_steps, 1))
        progress = jnp.clip((t - warmup_steps) / float(total_steps - warmup_steps), 0.0, 1.0)
        decay = final + (peak - final) * 0.5 * (1.0 + jnp.cos(jnp.pi * progress))
        return jnp.where(t < warmup_steps, warm, decay)

    def decay_mask(params):
        return jax.tree.map(lambda p: p.ndim >= 2, params)

    return optax.chain(
        optax.clip_by_global_norm(clip_norm),
        optax.adamw(schedule, b1=b1, b2=b2, weight_decay=weight_decay, mask=decay_mask),
    )


@typechecked
def init_train_state(
    model: DeepseekV4,
    optimizer: optax.GradientTransformation,
    *,
    drafter_only: bool = False,
    trainable: Callable[[DeepseekV4], Any] | None = None,
) -> TrainState:
    """A fresh `TrainState` at step 0 (the optimizer state sharded like the parameters, and
    only for the trained leaves); `drafter_only`: for `make_train_step(dspark=...)` (the
    optimizer state of the drafter only); `trainable`: the filter of trained leaves, as given
    to `make_train_step` (default `train.trainable`: a model with adapters trains only them)."""
    choose = trainable or functools.partial(default_trainable, drafter_only=drafter_only)
    params = eqx.filter(model, choose(model))
    init = optimizer.init
    weight = model.embed.weight
    if isinstance(weight, jax.Array) and _mesh_of(model) is not None:  # arrays, not shapes
        # Created where `abstract_train_state` places them (the moments beside their
        # parameters): left to XLA, a state made of zeros lands whole on one device.
        placed = jax.tree.map(
            lambda x: (
                jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
                if eqx.is_array(x)
                else x
            ),
            model,
        )
        target = abstract_train_state(
            placed, optimizer, drafter_only=drafter_only, trainable=choose
        )
        shardings = jax.tree.map(lambda x: x.sharding, target.opt_state)

        def init(params: Any) -> Any:
            return eqx.filter_shard(optimizer.init(params), shardings)

    with jax.numpy_dtype_promotion("standard"):
        opt_state = eqx.filter_jit(init)(params)
    state = TrainState(model, opt_state, jnp.zeros((), jnp.int32))
    if isinstance(weight, jax.core.Tracer) or not isinstance(weight, jax.Array):
        return state  # traced or abstract: placement is the caller's
    # Every leaf committed to where it lives, as a restored state's are, so that a fresh state
    # and a restored one share one compiled step. (A model whose arrays a donating step has
    # consumed still serves as a template for `restore_train_state`.)
    step_sharding = weight.sharding
    if isinstance(step_sharding, NamedSharding):
        step_sharding = NamedSharding(step_sharding.mesh, PartitionSpec())
    state = eqx.tree_at(lambda s: s.step, state, jax.device_put(state.step, step_sharding))
    return committed(state)


def _is_placed_leaf(x: Any) -> bool:
    return eqx.is_array(x) or isinstance(x, jax.ShapeDtypeStruct)


def _mesh_of(tree: Any) -> jax.sharding.Mesh | None:
    # The mesh every array leaf of `tree` is placed on (arrays, or `ShapeDtypeStruct`s with
    # shardings, each a `NamedSharding` on that one mesh); `None` otherwise (one device,
    # several meshes, traced or unplaced leaves).
    leaves = jax.tree.leaves(eqx.filter(tree, _is_placed_leaf))
    if not leaves or any(isinstance(x, jax.core.Tracer) for x in leaves):
        return None
    meshes = {x.sharding.mesh if isinstance(x.sharding, NamedSharding) else None for x in leaves}
    return meshes.pop() if len(meshes) == 1 else None


def _placement(state: Any) -> Any:
    # The shardings of a state placed on one mesh (else `None`): its step's new state is
    # constrained to them, so that fed back it is the same argument to jit. Left to XLA, some
    # leaves come back placed (or their specs written) otherwise, and the next step compiles
    # again.
    if _mesh_of(state) is None:
        return None
    return jax.tree.map(lambda x: x.sharding, eqx.filter(state, _is_placed_leaf))


@typechecked
def abstract_train_state(
    model: DeepseekV4,
    optimizer: optax.GradientTransformation,
    *,
    drafter_only: bool = False,
    trainable: Callable[[DeepseekV4], Any] | None = None,
) -> TrainState:
    """The `TrainState` that `init_train_state(model, optimizer, drafter_only=...)` would give, as
    `jax.ShapeDtypeStruct`s, for a `model` of `ShapeDtypeStruct`s (`eqx.filter_eval_shape`,
    placed with `named_shardings`): nothing is allocated. Every copy of the parameters in the
    optimizer state (Adam's moments) takes the parameters' shardings, leaf by leaf, and the
    other leaves (step counts) are replicated on the parameters' mesh. For compiling a train
    step ahead of time (`TrainStep.lower`) or restoring one (`restore_train_state`).

    `jax.eval_shape` of `init_train_state` keeps no shardings, and compiling it leaves their
    choice to XLA's propagation, which may replicate the moments whole on every device."""

    def is_abstract(x: Any) -> bool:
        return isinstance(x, jax.ShapeDtypeStruct)

    choose = trainable or functools.partial(default_trainable, drafter_only=drafter_only)
    state = eqx.filter_eval_shape(
        lambda m: init_train_state(m, optimizer, drafter_only=drafter_only, trainable=choose),
        model,
    )
    spec = eqx.filter_eval_shape(choose, model)
    leaves = [x for x in jax.tree.leaves(model, is_leaf=is_abstract) if is_abstract(x)]
    meshes = {x.sharding.mesh for x in leaves if isinstance(x.sharding, NamedSharding)}
    if len(meshes) != 1 or len(leaves) != sum(x.sharding is not None for x in leaves):
        raise ValueError(
            "abstract_train_state needs a model of jax.ShapeDtypeStructs all placed on one mesh "
            "(eqx.filter_eval_shape, then named_shardings); got "
            f"{len(meshes)} meshes over {len(leaves)} leaves"
        )
    replicated = NamedSharding(meshes.pop(), PartitionSpec())
    params = eqx.filter(model, spec, is_leaf=is_abstract)
    structure = jax.tree.structure(params, is_leaf=is_abstract)

    def is_params(node: Any) -> bool:
        return jax.tree.structure(node, is_leaf=is_abstract) == structure

    def place(node: Any) -> Any:
        def with_sharding(x: Any, sharding: Any) -> jax.ShapeDtypeStruct:
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

        if is_params(node):
            return jax.tree.map(
                lambda x, p: with_sharding(x, p.sharding), node, params, is_leaf=is_abstract
            )
        return jax.tree.map(lambda x: with_sharding(x, replicated), node, is_leaf=is_abstract)

    opt_state = jax.tree.map(
        place, state.opt_state, is_leaf=lambda n: is_abstract(n) or is_params(n)
    )
    step = jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated)
    return eqx.tree_at(lambda s: (s.model, s.opt_state, s.step), state, (model, opt_state, step))


@typechecked
def make_train_step(
    optimizer: optax.GradientTransformation,
    *,
    mtp_weight: float = 0.3,
    balance_weight: float = 1e-4,
    bias_update_rate: float = 1e-3,
    remat: str | None = "dots",
    micro_batches: int = 1,
    dspark: DSparkObjective | None = None,
    trainable: Callable[[DeepseekV4], Any] | None = None,
    donate: bool = True,
) -> "TrainStep":
    """The jitted training step `step(state, batch) -> (state, metrics)`.

    **Arguments:**

    - `optimizer`: an optax transformation (e.g. `make_optimizer(...)`), applied to the
      `trainable` leaves.
    - `mtp_weight`: weight of the MTP loss (ignored if the model has no MTP block).
    - `balance_weight`: weight of the sequence-wise balance loss.
    - `bias_update_rate`: step of the auxiliary-loss-free router-bias update (0 disables it).
    - `remat`: rematerialisation policy per layer (`REMAT_POLICIES`), or `None`.
    - `micro_batches`: gradient accumulation. The batch's sequences are split into this many
      equal micro-batches, run one after another (activations of one micro-batch alive at a
      time), and their gradients summed into those of the whole batch: the losses are
      weighted by each micro-batch's share of the batch's counted tokens (the balance loss by
      its share of sequences) and the expert loads are summed, so the step equals the
      one-pass step up to summation order. Each device's rows must split evenly: micro-batch
      `i` takes every `micro_batches`-th sequence starting at `i`, so a batch sharded over
      devices keeps each micro-batch spread over all of them. Gradients accumulate in the
      parameters' dtype.
    - `dspark`: train the DSpark drafter of a frozen trunk instead (`DSparkObjective`,
      `dspark_loss`), from a state of `init_train_state(model, optimizer, drafter_only=True)`.
      The trunk runs forward only, so `mtp_weight`, `balance_weight`, `bias_update_rate` and
      `remat` do not apply; `micro_batches` must be 1. Its `metrics` hold `loss`, `ce`, `tv`,
      `confidence`, `accept` and `grad_norm`.
    - `trainable`: `model -> PyTree[bool]`, the leaves to train (default `train.trainable`:
      every float weight but the quantised ones; a model with adapters, `equinox_dsv4.lora`,
      only its adapters, and then its router biases are not updated either: the base stays
      as loaded). The state must come from `init_train_state` with the same filter.
    - `donate`: donate the incoming state's buffers (the caller must not reuse it).

    **Returns:** the step function. `metrics` holds `loss`, `lm`, `mtp`, `balance`, `tokens`,
    `grad_norm` and the per-layer expert `load` of the step (float32).
    """

    if micro_batches < 1:
        raise ValueError(f"micro_batches must be >= 1, got {micro_batches}")
    if dspark is not None:
        if micro_batches != 1:
            raise ValueError(
                f"make_train_step(dspark=...) takes micro_batches=1, got {micro_batches}"
            )
        return TrainStep(dspark_step(optimizer, dspark), donate)

    choose = trainable or default_trainable

    def step(batch: Batch, state: TrainState, policy: Policy):
        params, frozen = eqx.partition(state.model, choose(state.model))

        def objective(params, batch, weights):
            # The policy set across the model inside the trace only: the state returned keeps
            # the structure it came with, so the next call reuses this program.
            loss, aux = loss_and_stats(
                with_policy(eqx.combine(params, frozen), policy),
                batch,
                mtp_weight=mtp_weight,
                balance_weight=balance_weight,
                remat=remat,
            )
            if weights is None:
                return loss, aux
            # This micro-batch's part of the whole batch's objective.
            lm, mtp, balance = weights
            zero = jnp.zeros((), jnp.float32)
            aux = {
                "lm": aux["lm"] * aux["tokens"] / lm,
                "mtp": aux.get("mtp", zero) * aux.get("mtp_tokens", zero) / mtp,
                "balance": aux.get("balance", zero) * balance,
                "tokens": aux["tokens"],
                "stats": aux["stats"],
                "mtp_stats": aux["mtp_stats"],
            }
            return aux["lm"] + mtp_weight * aux["mtp"] + balance_weight * aux["balance"], aux

        gradient = jax.value_and_grad(objective, has_aux=True)
        if micro_batches == 1:
            (loss, aux), grads = gradient(params, batch, None)
        else:
            (loss, aux), grads = _accumulated(gradient, params, batch, micro_batches)

        # optax mixes Python scalars with int32 counters, which strict promotion rejects.
        with jax.numpy_dtype_promotion("standard"):
            updates, opt_state = optimizer.update(grads, state.opt_state, params)
        model = eqx.combine(eqx.apply_updates(params, updates), frozen)
        if bias_update_rate and not has_adapters(model):
            model = update_router_bias(model, aux["stats"], bias_update_rate, aux["mtp_stats"])
        zero = jnp.zeros((), jnp.float32)
        metrics = {
            "loss": loss,
            "lm": aux["lm"],
            "mtp": aux.get("mtp", zero),
            "balance": aux.get("balance", zero),
            "tokens": aux["tokens"],
            # In float32: bf16 and float32 gradients (norms, mHC, sinks) do not mix implicitly.
            "grad_norm": optax.tree.norm(jax.tree.map(lambda g: g.astype(jnp.float32), grads)),
            "load": [s.load for _, s in _all_stats(model, aux["stats"])],
        }
        return TrainState(model, opt_state, state.step + 1), metrics

    return TrainStep(step, donate)


def _accumulated(gradient, params, batch: Batch, k: int):
    # `gradient(params, micro_batch, weights)` summed over `k` micro-batches in a scan.
    rows = batch.input_ids.shape[0]
    if rows % k:
        raise ValueError(f"a batch of {rows} sequences does not split into {k} micro-batches")
    micro = jax.tree.map(lambda a: jnp.swapaxes(a.reshape(rows // k, k, *a.shape[1:]), 0, 1), batch)
    # The whole batch's normalisers: counted positions of the LM and MTP losses (as
    # `loss_and_stats` masks them), and micro-batches for the per-sequence balance mean.
    mtp_mask = batch.loss_mask * jnp.roll(batch.loss_mask, -1, axis=1)
    weights = (
        jnp.maximum(jnp.sum(batch.loss_mask), 1.0),
        jnp.maximum(jnp.sum(mtp_mask[:, :-1]), 1.0),
        jnp.float32(1.0 / k),
    )

    def one(i):
        return gradient(params, jax.tree.map(lambda a: a[i], micro), weights)

    def body(total, i):
        return jax.tree.map(jnp.add, total, one(i)), None

    shapes = jax.eval_shape(one, 0)
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
    return jax.lax.scan(body, zeros, jnp.arange(k))[0]


class TrainStep:
    """`step(state, batch) -> (state, metrics)`, jitted; `step.lower(state, batch)` gives the
    lowered program (for `.compile().memory_analysis()`), from arrays or from
    `jax.ShapeDtypeStruct`s (e.g. `eqx.filter_eval_shape` of a full-size state, with shardings
    on a mesh of another platform's devices). The execution `Policy` is the model's own, or
    the one for the platform of the state's arrays (or of the context mesh)."""

    def __init__(self, step: Callable[[Batch, TrainState, Policy], Any], donate: bool):
        # The batch goes first so that "all-except-first" donates exactly the state.
        self._donate = donate

        def placed_step(batch: Batch, state: TrainState, policy: Policy, placement: Any) -> Any:
            new, metrics = step(batch, state, policy)
            if placement is not None:
                new = eqx.filter_shard(new, placement)
            return new, metrics

        self._placed_step = placed_step
        self._jitted = eqx.filter_jit(placed_step, donate="all-except-first" if donate else "none")

    def __call__(self, state: TrainState, batch: Batch) -> tuple[TrainState, dict[str, Any]]:
        return self._jitted(batch, state, state.model.resolved_policy(), _placement(state))

    def lower(self, state: TrainState, batch: Batch) -> jax.stages.Lowered:
        (dynamic_batch, dynamic_state), static = eqx.partition((batch, state), _is_placed_leaf)
        policy = state.model.resolved_policy()
        placement = _placement(state)

        def step(dynamic_batch: Any, dynamic_state: Any) -> Any:
            batch, state = eqx.combine((dynamic_batch, dynamic_state), static)
            return self._placed_step(batch, state, policy, placement)  # the program a call runs

        donate = (1,) if self._donate else ()
        return jax.jit(step, donate_argnums=donate).lower(dynamic_batch, dynamic_state)
