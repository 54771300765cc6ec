"""The programs `python -m equinox_dsv4.compile` lowers beside the prefill and decode step: a
speculative step with the DSpark drafter and a train step, from abstract arrays placed on a
mesh (nothing allocated)."""


def placed(tree, shardings):
    import jax

    return jax.tree.map(
        lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), tree, shardings
    )


def draft_step(model, batch: int, max_len: int, mesh, rows):
    """The lowered speculative step with the DSpark drafter (greedy): the main model verifies
    the pending token and a block of drafts, the verified positions go into the rings, the
    drafter drafts the next block; caches donated."""
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec

    import equinox_dsv4 as ed

    drafter, greedy = ed.inference.DSparkDrafter(), ed.Sampling()
    depth = drafter.depth(model)
    state = eqx.filter_eval_shape(
        lambda m: drafter.init(m, batch, max_len, greedy, lambda c: c), model
    )
    rings = placed(state.rings, ed.parallel.cache_shardings(state.rings, mesh))
    state = eqx.tree_at(lambda s: s.rings, state, rings)
    state = jax.tree.map(
        lambda a: (
            a if a.sharding is not None else jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=rows)
        ),
        state,
    )
    cache = eqx.filter_eval_shape(
        lambda m: m.init_cache(batch, max_len + depth, rewind=depth), model
    )
    cache = placed(cache, ed.parallel.cache_shardings(cache, mesh))
    vector = NamedSharding(mesh, PartitionSpec(ed.execution.batch_axes(batch)))
    pending = jax.ShapeDtypeStruct((batch,), jnp.int32, sharding=vector)
    key = jax.eval_shape(lambda: jax.random.key(0))

    def step(model, pending, active, cache, state, key):
        return ed.inference.speculative_step(
            model, drafter, pending, active, cache, state, key, greedy
        )

    return jax.jit(step, donate_argnums=(3, 4)).lower(model, pending, pending, cache, state, key)


def train_step(model, batch: int, tokens: int, rows, remat: str | None, micro_batches: int):
    """The lowered training step (AdamW, per-layer remat `remat`, `micro_batches` of gradient
    accumulation) on `batch` sequences of `tokens`; the optimizer state placed with the
    parameters' shardings."""
    import equinox as eqx
    import jax
    import jax.numpy as jnp

    import equinox_dsv4 as ed

    optimizer = ed.make_optimizer(1e-4, warmup_steps=1, total_steps=10)
    state = ed.train.abstract_train_state(model, optimizer)
    ids = jax.ShapeDtypeStruct((batch, tokens + 1), jnp.int32, sharding=rows)
    data = jax.tree.map(
        lambda leaf: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=rows),
        eqx.filter_eval_shape(ed.Batch.from_tokens, ids),
    )
    step = ed.make_train_step(optimizer, remat=remat, micro_batches=micro_batches)
    return step.lower(state, data)
