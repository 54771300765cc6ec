"""Writing rows of a cache: a scatter, or on a backend that widens 16-bit floats a few
conditional dynamic updates (a decode step's writes), in place."""

import jax
from jaxtyping import Array, Float, Int

from ._mesh import batch_axes
from ._policy import Policy, resolve


def set_rows(
    a: Float[Array, "..."],
    index: tuple[Int[Array, "..."], Int[Array, "..."]],
    values: Float[Array, "..."],
    policy: Policy | None,
    *,
    layer: Int[Array, ""] | int | None = None,
) -> Float[Array, "..."]:
    """`a.at[index].set(values, mode="drop")` for `index = (rows, cols)`, both non-negative: row
    `cols[w]` of sequence `rows[w]` becomes `values[w]`; an index past the end writes nothing.
    With `layer`, `a` is a stack of such arrays (a layer stack's cache, `[layers, batch,
    length, ...]`) and the rows are written into its layer `layer`, in place.

    Where `policy` widens `a`'s dtype, a few rows (`Policy.few_writes`) are written as dynamic
    updates (`set_rows_by_updates`), not with the batch split over devices (where an update at
    a traced row could gather the array). `None`: the policy of the target platform.
    """
    values = values.astype(a.dtype)
    rows, cols = index
    lead = () if layer is None else (layer,)
    if a.shape[len(lead) + 1] == 0:
        # No rows to write (e.g. HCA entries of a sequence shorter than one block): JAX cannot
        # differentiate a scatter into an empty axis.
        return a
    policy = resolve(policy)
    batch = a.shape[len(lead)]
    if not policy.narrow(a) or rows.size > policy.few_writes or batch_axes(batch):
        return a.at[(*lead, rows, cols)].set(values, mode="drop")
    return set_rows_by_updates(a, lead, rows, cols, values)


def set_rows_by_updates(
    a: Float[Array, "..."],
    lead: tuple[Int[Array, ""] | int, ...],
    rows: Int[Array, "..."],
    cols: Int[Array, "..."],
    values: Float[Array, "..."],
) -> Float[Array, "..."]:
    """`a.at[(*lead, rows, cols)].set(values, mode="drop")` as one conditional dynamic update
    per row, in place. XLA:CPU runs a 16-bit array's scatter in float32, converting the whole
    array there and back: a decode step's cache writes read and wrote each cache twice."""
    batch, length = a.shape[len(lead) : len(lead) + 2]
    zeros = (0,) * (a.ndim - len(lead) - 2)
    values = values.reshape(-1, *(1,) * (len(lead) + 2), *a.shape[len(lead) + 2 :])

    def write(a, v, r, c):
        return jax.lax.dynamic_update_slice(a, v, (*lead, r, c, *zeros))

    def keep(a, v, r, c):
        return a

    for r, c, v in zip(rows.reshape(-1), cols.reshape(-1), values, strict=True):
        # Conditional: writing back the old row instead (a select of the update against a
        # dynamic slice of `a`) XLA:CPU computed in float32, and inside a loop (a scanned
        # stack's cache) it then updated a copy of the whole array.
        a = jax.lax.cond((r < batch) & (c < length), write, keep, a, v, r, c)
    return a
