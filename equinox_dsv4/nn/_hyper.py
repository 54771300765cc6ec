"""Manifold-constrained hyper-connections (mHC): the residual stream widened to `hc_mult` streams.

Each sub-layer (attention or MoE) reads a weighted sum of the streams and writes its output
back to every stream, while the streams themselves are mixed by a doubly-stochastic matrix
(Sinkhorn-Knopp projection), which keeps the residual path non-expansive (DeepSeek-V4 report
§2.2; Xie et al., 2026). All mixing weights are computed in float32.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, PRNGKeyArray

from ..config import Config
from ..execution import Policy, policy_field, resolve
from ._layers import f32, init_normal, lead


_HIGHEST = jax.lax.Precision.HIGHEST


def _stream_mixes(
    x: Float[Array, "*batch streams d_model"], fn: Float[Array, "mix flat"], eps: float
) -> Float[Array, "*batch mix"]:
    flat = f32(x).reshape(*x.shape[:-2], x.shape[-2] * x.shape[-1])
    # rmsnorm(x) @ fn.T == (x @ fn.T) * rsqrt(mean(x^2) + eps): scaling the few mixes instead
    # of the wide input saves writing and re-reading a normalised copy of all the streams.
    inv_rms = jax.lax.rsqrt(jnp.mean(jnp.square(flat), axis=-1, keepdims=True) + eps)
    # HIGHEST: these float32 contractions must stay float32 where a backend's default matmul
    # precision is lower.
    return jnp.einsum("...f,mf->...m", flat, f32(fn), precision=_HIGHEST) * inv_rms


def sinkhorn(
    logits: Float[Array, "*batch n n"], iters: int, eps: float, policy: Policy | None = None
) -> Float[Array, "*batch n n"]:
    """Row-softmax plus `eps`, then Sinkhorn-Knopp: one column normalisation followed by
    `iters - 1` (row, column) rounds, the order the released kernel uses; the rounds unrolled
    or as a loop as `policy` says (`Policy.rolled_sinkhorn`: the same numbers)."""

    def normalize(c, axis):
        return c / (jnp.sum(c, axis=axis, keepdims=True) + eps)

    comb = normalize(jax.nn.softmax(logits, axis=-1) + eps, -2)
    unroll = not resolve(policy).rolled_sinkhorn
    return jax.lax.fori_loop(
        0, iters - 1, lambda _, c: normalize(normalize(c, -1), -2), comb, unroll=unroll
    )


class HyperConnection(eqx.Module):
    """One mHC site: produces the sub-layer input and folds its output back into the streams.

    For streams `X [N, D]` (per token), with `x = flatten(X)`:
    `m = (rmsnorm(x) @ fn.T)`, split into `pre (N) | post (N) | comb (N*N)`;
    `pre = sigmoid(s0 m_pre + b_pre) + eps`, `post = 2 sigmoid(s1 m_post + b_post)`,
    `C = sinkhorn(s2 m_comb + b_comb)`; the sub-layer sees `u = sum_n pre_n X_n` and the new
    streams are `X'_k = post_k y + sum_j C[j, k] X_j` (the transpose `C^T X`, not `C X`).
    """

    fn: Float[Array, "mix flat"]
    base: Float[Array, " mix"]
    scale: Float[Array, "3"]
    hc_mult: int = eqx.field(static=True)
    sinkhorn_iters: int = eqx.field(static=True)
    hc_eps: float = eqx.field(static=True)
    norm_eps: float = eqx.field(static=True)
    policy: Policy | None = policy_field()

    def __init__(self, config: Config, *, key: PRNGKeyArray):
        n = config.hc_mult
        mix = (2 + n) * n
        self.fn = init_normal(key, (mix, n * config.hidden_size), jnp.float32)
        self.base = jnp.zeros((mix,), jnp.float32)
        self.scale = jnp.ones((3,), jnp.float32)
        self.hc_mult = n
        self.sinkhorn_iters = config.hc_sinkhorn_iters
        self.hc_eps = config.hc_eps
        self.norm_eps = config.rms_norm_eps
        self.policy = None

    def param_axes(self, name: str) -> tuple[str | None, ...]:
        return (None,) * (2 if name == "fn" else 1)  # small: replicated

    def __call__(
        self, x: Float[Array, "*batch streams d_model"]
    ) -> tuple[
        Float[Array, "*batch d_model"],
        Float[Array, "*batch streams"],
        Float[Array, "*batch streams streams"],
    ]:
        """**Arguments:**

        - `x`: the residual streams `[..., hc_mult, d_model]`.

        **Returns:** `(u, post, comb)`: the collapsed sub-layer input `[..., d_model]` in
        `x.dtype`, and the float32 expansion weights `[..., hc_mult]` and mixing matrix
        `[..., hc_mult, hc_mult]` for `mix`.
        """
        n = self.hc_mult
        mixes = _stream_mixes(x, self.fn, self.norm_eps)
        scale, base = f32(self.scale), f32(self.base)
        base = lead(base, mixes.ndim)
        pre = jax.nn.sigmoid(mixes[..., :n] * scale[0] + base[..., :n]) + self.hc_eps
        post = 2 * jax.nn.sigmoid(mixes[..., n : 2 * n] * scale[1] + base[..., n : 2 * n])
        comb_logits = mixes[..., 2 * n :] * scale[2] + base[..., 2 * n :]
        comb = sinkhorn(
            comb_logits.reshape(*mixes.shape[:-1], n, n),
            self.sinkhorn_iters,
            self.hc_eps,
            self.policy,
        )
        u = jnp.einsum("...n,...nd->...d", pre, f32(x), precision=_HIGHEST).astype(x.dtype)
        return u, post, comb

    def mix(
        self,
        y: Float[Array, "*batch d_model"],
        x: Float[Array, "*batch streams d_model"],
        post: Float[Array, "*batch streams"],
        comb: Float[Array, "*batch streams streams"],
    ) -> Float[Array, "*batch streams d_model"]:
        """`X'_k = post_k y + sum_j comb[j, k] X_j`, in float32, cast to `x.dtype`."""
        expanded = post[..., :, None] * f32(y)[..., None, :]
        # A broadcast sum, not an einsum (docs/design.md, "Stream mix as a broadcast sum").
        mixed = jnp.sum(comb[..., :, :, None] * f32(x)[..., :, None, :], axis=-3)
        return (expanded + mixed).astype(x.dtype)


class HyperHead(eqx.Module):
    """Final collapse of the streams: `h = sum_n (sigmoid(s m_n + b_n) + eps) X_n` with
    `m = rmsnorm(flatten(X)) @ fn.T`; no expansion, no Sinkhorn."""

    fn: Float[Array, "streams flat"]
    base: Float[Array, " streams"]
    scale: Float[Array, "1"]
    hc_eps: float = eqx.field(static=True)
    norm_eps: float = eqx.field(static=True)

    def __init__(self, config: Config, *, key: PRNGKeyArray):
        n = config.hc_mult
        self.fn = init_normal(key, (n, n * config.hidden_size), jnp.float32)
        self.base = jnp.zeros((n,), jnp.float32)
        self.scale = jnp.ones((1,), jnp.float32)
        self.hc_eps = config.hc_eps
        self.norm_eps = config.rms_norm_eps

    def param_axes(self, name: str) -> tuple[str | None, ...]:
        return (None,) * (2 if name == "fn" else 1)  # small: replicated

    def __call__(self, x: Float[Array, "*batch streams d_model"]) -> Float[Array, "*batch d_model"]:
        """**Arguments:** `x`, the streams `[..., hc_mult, d_model]`.

        **Returns:** `[..., d_model]` in `x.dtype`."""
        mixes = _stream_mixes(x, self.fn, self.norm_eps)
        pre = mixes * f32(self.scale)[0] + lead(f32(self.base), mixes.ndim)
        pre = jax.nn.sigmoid(pre) + self.hc_eps
        return jnp.einsum("...n,...nd->...d", pre, f32(x), precision=_HIGHEST).astype(x.dtype)
