"""Long chunks' attention as one Pallas kernel (`Policy.attention_kernel`; TPUs').

The plain form (`nn.attend`'s blocks, in a chunked map) writes each block's float32 logits and
probabilities for every head against its `2 * window` raw keys and, in CSA/HCA layers, every
compressed entry, then reads them back (a backward pass likewise their gradients), though the
math needs none of them outside the core. The kernel keeps them in the chip's on-core memory:
per block of queries and group of heads, the window's softmax first, then the compressed
entries a block at a time with a running maximum and denominator (the sink seeds the
denominator, as in the plain form). It computes what the plain form computes, in another
order: equal within float rounding. Its gradient is a second kernel of the same blocks and
steps, from the output and each query's log denominator: the queries' and each block's keys'
gradients whole, the entries' as each program's share, summed after it. On other backends
the kernels run in Pallas' interpreter, which is how tests compare them with the plain form
on CPU.

Under a mesh the kernels run in a `shard_map`: each device its batch rows (`batch_axes`), its
part of the blocks when the sequence is split over `expert` (`sequence_parts`), and its heads
when `tensor` splits them.
"""

import functools
import typing
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
# Query heads per program of the forward and of the backward kernel: they share the
# program's reads of the keys and entries. With eight, V4's shapes exceeded the TPU
# compiler's default scoped on-core memory: the backward kernel's with a float32 cotangent,
# the forward kernel's in a V4-Flash train step's forward pass (not in the same kernel
# compiled alone). Four heads leave room in both.
HEAD_GROUP = 4
BACKWARD_HEAD_GROUP = 4

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
    (`Policy.attention_kernel`), whose output and gradient equal the plain form's within
    float rounding (its output in `qb`'s dtype, the plain form's in float32).

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
    kernel = functools.partial(_fused, platform_of(qb) != "tpu")  # the interpreter off TPUs
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


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _fused(interpret, qb, keys, valid, c_valid, compressed, sinks):
    return _forward(interpret, qb, keys, valid, c_valid, compressed, sinks)[0]


def _fused_fwd(interpret, *args):
    out, lse = _forward(interpret, *args)
    return out, (args, out, lse)


def _fused_bwd(interpret, residuals, cotangent):
    args, out, lse = residuals
    return _backward(interpret, *args, out, lse, cotangent)


_fused.defvjp(_fused_fwd, _fused_bwd)


class _Layout(typing.NamedTuple):
    # The kernels' operands and their specs over the grid (rows, blocks, groups of heads,
    # steps of entries). The queries (and the output, its cotangent and the queries'
    # gradient) as the model lays them out, `[b, n, q, heads * head_dim]`: a program's block
    # is its group's heads side by side along the lanes, `[queries, group * head_dim]`, each
    # head a lane slice (`_head`). With the heads ahead of the queries, each of these was a
    # transposed copy in memory.
    inputs: list
    specs: list
    group: int
    steps: int
    block: int  # entries per step (0: none)


def _layout(qb, keys, valid, c_valid, compressed, sinks, heads: int) -> _Layout:
    # `heads` per program where they divide the heads, else all of them.
    b, nb, bq, h, k = qb.shape
    width = keys.shape[2]
    group = heads if h % heads == 0 else h
    inputs = [
        sinks.astype(jnp.float32),
        qb.reshape(b, nb, bq, h * k),
        keys,
        valid.astype(jnp.float32)[:, :, None, :],
    ]
    specs = [
        pl.BlockSpec(memory_space=pltpu.SMEM),
        _lanes(group, bq, k),
        pl.BlockSpec((None, None, width, k), lambda i, n, g, c: (i, n, 0, 0)),
        pl.BlockSpec((None, None, 1, width), lambda i, n, g, c: (i, n, 0, 0)),
    ]
    if compressed is None:
        return _Layout(inputs, specs, group, 1, 0)
    m = compressed.shape[1]
    steps = -(-m // ENTRY_BLOCK)
    # Equal steps of whole 128-lane tiles (or one step of them all): the least padding.
    block = m if steps == 1 else -(-m // (steps * 128)) * 128
    pad = steps * block - m
    inputs += [
        jnp.pad(compressed, ((0, 0), (0, pad), (0, 0))),
        jnp.pad(c_valid.astype(jnp.float32), ((0, 0),) * 3 + ((0, pad),)),
    ]
    specs += [
        pl.BlockSpec((None, block, k), lambda i, n, g, c: (i, c, 0)),
        pl.BlockSpec((None, None, bq, block), lambda i, n, g, c: (i, n, 0, c)),
    ]
    return _Layout(inputs, specs, group, steps, block)


def _per_head(group, bq, last):  # [b, n, h, q, last], a group of heads per program
    return pl.BlockSpec((None, None, group, bq, last), lambda i, n, g, c: (i, n, g, 0, 0))


def _lanes(group, bq, k):  # [b, n, q, h * k], a group of heads per program
    return pl.BlockSpec((None, None, bq, group * k), lambda i, n, g, c: (i, n, 0, g))


def _head(g: int, k: int) -> tuple:
    # Head `g` of a `_lanes` block: its lane slice.
    return (slice(None), pl.ds(g * k, k))


def _cost(layout: _Layout, inputs, qb, keys, written: int, products: int) -> pl.CostEstimate:
    # Every operand of `inputs` read once, the entries once more per further group of heads,
    # `written` bytes written; `products` matmuls over each query's keys and entries.
    b, nb, bq, h, k = qb.shape
    reads = sum(x.size * x.dtype.itemsize for x in inputs)
    if layout.block:
        entries = layout.inputs[4]
        reads += (h // layout.group - 1) * nb * entries.size * entries.dtype.itemsize
    seen = keys.shape[2] + layout.steps * layout.block
    return pl.CostEstimate(
        flops=2 * products * b * nb * bq * h * seen * k,
        transcendentals=b * nb * bq * h * seen,
        bytes_accessed=reads + written,
    )


def _forward(interpret, qb, keys, valid, c_valid, compressed, sinks):
    # The output [b, n, q, h, k] and each query's log denominator [b, n, h, q, 1] (the
    # backward kernel's residual). The output in the queries' dtype, which the caller takes
    # (`nn.attend`): written so, not as float32 converted after; the backward kernel reads
    # it so too (`_backward`).
    b, nb, bq, h, k = qb.shape
    dtype = qb.dtype
    layout = _layout(qb, keys, valid, c_valid, compressed, sinks, HEAD_GROUP)
    group = layout.group
    out, lse = pl.pallas_call(
        functools.partial(_forward_kernel, scale=k**-0.5, steps=layout.steps),
        out_shape=(
            jax.ShapeDtypeStruct((b, nb, bq, h * k), dtype),
            jax.ShapeDtypeStruct((b, nb, h, bq, 1), jnp.float32),
        ),
        grid=(b, nb, h // group, layout.steps),
        in_specs=layout.specs,
        out_specs=(_lanes(group, bq, k), _per_head(group, bq, 1)),
        scratch_shapes=[
            pltpu.VMEM((group, bq, 128), jnp.float32),  # running maximum, lane-broadcast
            pltpu.VMEM((group, bq, 128), jnp.float32),  # running denominator
            pltpu.VMEM((group, bq, k), jnp.float32),  # running output
        ],
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")
        ),
        cost_estimate=_cost(
            layout,
            layout.inputs,
            qb,
            keys,
            b * nb * h * bq * (k * jnp.dtype(dtype).itemsize + 4),
            2,
        ),
        interpret=interpret,
        name="window_and_entries_attention",
    )(*layout.inputs)
    return out.reshape(b, nb, bq, h, k), lse


def _backward(interpret, qb, keys, valid, c_valid, compressed, sinks, out, lse, cotangent):
    # The gradients of `_forward`'s output: the queries', each block's keys' (K = V: as keys
    # and as values), the entries' (each block's and group's share, summed here) and the
    # sinks' (from the residuals: a sink's probability times the output's cotangent along
    # the output, negated).
    b, nb, bq, h, k = qb.shape
    width = keys.shape[2]
    layout = _layout(qb, keys, valid, c_valid, compressed, sinks, BACKWARD_HEAD_GROUP)
    group, steps, block = layout.group, layout.steps, layout.block
    # In the queries' dtype: the products take it so (as the plain form's do), and in
    # float32 its blocks would double in the core's memory.
    d_out = cotangent.reshape(b, nb, bq, h * k).astype(qb.dtype)
    # The output whole, from which the kernel takes D_i = dO_i . O_i (which every
    # probability's gradient subtracts) and writes it out for the sinks' gradient: computed
    # here, heads ahead of the queries, its operands were relaid out in memory first. The
    # output is in the queries' dtype (16-bit in a bf16 model, as FlashAttention's backward
    # reads it): the cotangent dO is no wider, and a float32 copy kept for D alone was
    # written and read again in every layer.
    inputs = [*layout.inputs, lse, d_out, out.reshape(b, nb, bq, h * k)]
    specs = [*layout.specs, _per_head(group, bq, 1), _lanes(group, bq, k), _lanes(group, bq, k)]
    out_shape = [
        jax.ShapeDtypeStruct((b, nb, bq, h * k), qb.dtype),  # summed in float32 (scratch)
        jax.ShapeDtypeStruct((b, nb, width, k), jnp.float32),
        jax.ShapeDtypeStruct((b, nb, h, bq, 1), jnp.float32),
    ]
    out_specs = [
        _lanes(group, bq, k),
        pl.BlockSpec((None, None, width, k), lambda i, n, g, c: (i, n, 0, 0)),
        _per_head(group, bq, 1),
    ]
    if block:  # each program's share of the entries' gradient: [b, n, groups, entries, k]
        shape = (b, nb, h // group, steps * block, k)
        out_shape.append(jax.ShapeDtypeStruct(shape, jnp.float32))
        spec = pl.BlockSpec((None, None, None, block, k), lambda i, n, g, c: (i, n, g, c, 0))
        out_specs.append(spec)
    written = sum(s.size * jnp.dtype(s.dtype).itemsize for s in out_shape)
    grads = pl.pallas_call(
        functools.partial(_backward_kernel, scale=k**-0.5, steps=steps, with_entries=bool(block)),
        out_shape=out_shape,
        grid=(b, nb, h // group, steps),
        in_specs=specs,
        out_specs=out_specs,
        scratch_shapes=[pltpu.VMEM((bq, group * k), jnp.float32)],  # the queries' gradient
        compiler_params=pltpu.CompilerParams(
            # The keys' gradient adds up over the groups of heads: in order.
            dimension_semantics=("parallel", "parallel", "arbitrary", "arbitrary")
        ),
        cost_estimate=_cost(layout, inputs, qb, keys, written, 5),
        interpret=interpret,
        name="window_and_entries_attention_grad",
    )(*inputs)
    d_q = grads[0].reshape(b, nb, bq, h, k)
    d_keys = grads[1].astype(keys.dtype)
    along = grads[2]
    d_entries = None
    if block:
        m = compressed.shape[1]
        d_entries = jnp.sum(grads[3], axis=(1, 2))[:, :m].astype(compressed.dtype)
    sink_probs = jnp.exp(sinks.astype(jnp.float32)[None, None, :, None] - lse[..., 0])
    d_sinks = -jnp.sum(sink_probs * along[..., 0], axis=(0, 1, 3)).astype(sinks.dtype)
    return d_q, d_keys, None, None, d_entries, d_sinks


def _products(q_ref):
    f32 = jnp.float32
    # Named, not the configured default: Mosaic refuses a float32 contraction of 16-bit
    # operands, whose products are exact in one pass anyway.
    exact = jax.lax.Precision.HIGHEST if q_ref.dtype == f32 else jax.lax.Precision.DEFAULT

    def product(a, b, contract):  # a [r, x] . b: a's dim 1 against b's dim `contract`
        dims = (((1,), (contract,)), ((), ()))
        return jax.lax.dot_general(a, b, dims, exact, preferred_element_type=f32)

    def scores(q, keys):  # [queries, k] x [keys, k] -> [queries, keys]
        return product(q, keys, 1)

    def values(p, keys):  # [queries, keys] x [keys, k] -> [queries, k]
        return product(p.astype(keys.dtype), keys, 0)

    def transposed(a, b):  # [r, x] x [r, y] -> a^T . b [x, y]
        dims = (((0,), (0,)), ((), ()))
        a = a.astype(b.dtype)
        return jax.lax.dot_general(a, b, dims, exact, preferred_element_type=f32)

    return scores, values, transposed


def _window_seen(bq, width, valid_ref):
    # Query i sees key j of its block's keys for i < j <= i + width - bq, where valid.
    i = jax.lax.broadcasted_iota(jnp.int32, (bq, width), 0)
    j = jax.lax.broadcasted_iota(jnp.int32, (bq, width), 1)
    return (i < j) & (j <= i + (width - bq)) & (valid_ref[...] > 0.5)


def _forward_kernel(sinks_ref, q_ref, k_ref, valid_ref, *refs, scale, steps):
    if len(refs) == 7:
        c_ref, seen_ref, o_ref, lse_ref, max_ref, den_ref, acc_ref = refs
    else:
        c_ref = seen_ref = None
        o_ref, lse_ref, max_ref, den_ref, acc_ref = refs
    # Read outside the conditional blocks, which Pallas' interpreter cannot read them in.
    k = k_ref.shape[-1]
    group = q_ref.shape[-1] // k
    step, first_head = pl.program_id(3), pl.program_id(2) * group
    scores, values, _ = _products(q_ref)

    def lanes(x):  # [queries, 1] -> [queries, 128]
        return jnp.broadcast_to(x, (x.shape[0], 128))

    @pl.when(step == 0)
    def _window():
        keys = k_ref[...]
        seen = _window_seen(q_ref.shape[0], keys.shape[0], valid_ref)
        for g in range(group):
            s = jnp.where(seen, scores(q_ref[_head(g, k)], keys) * scale, -jnp.inf)
            sink = sinks_ref[first_head + g]
            top = jnp.maximum(jnp.max(s, axis=1, keepdims=True), sink)
            p = jnp.exp(s - top)
            max_ref[g] = lanes(top)
            den_ref[g] = lanes(jnp.sum(p, axis=1, keepdims=True) + jnp.exp(sink - top))
            acc_ref[g] = values(p, keys)

    if c_ref is not None:
        entries = c_ref[...]
        seen = seen_ref[...] > 0.5
        for g in range(group):
            s = jnp.where(seen, scores(q_ref[_head(g, k)], entries) * scale, -jnp.inf)
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
            den = den_ref[g][:, :1]
            o_ref[_head(g, k)] = (acc_ref[g] / den).astype(o_ref.dtype)
            lse_ref[g] = max_ref[g][:, :1] + jnp.log(den)


def _backward_kernel(sinks_ref, q_ref, k_ref, valid_ref, *refs, scale, steps, with_entries):
    # dS = P (dP - D) with dP = dO . V: the queries' gradient is scale dS . K, summed over
    # the steps in `dq_acc` (float32) and written out in the queries' dtype after the last;
    # a key's, scale dS^T . Q as a key plus P^T . dO as a value (the same rows: K = V).
    del sinks_ref  # in the log denominators already
    if with_entries:
        c_ref, seen_ref, lse_ref, do_ref, o_ref, dq_ref, dk_ref, along_ref, dc_ref, dq_acc = refs
    else:
        c_ref = seen_ref = dc_ref = None
        lse_ref, do_ref, o_ref, dq_ref, dk_ref, along_ref, dq_acc = refs
    # Read outside the conditional blocks, which Pallas' interpreter cannot read them in.
    step, first_group = pl.program_id(3), pl.program_id(2) == 0
    k = k_ref.shape[-1]
    group = q_ref.shape[-1] // k
    scores, values, transposed = _products(q_ref)

    def grads(g, rows, seen):  # head g against `rows` (keys or entries): dS and P
        s = jnp.where(seen, scores(q_ref[_head(g, k)], rows) * scale, -jnp.inf)
        p = jnp.exp(s - lse_ref[g])
        d_s = p * (scores(do_ref[_head(g, k)].astype(rows.dtype), rows) - along_ref[g])
        return d_s, p

    @pl.when(step == 0)
    def _window():
        keys = k_ref[...]
        seen = _window_seen(q_ref.shape[0], keys.shape[0], valid_ref)
        d_k = jnp.zeros(dk_ref.shape, jnp.float32)
        for g in range(group):
            # D_i = dO_i . O_i of head g's queries, once: the later steps read it back from
            # its output block, which stays in the core while the program's steps run.
            d_o, o = (r[_head(g, k)].astype(jnp.float32) for r in (do_ref, o_ref))
            along_ref[g] = jnp.sum(d_o * o, axis=1, keepdims=True)
            d_s, p = grads(g, keys, seen)
            q, d_o = q_ref[_head(g, k)], do_ref[_head(g, k)].astype(keys.dtype)
            dq_acc[_head(g, k)] = values(d_s, keys) * scale
            d_k += transposed(d_s, q) * scale + transposed(p, d_o)
        dk_ref[...] = jnp.where(first_group, d_k, dk_ref[...] + d_k)

    if c_ref is not None:
        entries = c_ref[...]
        seen = seen_ref[...] > 0.5
        d_c = jnp.zeros(dc_ref.shape, jnp.float32)
        for g in range(group):
            d_s, p = grads(g, entries, seen)
            dq_acc[_head(g, k)] += values(d_s, entries) * scale
            d_o = do_ref[_head(g, k)].astype(entries.dtype)
            d_c += transposed(d_s, q_ref[_head(g, k)]) * scale + transposed(p, d_o)
        dc_ref[...] = d_c

    @pl.when(step == steps - 1)
    def _out():
        dq_ref[...] = dq_acc[...].astype(dq_ref.dtype)
