"""Long chunks' attention as one Pallas kernel (`Policy.attention_kernel`; TPUs').

The plain form (`nn.attend`'s blocks, in a chunked map) writes each block's float32 logits and
probabilities for every head against its `2 * window` raw keys and, in CSA/HCA layers, every
compressed entry, then reads them back: the largest per-query buffers of a prefill, which the
math does not need. The kernel keeps them in the chip's on-core memory instead: per block of
queries and group of heads, the window's softmax first, then the compressed entries a block
at a time with a running maximum and denominator (the sink seeds the denominator, as in the
plain form). It computes what the plain form computes, in another order: equal within float
rounding. Its gradient is the plain form's, recomputed a chunk at a time from the same
inputs (training keeps the plain form's memory). On other backends the kernel runs in Pallas'
interpreter, which is how tests compare it with the plain form on CPU.

Under a mesh the kernel runs in a `shard_map`: each device its batch rows (`batch_axes`), its
part of the blocks when the sequence is split over `expert` (`sequence_parts`), and its heads
when `tensor` splits them.
"""

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Bool, Float

from ._mesh import batch_axes, mesh_axis
from ._policy import Policy, platform_of, resolve
from ._schedule import map_chunks


# Compressed entries per kernel step: a block of them for a group of heads in on-core memory.
ENTRY_BLOCK = 512
# Query heads per kernel program: they share the program's reads of the keys and entries.
HEAD_GROUP = 8

Blocks = Callable[..., Float[Array, "batch blocks queries heads head_dim"]]


def attend_blocks(
    fn: Blocks,
    qb: Float[Array, "batch blocks queries heads head_dim"],
    keys: Float[Array, "batch blocks keys head_dim"],
    valid: Bool[Array, "batch blocks keys"],
    c_valid: Bool[Array, "batch blocks queries entries"],
    compressed: Float[Array, "batch entries head_dim"] | None,
    sinks: Float[Array, " heads"],
    size: int,
    parts: int,
    policy: Policy | None,
) -> Float[Array, "batch blocks queries heads head_dim"]:
    """`fn(qb, keys, valid, c_valid, compressed=..., sinks=...)`, the plain attention of
    query blocks, in the policy's form: chunks of `size` blocks in `parts` sequence parts
    (`map_chunks`), or for more than `policy.few_tokens` queries per sequence the kernel
    (`Policy.attention_kernel`), whose output equals the plain
    form's within float rounding and whose gradient is the plain form's.

    `qb`: each block's queries; `keys`: its raw keys, of which query `i` sees key `j` for
    `i < j <= i + keys - queries` where `valid`; `c_valid`: which compressed entries each
    query sees (`compressed`: none when `None`); `sinks`: per-head logits of the sink."""
    policy = resolve(policy)
    if not policy.attention_kernel or qb.shape[1] * qb.shape[2] <= policy.few_tokens:
        plain = functools.partial(fn, compressed=compressed, sinks=sinks)
        return map_chunks(plain, (qb, keys, valid, c_valid), size, parts)
    has_entries = compressed is not None and compressed.shape[1] > 0
    if not has_entries:
        compressed = None
    args = (qb, keys, valid, c_valid, compressed, sinks)
    kernel = functools.partial(
        _fused,
        fn,
        size,
        platform_of(qb) != "tpu",  # the interpreter off TPUs
    )
    if jax.sharding.get_abstract_mesh().empty:
        return kernel(*args)
    rows = batch_axes(qb.shape[0])
    seq = "expert" if parts > 1 else None
    tensor = mesh_axis("tensor")
    heads = "tensor" if tensor > 1 and qb.shape[3] % tensor == 0 else None
    specs = (
        P(rows, seq, None, heads, None),
        P(rows, seq),
        P(rows, seq),
        P(rows, seq),
        None if compressed is None else P(rows),
        P(heads),
    )
    # Unchecked: Pallas' interpreter compares the blocks with constants that vary over no
    # mesh axis, which the check refuses. The specs say what varies: the gradients of what
    # every device holds whole (the entries over `expert`, the sinks) are summed.
    return jax.shard_map(
        kernel, in_specs=specs, out_specs=P(rows, seq, None, heads, None), check_vma=False
    )(*args)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _fused(fn, size, interpret, qb, keys, valid, c_valid, compressed, sinks):
    return _forward(qb, keys, valid, c_valid, compressed, sinks, interpret)


def _fused_fwd(fn, size, interpret, *args):
    return _fused(fn, size, interpret, *args), args


def _fused_bwd(fn, size, interpret, args, cotangent):
    # The plain form's gradient, recomputed a chunk at a time (as the plain form's own
    # backward pass would recompute it under the layers' remat).
    def plain(qb, keys, valid, c_valid, compressed, sinks):
        body = functools.partial(fn, compressed=compressed, sinks=sinks)
        return map_chunks(body, (qb, keys, valid, c_valid), size)

    _, vjp = jax.vjp(plain, *args)
    return vjp(cotangent)


_fused.defvjp(_fused_fwd, _fused_bwd)


def _forward(qb, keys, valid, c_valid, compressed, sinks, interpret):
    b, nb, bq, h, k = qb.shape
    width = keys.shape[2]
    group = HEAD_GROUP if h % HEAD_GROUP == 0 else h
    # Heads ahead of the queries: a program's blocks are [queries, head_dim] per head.
    q = qb.transpose(0, 1, 3, 2, 4)
    valid = valid.astype(jnp.float32)[:, :, None, :]
    sinks = sinks.astype(jnp.float32)
    inputs = [sinks, q, keys, valid]
    in_specs = [
        pl.BlockSpec(memory_space=pltpu.SMEM),
        pl.BlockSpec((None, None, group, bq, k), lambda i, n, g, c: (i, n, g, 0, 0)),
        pl.BlockSpec((None, None, width, k), lambda i, n, g, c: (i, n, 0, 0)),
        pl.BlockSpec((None, None, 1, width), lambda i, n, g, c: (i, n, 0, 0)),
    ]
    steps = 1
    if compressed is not None:
        m = compressed.shape[1]
        steps = -(-m // ENTRY_BLOCK)
        # Equal steps of whole 128-lane tiles (or one step of them all): the least padding.
        block = m if steps == 1 else -(-m // (steps * 128)) * 128
        pad = steps * block - m
        entries = jnp.pad(compressed, ((0, 0), (0, pad), (0, 0)))
        seen = jnp.pad(c_valid.astype(jnp.float32), ((0, 0),) * 3 + ((0, pad),))
        inputs += [entries, seen]
        in_specs += [
            pl.BlockSpec((None, block, k), lambda i, n, g, c: (i, c, 0)),
            pl.BlockSpec((None, None, bq, block), lambda i, n, g, c: (i, n, 0, c)),
        ]
    spec = pl.BlockSpec((None, None, group, bq, k), lambda i, n, g, c: (i, n, g, 0, 0))
    reads = sum(x.size * x.dtype.itemsize for x in inputs)
    if compressed is not None:  # every group of heads reads the entries again
        reads += (h // group - 1) * nb * entries.size * entries.dtype.itemsize
    keys_seen = width + (0 if compressed is None else steps * block)
    out = pl.pallas_call(
        functools.partial(_kernel, scale=k**-0.5, steps=steps, with_entries=compressed is not None),
        out_shape=jax.ShapeDtypeStruct((b, nb, h, bq, k), jnp.float32),
        grid=(b, nb, h // group, steps),
        in_specs=in_specs,
        out_specs=spec,
        scratch_shapes=[
            pltpu.VMEM((group, bq, 128), jnp.float32),  # running maximum, lane-broadcast
            pltpu.VMEM((group, bq, 128), jnp.float32),  # running denominator
            pltpu.VMEM((group, bq, k), jnp.float32),  # running output
        ],
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")
        ),
        cost_estimate=pl.CostEstimate(
            flops=4 * b * nb * bq * h * keys_seen * k,
            transcendentals=b * nb * bq * h * keys_seen,
            bytes_accessed=reads + b * nb * h * bq * k * 4,
        ),
        interpret=interpret,
        name="window_and_entries_attention",
    )(*inputs)
    return out.transpose(0, 1, 3, 2, 4)


def _kernel(sinks_ref, q_ref, k_ref, valid_ref, *refs, scale, steps, with_entries):
    if with_entries:
        c_ref, seen_ref, o_ref, max_ref, den_ref, acc_ref = refs
    else:
        o_ref, max_ref, den_ref, acc_ref = refs
    # Read outside the conditional blocks, which Pallas' interpreter cannot read them in.
    step, first_head = pl.program_id(3), pl.program_id(2) * q_ref.shape[0]
    group = q_ref.shape[0]
    f32 = jnp.float32

    # Named, not the configured default: Mosaic refuses a float32 contraction of 16-bit
    # operands, whose products are exact in one pass anyway.
    exact = jax.lax.Precision.HIGHEST if q_ref.dtype == f32 else jax.lax.Precision.DEFAULT

    def scores(q, keys):  # [queries, k] x [keys, k] -> [queries, keys], float32
        dims = (((1,), (1,)), ((), ()))
        return jax.lax.dot_general(q, keys, dims, exact, preferred_element_type=f32)

    def values(p, keys):  # [queries, keys] x [keys, k] -> [queries, k], float32
        dims = (((1,), (0,)), ((), ()))
        return jax.lax.dot_general(
            p.astype(keys.dtype), keys, dims, exact, preferred_element_type=f32
        )

    def lanes(x):  # [queries, 1] -> [queries, 128]
        return jnp.broadcast_to(x, (x.shape[0], 128))

    @pl.when(step == 0)
    def _window():
        keys = k_ref[...]
        bq, width = q_ref.shape[1], keys.shape[0]
        i = jax.lax.broadcasted_iota(jnp.int32, (bq, width), 0)
        j = jax.lax.broadcasted_iota(jnp.int32, (bq, width), 1)
        seen = (i < j) & (j <= i + (width - bq)) & (valid_ref[...] > 0.5)
        for g in range(group):
            s = jnp.where(seen, scores(q_ref[g], keys) * scale, -jnp.inf)
            sink = sinks_ref[first_head + g]
            top = jnp.maximum(jnp.max(s, axis=1, keepdims=True), sink)
            p = jnp.exp(s - top)
            max_ref[g] = lanes(top)
            den_ref[g] = lanes(jnp.sum(p, axis=1, keepdims=True) + jnp.exp(sink - top))
            acc_ref[g] = values(p, keys)

    if with_entries:
        entries = c_ref[...]
        seen = seen_ref[...] > 0.5
        for g in range(group):
            s = jnp.where(seen, scores(q_ref[g], entries) * scale, -jnp.inf)
            before = max_ref[g][:, :1]
            top = jnp.maximum(before, jnp.max(s, axis=1, keepdims=True))
            alpha = jnp.exp(before - top)
            p = jnp.exp(s - top)
            max_ref[g] = lanes(top)
            den_ref[g] = den_ref[g] * alpha + lanes(jnp.sum(p, axis=1, keepdims=True))
            acc_ref[g] = acc_ref[g] * alpha + values(p, entries)

    @pl.when(step == steps - 1)
    def _out():
        for g in range(group):
            o_ref[g] = (acc_ref[g] / den_ref[g][:, :1]).astype(o_ref.dtype)
