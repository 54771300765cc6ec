"""The decoder block: attention and MoE, each wrapped in its own mHC site."""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
from jax.typing import DTypeLike
from jaxtyping import Array, Float, Int, PRNGKeyArray

from ..config import Config
from ._attention import Attention
from ._cache import Chunk, LayerCache
from ._hyper import HyperConnection
from ._layers import RMSNorm
from ._moe import MoE, RouterStats


class Block(eqx.Module):
    """`X <- mix_attn(X, attn(attn_norm(u)))`, then `X <- mix_ffn(X, ffn(ffn_norm(u), ids))`, where
    each `u` is the collapse of the streams by that site's `pre` weights (see `HyperConnection`).

    The attention type (`layer_type`) and the routing (`mlp_type`) fix the block's structure;
    blocks of the same structure stack into one scanned pytree.
    """

    attn_norm: RMSNorm
    attn: Attention
    hc_attn: HyperConnection
    ffn_norm: RMSNorm
    ffn: MoE
    hc_ffn: HyperConnection

    def __init__(
        self,
        config: Config,
        layer_type: str,
        mlp_type: str,
        *,
        key: PRNGKeyArray,
        dtype: DTypeLike = jnp.float32,
    ):
        """**Arguments:**

        - `config`: the model config.
        - `layer_type`: attention type, one of `Config.layer_types`' values.
        - `mlp_type`: `"hash_moe"` or `"moe"`.
        - `key`: PRNG key. `dtype`: parameter dtype of the linear and expert weights.
        """
        a_key, f_key, ha_key, hf_key = jr.split(key, 4)
        self.attn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attn = Attention(config, layer_type, key=a_key, dtype=dtype)
        self.hc_attn = HyperConnection(config, key=ha_key)
        self.ffn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.ffn = MoE(config, mlp_type, key=f_key, dtype=dtype)
        self.hc_ffn = HyperConnection(config, key=hf_key)

    def __call__(
        self, x: Float[Array, "batch seq streams d_model"], ids: Int[Array, "batch seq"]
    ) -> Float[Array, "batch seq streams d_model"]:
        """**Arguments:**

        - `x`: the residual streams at positions `0 .. seq-1`.
        - `ids`: the token ids (hash routing reads them).

        **Returns:** the updated streams, in `x.dtype`.
        """
        return self.with_stats(x, ids)[0]

    def with_stats(
        self, x: Float[Array, "batch seq streams d_model"], ids: Int[Array, "batch seq"]
    ) -> tuple[Float[Array, "batch seq streams d_model"], RouterStats]:
        """As `__call__`, plus the MoE's `RouterStats`."""
        b, s = ids.shape
        x, _, stats = self.step(x, ids, Chunk.whole(b, s), self.attn.init_cache(b, s, x.dtype))
        return x, stats

    @jax.named_scope("block")
    def step(
        self,
        x: Float[Array, "batch chunk streams d_model"],
        ids: Int[Array, "batch chunk"],
        chunk: Chunk,
        cache: LayerCache,
    ) -> tuple[Float[Array, "batch chunk streams d_model"], LayerCache, RouterStats]:
        """The block on a chunk appended to `cache` (see `Attention.step`).

        **Returns:** `(streams, cache, stats)`, `stats` being the MoE's `RouterStats`.
        """
        u, post, comb = self.hc_attn(x)
        a, cache = self.attn.step(self.attn_norm(u), chunk, cache)
        x = self.hc_attn.mix(a, x, post, comb)
        u, post, comb = self.hc_ffn(x)
        f, stats = self.ffn.with_stats(self.ffn_norm(u), ids)
        return self.hc_ffn.mix(f, x, post, comb), cache, stats
