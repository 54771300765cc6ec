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

import json
import os
import pathlib
import shutil
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec
from jaxtyping import Array, Float, Int, PyTree, Shaped

from ._block import Block
from ._distributed import barrier, is_primary, shared_token
from ._model import DeepseekV4, Stats
from ._moe import RouterStats
from ._parallel import committed
from ._policy import Policy, resolve
from ._quant import QuantizedWeight


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


def trainable(model: DeepseekV4) -> PyTree[bool]:
    """The filter of the leaves the optimizer trains: every floating-point array except the
    routers' selection biases and the release's quantised weights (`QuantizedWeight` values
    and scales stay frozen: a model loaded with `quantized=True` fine-tunes its dense
    leaves)."""

    def visit(path, leaf):
        if isinstance(leaf, QuantizedWeight):
            return jax.tree.map(lambda _: False, leaf)
        frozen = jax.tree_util.keystr(path).endswith(".ffn.gate.bias")
        return eqx.is_inexact_array(leaf) and not frozen

    return jax.tree_util.tree_map_with_path(
        visit, model, is_leaf=lambda x: isinstance(x, QuantizedWeight)
    )


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


def balance_loss(model: DeepseekV4, stats: Stats) -> Float[Array, ""]:
    """The sequence-wise balance losses of the learned-routing layers, summed over layers."""
    return sum(
        (jnp.sum(s.balance) for g, s in _all_stats(model, stats) if g.bias is not None),
        start=jnp.zeros((), jnp.float32),
    )


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


def loss_and_stats(
    model: DeepseekV4,
    batch: Batch,
    *,
    mtp_weight: float = 0.0,
    balance_weight: float = 0.0,
    remat: str | None = None,
    policy: Policy | None = None,
) -> tuple[Float[Array, ""], dict[str, Any]]:
    """The training objective `lm + mtp_weight * mtp + balance_weight * balance`, laid out by
    `policy` (default: the one for the model's platform).

    **Returns:** `(loss, aux)` with `aux` holding the separate terms (`lm`, `mtp`, `balance`),
    `tokens` (counted positions) and the routing statistics (`stats`, `mtp_stats`).
    """
    policy = resolve(policy, model.embed.weight)
    streams, stats = model.forward(batch.input_ids, remat=remat, policy=policy)
    logits = model.logits(streams, policy=policy)
    lm, tokens = cross_entropy(logits, batch.labels, batch.loss_mask)
    loss = lm
    aux: dict[str, Any] = {"lm": lm, "tokens": tokens, "stats": stats, "mtp_stats": None}
    if mtp_weight and model.mtp:
        # Position t sees token t + 1 (its label) and predicts token t + 2 (the next label);
        # the last position has no such target.
        h, _, mtp_stats = model.mtp[0].with_stats(streams, batch.labels, model.embed, policy=policy)
        targets = jnp.roll(batch.labels, -1, axis=1)
        mask = batch.loss_mask * jnp.roll(batch.loss_mask, -1, axis=1)
        mask = mask.at[:, -1].set(0.0)
        mtp, _ = cross_entropy(model.head(h, dtype=jnp.float32, policy=policy), targets, mask)
        loss = loss + mtp_weight * mtp
        aux["mtp"], aux["mtp_stats"] = mtp, mtp_stats
        aux["mtp_tokens"] = jnp.sum(mask)
    if balance_weight:
        balance = balance_loss(model, stats)
        loss = loss + balance_weight * balance
        aux["balance"] = balance
    return loss, aux


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


def init_train_state(model: DeepseekV4, optimizer: optax.GradientTransformation) -> TrainState:
    """A fresh `TrainState` at step 0 (the optimizer state sharded like the parameters)."""
    params = eqx.filter(model, trainable(model))
    with jax.numpy_dtype_promotion("standard"):
        opt_state = eqx.filter_jit(optimizer.init)(params)
    state = TrainState(model, opt_state, jnp.zeros((), jnp.int32))
    weight = model.embed.weight
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


def abstract_train_state(model: DeepseekV4, optimizer: optax.GradientTransformation) -> TrainState:
    """The `TrainState` that `init_train_state(model, optimizer)` would give, as
    `jax.ShapeDtypeStruct`s, for a `model` of `ShapeDtypeStruct`s (`eqx.filter_eval_shape`,
    placed with `named_shardings`): nothing is allocated. Every copy of the parameters in the
    optimizer state (Adam's moments) takes the parameters' shardings, leaf by leaf, and the
    other leaves (step counts) are replicated on the parameters' mesh. For compiling a train
    step ahead of time (`TrainStep.lower`) or restoring one (`restore_train_state`).

    `jax.eval_shape` of `init_train_state` keeps no shardings, and compiling it leaves their
    choice to XLA's propagation, which may replicate the moments whole on every device."""

    def is_abstract(x: Any) -> bool:
        return isinstance(x, jax.ShapeDtypeStruct)

    state = eqx.filter_eval_shape(init_train_state, model, optimizer)
    spec = eqx.filter_eval_shape(trainable, model)
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


def make_train_step(
    optimizer: optax.GradientTransformation,
    *,
    mtp_weight: float = 0.3,
    balance_weight: float = 1e-4,
    bias_update_rate: float = 1e-3,
    remat: str | None = "dots",
    micro_batches: int = 1,
    donate: bool = True,
    policy: Policy | None = None,
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
    - `donate`: donate the incoming state's buffers (the caller must not reuse it).
    - `policy`: the execution `Policy` (default: decided per call from the state's platform).

    **Returns:** the step function. `metrics` holds `loss`, `lm`, `mtp`, `balance`, `tokens`,
    `grad_norm` and the per-layer expert `load` of the step (float32).
    """

    if micro_batches < 1:
        raise ValueError(f"micro_batches must be >= 1, got {micro_batches}")

    def step(batch: Batch, state: TrainState, policy: Policy):
        spec = trainable(state.model)
        params, frozen = eqx.partition(state.model, spec)

        def objective(params, batch, weights):
            loss, aux = loss_and_stats(
                eqx.combine(params, frozen),
                batch,
                mtp_weight=mtp_weight,
                balance_weight=balance_weight,
                remat=remat,
                policy=policy,
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
        if bias_update_rate:
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

    return TrainStep(step, donate, policy)


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
    on a mesh of another platform's devices). The execution `Policy` is the one for the
    platform of the state's arrays (or of the context mesh), unless `policy` is given."""

    def __init__(
        self,
        step: Callable[[Batch, TrainState, Policy], Any],
        donate: bool,
        policy: Policy | None = None,
    ):
        # The batch goes first so that "all-except-first" donates exactly the state.
        self._step, self._donate, self._policy = step, donate, policy
        self._jitted = eqx.filter_jit(step, donate="all-except-first" if donate else "none")

    def __call__(self, state: TrainState, batch: Batch) -> tuple[TrainState, dict[str, Any]]:
        return self._jitted(batch, state, resolve(self._policy, state.model.embed.weight))

    def lower(self, state: TrainState, batch: Batch) -> jax.stages.Lowered:
        def is_leaf(x: Any) -> bool:
            return eqx.is_array(x) or isinstance(x, jax.ShapeDtypeStruct)

        (dynamic_batch, dynamic_state), static = eqx.partition((batch, state), is_leaf)
        policy = resolve(self._policy, state.model.embed.weight)

        def step(dynamic_batch: Any, dynamic_state: Any) -> Any:
            return self._step(*eqx.combine((dynamic_batch, dynamic_state), static), policy)

        donate = (1,) if self._donate else ()
        return jax.jit(step, donate_argnums=donate).lower(dynamic_batch, dynamic_state)


_STATE_FORMAT = 1


def save_train_state(path: str | os.PathLike, state: TrainState, *, data_position: int = 0) -> None:
    """Saves `state` (parameters, optimizer state, step) and the data position to directory
    `path` with orbax. Written to a temporary sibling and renamed into place, so `path` is
    either the previous complete save or the new one, never a partial one.

    **Arguments:** `path`, the directory (replaced if it exists); `state`; `data_position`, where
    the data stream resumes (the caller's meaning, e.g. the next batch index).

    With several processes every one calls it with the same arguments (a shared file system);
    each writes the shards it holds.
    """
    from orbax.checkpoint.experimental import v1 as ocp

    path = pathlib.Path(path).absolute()  # orbax refuses relative paths
    leaves = jax.tree.leaves(eqx.filter(state, eqx.is_array))
    meta = {
        "format": _STATE_FORMAT,
        "step": int(state.step),
        "data_position": int(data_position),
        "leaves": [[list(x.shape), str(x.dtype)] for x in leaves],
    }
    tmp = path.with_name(f".{path.name}.tmp-{shared_token()}")
    if is_primary():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.mkdir()
    barrier(f"equinox_dsv4-state-tmp-{tmp}")
    try:
        ocp.save(tmp / "arrays", {f"{i:06d}": x for i, x in enumerate(leaves)})
        barrier(f"equinox_dsv4-state-written-{tmp}")
        if is_primary():
            (tmp / "train_state.json").write_text(json.dumps(meta) + "\n")
            if path.exists():
                old = path.with_name(f".{path.name}.old")
                shutil.rmtree(old, ignore_errors=True)
                path.rename(old)
                tmp.rename(path)
                shutil.rmtree(old)
            else:
                tmp.rename(path)
        barrier(f"equinox_dsv4-state-published-{path}")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def restore_train_state(path: str | os.PathLike, like: TrainState) -> tuple[TrainState, int]:
    """Restores a state saved by `save_train_state` into the structure of `like` (e.g. a fresh
    `init_train_state`, or its `eqx.filter_eval_shape`), each array with `like`'s sharding.

    **Returns:** `(state, data_position)`. Raises `ValueError` naming the first mismatched
    leaf when the saved state does not fit `like` (another config, optimizer or dtype).
    """
    from orbax.checkpoint.experimental import v1 as ocp

    path = pathlib.Path(path)
    meta_path = path / "train_state.json"
    if not meta_path.is_file():
        raise FileNotFoundError(f"{path} is not a saved train state (no train_state.json)")
    meta = json.loads(meta_path.read_text())
    if meta.get("format") != _STATE_FORMAT:
        raise ValueError(f"{path}: unknown train-state format {meta.get('format')!r}")
    arrays, static = eqx.partition(like, eqx.is_array)
    leaves, treedef = jax.tree.flatten(arrays)
    if len(leaves) != len(meta["leaves"]):
        raise ValueError(
            f"{path} holds {len(meta['leaves'])} arrays, the target state has {len(leaves)}: "
            "another model config or optimizer"
        )
    paths = [jax.tree_util.keystr(k) for k, _ in jax.tree_util.tree_flatten_with_path(arrays)[0]]
    abstract = {}
    saved = meta["leaves"]
    for i, (leaf, (shape, dtype), name) in enumerate(zip(leaves, saved, paths, strict=True)):
        if list(leaf.shape) != shape or str(leaf.dtype) != dtype:
            raise ValueError(
                f"{path}: leaf {name} is saved as {dtype}{shape}, "
                f"the target expects {leaf.dtype}{list(leaf.shape)}"
            )
        sharding = getattr(leaf, "sharding", None)
        abstract[f"{i:06d}"] = jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding)
    restored = ocp.load(path.absolute() / "arrays", abstract)  # orbax refuses relative paths
    values = [restored[f"{i:06d}"] for i in range(len(leaves))]
    state = eqx.combine(jax.tree.unflatten(treedef, values), static)
    return state, int(meta["data_position"])
