"""The routed experts as a module: their stacked weights. The computation is the execution
layer's (`dispatch`, or under a mesh with an `expert` axis `expert_parallel`)."""

import equinox as eqx
import jax.numpy as jnp
import jax.random as jr
from jax.typing import DTypeLike
from jaxtyping import Array, Float, Int, PRNGKeyArray

from ..config import Config
from ..execution import Policy, policy_field, routed_experts
from ..quant import LoraWeight, QuantizedWeight, act_quant
from ._layers import init_normal


class Experts(eqx.Module):
    """The routed experts, stacked: `w1`, `w3` `[experts, inter, d_model]`, `w2`
    `[experts, d_model, inter]`. Expert `e` maps `x` to `w2[e] (swiglu(w1[e] x, w3[e] x))`.

    In a view of a layer stack (`LayerStack`'s decode step, where `Policy.experts_in_place`
    says so), the weights are the whole stack's, `[layers, experts, ...]`, and `layer` the
    index of this layer in it: the few experts a decode step chooses are then read from the
    stack in place, not from a copy of the layer's every expert."""

    w1: Float[Array, "*layers experts inter d_model"] | QuantizedWeight | LoraWeight
    w2: Float[Array, "*layers experts d_model inter"] | QuantizedWeight | LoraWeight
    w3: Float[Array, "*layers experts inter d_model"] | QuantizedWeight | LoraWeight
    limit: float = eqx.field(static=True)
    numerics: str = eqx.field(static=True)
    policy: Policy | None = policy_field()
    layer: Int[Array, ""] | int | None = None

    def __init__(self, config: Config, *, key: PRNGKeyArray, dtype: DTypeLike = jnp.float32):
        k1, k2, k3 = jr.split(key, 3)
        e, d, i = config.n_routed_experts, config.hidden_size, config.moe_intermediate_size
        self.w1 = init_normal(k1, (e, i, d), dtype)
        self.w2 = init_normal(k2, (e, d, i), dtype)
        self.w3 = init_normal(k3, (e, i, d), dtype)
        self.limit = config.swiglu_limit
        self.numerics = config.numerics
        self.policy = None
        self.layer = None

    def param_axes(self, name: str) -> tuple[str | None, ...]:
        if name == "w2":
            return ("experts", "expert_out", "expert_mlp")
        return ("experts", "expert_up", "expert_in")

    def __call__(
        self,
        x: Float[Array, "tokens d_model"],
        indices: Int[Array, "tokens topk"],
        weights: Float[Array, "tokens topk"],
    ) -> Float[Array, "tokens d_model"]:
        """**Arguments:** the normed tokens, their chosen experts and float32 routing weights.

        **Returns:** `sum_j weights[:, j] * expert_{indices[:, j]}(x)`, accumulated in float32
        and returned in float32; with more assignments than experts (a prefill) each
        assignment's output is rounded to `x.dtype` before the sum. The computation is
        `execution.routed_experts` in the forms the `policy` says (under a mesh with an
        `expert` axis each device computes its own experts' share).
        """
        x = act_quant(x, self.numerics)  # once per token, for all of its experts
        w = (self.w1, self.w2, self.w3)
        act = (self.limit, self.numerics)
        return routed_experts(x, indices, weights, *w, *act, self.policy, self.layer)
