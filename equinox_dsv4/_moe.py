"""Mixture of experts: router (learned top-k or hash), routed SwiGLU experts, one shared expert.

Routing runs in float32. Learned layers select `top_k(scores + bias)` (the bias only steers the
selection, DeepSeek-V3's auxiliary-loss-free balancing) and weight the chosen experts by their
unbiased scores; hash layers take the experts from a fixed token-id table (`tid2eid`). Weights
are renormalised over the chosen experts (`norm_topk_prob`) and scaled by
`routed_scaling_factor`.

Routed experts are computed only for the tokens that chose them: the (token, expert)
assignments are sorted by expert into blocks of one expert each and a scan runs one matmul per
block, so the work is proportional to `num_experts_per_tok`, never to the number of experts.
"""

import math

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
from jax.typing import DTypeLike
from jaxtyping import Array, Float, Int, PRNGKeyArray

from ._config import HASH_MOE, Config
from ._layers import Linear, einsum_f32, f32, init_normal, lead, linear


def swiglu(
    gate: Float[Array, "*batch inter"], up: Float[Array, "*batch inter"], limit: float
) -> Float[Array, "*batch inter"]:
    """`silu(min(gate, L)) * clip(up, -L, L)`; no clamp when `limit` is 0."""
    if limit > 0:
        gate = jnp.minimum(gate, limit)
        up = jnp.clip(up, -limit, limit)
    return jax.nn.silu(gate) * up


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

    def param_axes(self, name: str) -> tuple[str | None, ...]:
        # The router is small and every token needs every expert's score: replicated.
        return {"weight": (None, "embed"), "bias": (None,), "tid2eid": (None, None)}[name]

    def __call__(
        self, x: Float[Array, "tokens d_model"], ids: Int[Array, " tokens"]
    ) -> tuple[Float[Array, "tokens topk"], Int[Array, "tokens topk"]]:
        """**Arguments:** `x`, the normed tokens; `ids`, their token ids (hash layers).

        **Returns:** float32 routing weights and the chosen expert indices, `[tokens, top_k]`.
        """
        scores = score(linear(x, self.weight, dtype=jnp.float32), self.scoring_func)
        if self.tid2eid is not None:
            indices = jnp.take(self.tid2eid, ids, axis=0).astype(jnp.int32)
        else:
            assert self.bias is not None
            _, indices = jax.lax.top_k(scores + lead(f32(self.bias), scores.ndim), self.top_k)
        weights = jnp.take_along_axis(scores, indices, axis=-1)
        if self.norm_topk_prob:
            weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
        return weights * self.route_scale, indices


class Experts(eqx.Module):
    """The routed experts, stacked: `w1`, `w3` `[experts, inter, d_model]`, `w2`
    `[experts, d_model, inter]`. Expert `e` maps `x` to `w2[e] (swiglu(w1[e] x, w3[e] x))`."""

    w1: Float[Array, "experts inter d_model"]
    w2: Float[Array, "experts d_model inter"]
    w3: Float[Array, "experts inter d_model"]
    limit: float = eqx.field(static=True)

    def __init__(self, config: Config, *, key: PRNGKeyArray, dtype: DTypeLike = jnp.float32):
        k1, k2, k3 = jr.split(key, 3)
        e, d, i = config.n_routed_experts, config.hidden_size, config.moe_intermediate_size
        self.w1 = init_normal(k1, (e, i, d), dtype)
        self.w2 = init_normal(k2, (e, d, i), dtype)
        self.w3 = init_normal(k3, (e, i, d), dtype)
        self.limit = config.swiglu_limit

    def param_axes(self, name: str) -> tuple[str | None, ...]:
        if name == "w2":
            return ("experts", "embed", "expert_mlp")
        return ("experts", "expert_mlp", "embed")

    def __call__(
        self,
        x: Float[Array, "tokens d_model"],
        indices: Int[Array, "tokens topk"],
        weights: Float[Array, "tokens topk"],
    ) -> Float[Array, "tokens d_model"]:
        """**Arguments:** the normed tokens, their chosen experts and float32 routing weights.

        **Returns:** `sum_j weights[:, j] * expert_{indices[:, j]}(x)`, accumulated in float32
        and returned in float32.
        """
        tokens, top_k = indices.shape
        n_experts = self.w1.shape[0]
        rows = tokens * top_k
        # Block size: about one block per expert at this load, a power of two in [1, 256]. Each
        # expert's group is padded to whole blocks, so at most min(E, rows) blocks are partial.
        block = 1 << max(0, min(8, math.ceil(math.log2(max(1, rows // n_experts)))))
        n_blocks = -(-(rows + min(n_experts, rows) * (block - 1)) // block)

        expert = indices.reshape(rows)
        order = jnp.argsort(expert, stable=True)
        expert_sorted = expert[order]
        token_sorted = order // top_k
        counts = jnp.bincount(expert, length=n_experts)
        padded = -(-counts // block) * block
        padded_end = jnp.cumsum(padded)
        # Row r of the sorted assignments goes to its expert's padded group, in order.
        rank = jnp.arange(rows) - (jnp.cumsum(counts) - counts)[expert_sorted]
        dest = (padded_end - padded)[expert_sorted] + rank
        xs = jnp.zeros((n_blocks * block, x.shape[-1]), x.dtype).at[dest].set(x[token_sorted])
        ws = jnp.zeros((n_blocks * block,), jnp.float32).at[dest].set(weights.reshape(rows)[order])
        block_expert = jnp.searchsorted(padded_end, jnp.arange(n_blocks) * block, side="right")
        block_expert = jnp.minimum(block_expert, n_experts - 1)

        def run_block(_, inputs):
            xb, wb, e = inputs
            g = einsum_f32("bd,id->bi", xb, self.w1[e])
            u = einsum_f32("bd,id->bi", xb, self.w3[e])
            # The routing weight is applied before w2, in float32, as in the official code.
            h = (swiglu(g, u, self.limit) * wb[:, None]).astype(x.dtype)
            return None, einsum_f32("bi,di->bd", h, self.w2[e])

        _, ys = jax.lax.scan(
            run_block,
            None,
            (xs.reshape(n_blocks, block, -1), ws.reshape(n_blocks, block), block_expert),
        )
        ys = ys.reshape(n_blocks * block, -1)[dest]
        return jnp.zeros((tokens, x.shape[-1]), jnp.float32).at[token_sorted].add(ys)


class SharedExpert(eqx.Module):
    """The always-on SwiGLU expert (clamped like the routed ones)."""

    w1: Linear
    w2: Linear
    w3: Linear
    limit: float = eqx.field(static=True)

    def __init__(self, config: Config, *, key: PRNGKeyArray, dtype: DTypeLike = jnp.float32):
        k1, k2, k3 = jr.split(key, 3)
        d, i = config.hidden_size, config.moe_intermediate_size
        self.w1 = Linear(d, i, ("mlp", "embed"), key=k1, dtype=dtype)
        self.w2 = Linear(i, d, ("embed", "mlp"), key=k2, dtype=dtype)
        self.w3 = Linear(d, i, ("mlp", "embed"), key=k3, dtype=dtype)
        self.limit = config.swiglu_limit

    def __call__(self, x: Float[Array, "*batch d_model"]) -> Float[Array, "*batch d_model"]:
        h = swiglu(self.w1(x, dtype=jnp.float32), self.w3(x, dtype=jnp.float32), self.limit)
        return self.w2(h.astype(x.dtype))


class MoE(eqx.Module):
    """The feed-forward sub-layer: routed experts plus the shared expert."""

    gate: Gate
    experts: Experts
    shared_experts: SharedExpert

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

    def __call__(
        self, x: Float[Array, "batch seq d_model"], ids: Int[Array, "batch seq"]
    ) -> Float[Array, "batch seq d_model"]:
        """**Arguments:** `x`, the normed sub-layer input; `ids`, the token ids.

        **Returns:** the MoE output in `x.dtype` (routed and shared parts summed in float32).
        """
        flat = x.reshape(-1, x.shape[-1])
        weights, indices = self.gate(flat, ids.reshape(-1))
        routed = self.experts(flat, indices, weights)
        out = routed + f32(self.shared_experts(flat))
        return out.astype(x.dtype).reshape(x.shape)
