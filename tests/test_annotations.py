"""The package's own jaxtyping annotations, internal ones included, hold on its main paths.

The public entry points check theirs at every call (a `TypeError` naming the argument). Every
other annotated function is checked here: one fresh process imports the package under jaxtyping's
import hook (beartype the checker) and traces, from shapes only (`eqx.filter_eval_shape`: the
checks run at trace time, nothing compiles), the forward pass, the cached prefill and decode
step, plain and speculative generation steps (MTP and DSpark drafters), and train steps of the
full, the LoRA-adapted and the FP8/FP4-quantised model. The suite itself runs without the hook,
which checks every call of every traced function again in each of its programs."""

import json
import textwrap

from helpers import run_python, short_tiny, succeeded


PATHS = textwrap.dedent(
    """
    import dataclasses
    import json
    import sys

    from jaxtyping import install_import_hook

    with install_import_hook("equinox_dsv4", "beartype.beartype"):
        import equinox_dsv4 as ed

    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import numpy as np

    # `helpers.short_tiny`: every kind of layer and both drivers in the fewest blocks to trace
    # (layers of one kind trace the same functions), the embedded tiny model's MTP block.
    config = ed.Config.from_hf(json.loads(sys.argv[1]), scan_min_repeats=2)
    model = eqx.filter_eval_shape(ed.DeepseekV4, config, key=jax.random.key(0))
    # The same trunk with a DSpark drafter (V4-Flash-0731's layout), whose stages replace MTP.
    spark = dataclasses.replace(
        config,
        dspark_block_size=3,
        dspark_markov_rank=8,
        dspark_target_layer_ids=(2, 3, 4),
        dspark_noise_token_id=96,
        dspark_stages=2,
    )
    spark = eqx.filter_eval_shape(ed.DeepseekV4, spark, key=jax.random.key(0))
    ids = jnp.ones((2, 12), jnp.int32)
    lengths = jnp.array([12, 7], jnp.int32)
    greedy = ed.Sampling()

    # Every path below is traced from shapes only: the annotations are checked, nothing is
    # compiled.
    eqx.filter_eval_shape(lambda m, x: m(x), model, ids)

    def decode(m):
        cache = m.init_cache(batch=2, max_len=64)
        logits, cache = m.decode(ids, cache, num_tokens=lengths)
        return m.decode(ids[:, :1], cache)

    eqx.filter_eval_shape(decode, model)

    def plain(m):
        cache = m.init_cache(batch=2, max_len=64)
        first, cache = ed.inference.prefill(
            m, ids, lengths, cache, jax.random.key(1), greedy, chunk=8, checked=False
        )
        active = jnp.ones(2, jnp.int32)
        return ed.inference.decode_step(
            m, first, active, cache, jax.random.key(2), greedy, checked=False
        )

    eqx.filter_eval_shape(plain, model)

    def speculative(m, drafter):
        depth = drafter.depth(m)
        cache = m.init_cache(2, 64 + depth, rewind=depth)
        drafts = drafter.init(m, 2, 64 + depth, greedy, lambda c: c)
        pending, active = jnp.ones(2, jnp.int32), jnp.ones(2, jnp.int32)
        return ed.inference.speculative_step(
            m, drafter, pending, active, cache, drafts, jax.random.key(3), greedy
        )

    eqx.filter_eval_shape(lambda m: speculative(m, ed.inference.MTPDrafter()), model)
    eqx.filter_eval_shape(lambda m: speculative(m, ed.inference.DSparkDrafter()), spark)

    optimizer = ed.make_optimizer(1e-3, warmup_steps=1, total_steps=2)
    batch = ed.Batch.from_tokens(np.ones((2, 17), np.int32))
    adapted = lambda m: ed.lora.add(m, rank=2, alpha=4.0, key=jax.random.key(4))
    quantized = lambda m: ed.quant.quantize_model(m, block=(32, 32))
    step = ed.make_train_step(optimizer, donate=False)
    for make in (lambda m: m, adapted, quantized):
        state = eqx.filter_eval_shape(lambda m: ed.init_train_state(make(m), optimizer), model)
        eqx.filter_eval_shape(step, state, batch)
    print("traced")
    """
)


def test_internal_annotations_hold_on_the_main_paths():
    config = json.dumps(short_tiny().to_hf())
    result = succeeded(run_python("-c", PATHS, config))
    assert "traced" in result.stdout
