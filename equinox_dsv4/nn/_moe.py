"""Mixture of experts: router (learned top-k or hash), routed SwiGLU experts, one shared expert.

Routing runs in float32. Learned layers select `top_k(scores + bias)` (the bias only steers the
selection, DeepSeek-V3's auxiliary-loss-free balancing) and weight the chosen experts by their
unbiased scores; hash layers take the experts from a fixed token-id table (`tid2eid`). Weights
are renormalised over the chosen experts (`norm_topk_prob`) and scaled by
`routed_scaling_factor`. The routed experts themselves are `Experts`.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
from jax.typing import DTypeLike
from jaxtyping import Array, Float, Int, PRNGKeyArray

from ..config import HASH_MOE, Config
from ..execution import Policy, constrain_features, linear, policy_field, swiglu
from ..quant import act_quant
from ._experts import Experts
from ._layers import Linear, f32, init_normal, lead


def score(logits: Float[Array, "*batch experts"], func: str) -> Float[Array, "*batch experts"]:
    if func == "sqrtsoftplus":
        return jnp.sqrt(jax.nn.softplus(logits))
    if func == "softmax":
        return jax.nn.softmax(logits, axis=-1)
    if func == "sigmoid":
        return jax.nn.sigmoid(logits)
    raise ValueError(f"unknown scoring_func {func!r}")


class Gate(eqx.Module):
    """The router. Exactly one of `bias` (learned top-k layers) and `tid2eid` (hash layers)."""

    weight: Float[Array, "experts d_model"]
    bias: Float[Array, " experts"] | None
    tid2eid: Int[Array, "vocab topk"] | None
    top_k: int = eqx.field(static=True)
    scoring_func: str = eqx.field(static=True)
    norm_topk_prob: bool = eqx.field(static=True)
    route_scale: float = eqx.field(static=True)
    policy: Policy | None = policy_field()

    def __init__(
        self, config: Config, hashed: bool, *, key: PRNGKeyArray, dtype: DTypeLike = jnp.float32
    ):
        w_key, t_key = jr.split(key)
        e = config.n_routed_experts
        self.weight = init_normal(w_key, (e, config.hidden_size), dtype)
        if hashed:
            self.bias = None
            self.tid2eid = jax.vmap(lambda k: jr.permutation(k, e)[: config.num_experts_per_tok])(
                jr.split(t_key, config.vocab_size)
            ).astype(jnp.int32)
        else:
            self.bias = jnp.zeros((e,), jnp.float32)
            self.tid2eid = None
        self.top_k = config.num_experts_per_tok
        self.scoring_func = config.scoring_func
        self.norm_topk_prob = config.norm_topk_prob
        self.route_scale = config.routed_scaling_factor
        self.policy = None

    def param_axes(self, name: str) -> tuple[str | None, ...]:
        # The router is small and every token needs every expert's score: replicated.
        return {"weight": (None, "embed"), "bias": (None,), "tid2eid": (None, None)}[name]

    def __call__(
        self, x: Float[Array, "tokens d_model"], ids: Int[Array, " tokens"]
    ) -> tuple[Float[Array, "tokens topk"], Int[Array, "tokens topk"]]:
        """**Arguments:** `x`, the normed tokens; `ids`, their token ids (hash layers).

        **Returns:** float32 routing weights and the chosen expert indices, `[tokens, top_k]`.
        """
        weights, indices, _ = self.route(x, ids)
        return weights, indices

    def route(
        self, x: Float[Array, "tokens d_model"], ids: Int[Array, " tokens"]
    ) -> tuple[
        Float[Array, "tokens topk"], Int[Array, "tokens topk"], Float[Array, "tokens experts"]
    ]:
        """As `__call__`, plus every expert's float32 score (the balance loss reads them)."""
        # Float32 routing at float32 precision whatever the backend's matmul default.
        precision = jax.lax.Precision.HIGHEST
        logits = linear(x, self.weight, self.policy, dtype=jnp.float32, precision=precision)
        scores = score(logits, self.scoring_func)
        if self.tid2eid is not None:
            indices = jnp.take(self.tid2eid, ids, axis=0).astype(jnp.int32)
        else:
            assert self.bias is not None
            # The bias is a selection offset, not a parameter of the function: no gradient
            # reaches it (it is updated from the expert load instead, see `update_router_bias`).
            bias = jax.lax.stop_gradient(f32(self.bias))
            _, indices = jax.lax.top_k(scores + lead(bias, scores.ndim), self.top_k)
        weights = jnp.take_along_axis(scores, indices, axis=-1)
        if self.norm_topk_prob:
            weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
        return weights * self.route_scale, indices, scores


class RouterStats(eqx.Module):
    """What one MoE layer's routing did on one call, for load balancing.

    - `load`: float32 `[experts]`, how many (token, expert) assignments each expert received.
    - `balance`: DeepSeek-V3's sequence-wise balance loss `sum_i f_i P_i` averaged over the
      batch's sequences, where `f_i = E / (K T) * #{t : i chosen at t}` and `P_i` is the mean
      over the sequence's tokens of expert `i`'s score normalised over all experts. Zero for
      hash-routed layers, whose assignment the router cannot change.
    """

    load: Float[Array, " experts"]
    balance: Float[Array, ""]


class SharedExpert(eqx.Module):
    """The always-on SwiGLU expert (clamped like the routed ones)."""

    w1: Linear
    w2: Linear
    w3: Linear
    limit: float = eqx.field(static=True)
    numerics: str = eqx.field(static=True)

    def __init__(self, config: Config, *, key: PRNGKeyArray, dtype: DTypeLike = jnp.float32):
        k1, k2, k3 = jr.split(key, 3)
        d, i = config.hidden_size, config.moe_intermediate_size
        self.w1 = Linear(d, i, ("mlp", "embed"), key=k1, dtype=dtype)
        self.w2 = Linear(i, d, ("embed", "mlp"), key=k2, dtype=dtype)
        self.w3 = Linear(d, i, ("mlp", "embed"), key=k3, dtype=dtype)
        self.limit = config.swiglu_limit
        self.numerics = config.numerics

    def __call__(self, x: Float[Array, "*batch d_model"]) -> Float[Array, "*batch d_model"]:
        xq = act_quant(x, self.numerics)
        gate = self.w1(xq, dtype=jnp.float32)
        up = self.w3(xq, dtype=jnp.float32)
        hidden = act_quant(swiglu(gate, up, self.limit).astype(x.dtype), self.numerics)
        return self.w2(hidden)


class MoE(eqx.Module):
    """The feed-forward sub-layer: routed experts plus the shared expert."""

    gate: Gate
    experts: Experts
    shared_experts: SharedExpert
    policy: Policy | None = policy_field()

    def __init__(
        self,
        config: Config,
        mlp_type: str,
        *,
        key: PRNGKeyArray,
        dtype: DTypeLike = jnp.float32,
    ):
        """**Arguments:**

        - `config`: the model config.
        - `mlp_type`: `"hash_moe"` (hash routing on token ids) or `"moe"` (learned top-k).
        - `key`: PRNG key. `dtype`: dtype of the router and expert weights.
        """
        g_key, e_key, s_key = jr.split(key, 3)
        self.gate = Gate(config, mlp_type == HASH_MOE, key=g_key, dtype=dtype)
        self.experts = Experts(config, key=e_key, dtype=dtype)
        self.shared_experts = SharedExpert(config, key=s_key, dtype=dtype)
        self.policy = None

    def __call__(
        self, x: Float[Array, "batch seq d_model"], ids: Int[Array, "batch seq"]
    ) -> Float[Array, "batch seq d_model"]:
        """**Arguments:** `x`, the normed sub-layer input; `ids`, the token ids.

        **Returns:** the MoE output in `x.dtype` (routed and shared parts summed in float32).
        """
        return self.with_stats(x, ids)[0]

    @jax.named_scope("moe")
    def with_stats(
        self, x: Float[Array, "batch seq d_model"], ids: Int[Array, "batch seq"]
    ) -> tuple[Float[Array, "batch seq d_model"], RouterStats]:
        """As `__call__`, plus the routing statistics of this call (`RouterStats`); every
        position of `x` counts, padding included."""
        b, s, d = x.shape
        # A decode step's tokens in the block's layout for the router, the shared expert and
        # the sum: else the layout the routed experts take them in (split along the batch)
        # reaches those products, and every device gathers their weights whole
        # (`Policy.stationary_tokens`).
        tokens = b * s
        flat = constrain_features(x.reshape(tokens, d), tokens, self.policy)
        weights, indices, scores = self.gate.route(flat, ids.reshape(-1))
        routed = constrain_features(self.experts(flat, indices, weights), tokens, self.policy)
        out = routed + constrain_features(f32(self.shared_experts(flat)), tokens, self.policy)
        n_experts, top_k = scores.shape[-1], indices.shape[-1]
        chosen = jnp.zeros((b, n_experts), jnp.float32)
        chosen = chosen.at[jnp.arange(b)[:, None], indices.reshape(b, s * top_k)].add(1.0)
        if self.gate.tid2eid is None:
            share = scores / (jnp.sum(scores, axis=-1, keepdims=True) + 1e-20)
            p = jnp.mean(share.reshape(b, s, n_experts), axis=1)
            f = jax.lax.stop_gradient(chosen) * (n_experts / (top_k * s))
            balance = jnp.mean(jnp.sum(f * p, axis=-1))
        else:
            balance = jnp.zeros((), jnp.float32)
        stats = RouterStats(jnp.sum(chosen, axis=0), balance)
        return out.astype(x.dtype).reshape(x.shape), stats
