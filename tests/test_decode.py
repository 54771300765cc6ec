"""The compressed KV cache: prefill + one-token decode steps equal one full forward, chunked
prefill equals one prefill, per-sequence positions, no recompilation, cache sizes."""

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import LOGITS, equations, lowered
from hf_reference import FIVE_LAYERS, C, H, S, abstract, random_fill, tiny_config

import equinox_dsv4 as ed
from equinox_dsv4.execution import resolve
from equinox_dsv4.nn import LayerStack


CONFIGS = {
    # window 8, CSA ratio 4, HCA ratio 8, index_topk 3, hc_mult 4, YaRN; a sliding hash-routed
    # layer on its own, then a scanned (CSA, HCA) period (5 layers: every layer kind, both
    # drivers, in three compiled blocks).
    "flash_like": tiny_config(**FIVE_LAYERS, num_nextn_predict_layers=0),
    # window 16 = HCA ratio 16, hc_mult 2, no YaRN, a period-1 CSA scan.
    "pro_like": tiny_config(
        layer_types=(H, C, C, C, H),
        num_hash_layers=1,
        hc_mult=2,
        rope_scaling=None,
        compress_rate_hca=16,
        sliding_window=16,
        index_topk=5,
        num_nextn_predict_layers=0,
    ),
}
LENGTH = 44
# Prefill lengths below, at and above the ratio and window boundaries of each config.
PREFILLS = {"flash_like": [1, 3, 8, 9, 17], "pro_like": [4, 16, 21]}


@pytest.fixture(scope="module")
def setups():
    out = {}
    for name, config in CONFIGS.items():
        model = random_fill(abstract(ed.DeepseekV4, config), seed=len(out))
        if name == "pro_like":
            # Its decode steps gather their picks from the cache's stack, where the default
            # (`Policy.picks_in_place`) would slice out the few entries of this short cache,
            # and the chosen experts from the stacked weights (`Policy.experts_in_place`).
            policy = dataclasses.replace(resolve(None), picks_in_place=1, experts_in_place=True)
            model = ed.execution.with_policy(model, policy)
        ids = np.random.default_rng(len(out)).integers(0, config.vocab_size, (2, LENGTH))
        ids = jnp.asarray(ids, jnp.int32)
        out[name] = model, ids, np.asarray(eqx.filter_jit(model)(ids))
    return out


@eqx.filter_jit
def decode(model, ids, cache, num_tokens=None):
    return model.decode(ids, cache, num_tokens)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_prefill_then_decode_equals_full_forward(setups, name):
    model, ids, full = setups[name]
    for k in PREFILLS[name]:
        cache = model.init_cache(2, LENGTH)
        logits, cache = decode(model, ids[:, :k], cache)
        np.testing.assert_allclose(logits, full[:, :k], **LOGITS)
        for t in range(k, LENGTH):
            logits, cache = decode(model, ids[:, t : t + 1], cache)
            np.testing.assert_allclose(
                logits[:, 0], full[:, t], **LOGITS, err_msg=f"prefill {k}, step {t}"
            )
        np.testing.assert_array_equal(cache.positions, [LENGTH, LENGTH])


def test_prefill_in_chunks_equals_one_prefill(setups):
    model, ids, full = setups["flash_like"]
    cache = model.init_cache(2, LENGTH)
    # Chunks of the prefill lengths above (9, 17, 1, 17), whose programs that test compiled,
    # ending inside a CSA block (4), an HCA block (8) and the window (8) each time.
    for a, b in [(0, 9), (9, 26), (26, 27), (27, LENGTH)]:
        logits, cache = decode(model, ids[:, a:b], cache)
        np.testing.assert_allclose(logits, full[:, a:b], **LOGITS)
    one = decode(model, ids, model.init_cache(2, LENGTH))[1]
    # Other chunkings are other programs, whose float32 sums round differently.
    for x, y in zip(jax.tree.leaves(cache), jax.tree.leaves(one), strict=True):
        np.testing.assert_allclose(x, y, atol=3e-5, rtol=3e-5)


def test_sequences_keep_their_own_positions(setups):
    # Row 0 prefills 13 tokens, row 1 prefills 30, in one padded call; then they decode side by
    # side at different positions. Each row must match its own full forward.
    model, ids, full = setups["flash_like"]
    lengths = np.array([13, 30])
    padded = np.zeros((2, 30), np.int32)
    padded[0, :13], padded[1] = ids[0, :13], ids[1, :30]
    logits, cache = decode(
        model, jnp.asarray(padded), model.init_cache(2, LENGTH), jnp.asarray(lengths, jnp.int32)
    )
    np.testing.assert_allclose(logits[0, :13], full[0, :13], **LOGITS)
    np.testing.assert_allclose(logits[1], full[1, :30], **LOGITS)
    np.testing.assert_array_equal(cache.positions, lengths)
    for step in range(10):
        nxt = jnp.asarray([[ids[0, 13 + step]], [ids[1, 30 + step]]], jnp.int32)
        logits, cache = decode(model, nxt, cache)
        np.testing.assert_allclose(logits[0, 0], full[0, 13 + step], **LOGITS)
        np.testing.assert_allclose(logits[1, 0], full[1, 30 + step], **LOGITS)
    # A row with nothing to add keeps its state.
    logits, after = decode(model, nxt, cache, jnp.asarray([0, 1], jnp.int32))
    np.testing.assert_array_equal(after.positions, cache.positions + np.array([0, 1]))


def test_decode_step_compiles_once(setups):
    model, ids, _ = setups["flash_like"]

    @eqx.filter_jit(donate="all-except-first")
    @eqx.debug.assert_max_traces(max_traces=1)
    def step(model, token, cache):
        logits, cache = model.decode(token, cache)
        return jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32)[:, None], cache

    # The cache and a prefill length of `test_prefill_then_decode_equals_full_forward`: its
    # program is compiled already. 41 steps fill the cache.
    cache = model.init_cache(2, LENGTH)
    _, cache = decode(model, ids[:, :3], cache)
    token = ids[:, 3:4]
    for _ in range(LENGTH - 3):
        token, cache = step(model, token, cache)
    assert int(cache.positions[0]) == LENGTH


def test_cache_is_stacked_like_the_layers(setups):
    model, _, _ = setups["flash_like"]
    cache = model.init_cache(3, 64)
    stack = model.layers[-1]
    assert isinstance(stack, LayerStack) and stack.repeats == 2
    csa, hca = cache.layers[-1]  # [repeats, batch, ...]
    assert hca.ring.shape == (2, 3, 8, 32) and hca.indexer is None
    assert hca.compressor.entries.shape == (2, 3, 64 // 8, 32)
    assert csa.compressor.entries.shape == (2, 3, 64 // 4, 32)
    assert csa.indexer.entries.shape == (2, 3, 64 // 4, 16)
    assert csa.compressor.kv.shape == (2, 3, 8, 64)  # two blocks of Ca | Cb
    assert hca.compressor.kv.shape == (2, 3, 8, 32)
    assert cache.layers[0][0].compressor is None  # sliding-only


def test_an_empty_cache_is_one_program(setups):
    # Every array of an empty cache in one program, kept: not a small program per array shape
    # (batch 5 and 88 tokens: shapes no other test makes), and none the second time.
    model, _, _ = setups["flash_like"]
    start = len(lowered())
    cache = model.init_cache(5, 88, rewind=3)
    assert len(lowered()) - start == 1, lowered()[start:]
    assert all(not np.any(np.asarray(x)) for x in jax.tree.leaves(cache))
    again = model.init_cache(5, 88, rewind=3)
    assert len(lowered()) - start == 1, lowered()[start:]
    assert jax.tree.structure(again) == jax.tree.structure(cache)


# Lowered by hand, the donating steps warn that `active` (int32) is not reused, as their calls
# (filtered by Equinox) would.
@pytest.mark.filterwarnings("ignore:Some donated buffers were not usable")
def test_decoding_past_max_len_is_an_error(setups):
    model, ids, _ = setups["flash_like"]
    # A full cache by the one prefill of `test_prefill_in_chunks_equals_one_prefill`, then a
    # step past it: both programs are compiled already.
    cache = model.init_cache(2, LENGTH)
    _, cache = decode(model, ids, cache)
    with pytest.raises(Exception, match="max_len"):
        jax.block_until_ready(decode(model, ids[:, 8:9], cache))
    with pytest.raises(ValueError, match="positive"):
        model.init_cache(2, 0)
    # The check is a host callback, and only decoding has it: a forward (or a train step) from
    # position 0 cannot overflow, and JAX never writes a program with a host callback to its
    # persistent compilation cache.
    # (The programs of the step above and of the fixture's forward: traced already.)
    assert "callback" in decode.lower(model, ids[:, 8:9], cache).as_text()
    assert "callback" not in eqx.filter_jit(model).lower(ids).as_text()
    # The public prefill and decode step check too; `generate`'s own steps do not (it checks
    # the prompts against `max_len`, and its loop stops each row before the cache is full), so
    # that its programs are reused across processes.
    lengths, key = jnp.array([9, 9], jnp.int32), jax.random.key(0)
    with pytest.raises(Exception, match="max_len"):
        tokens, _ = ed.inference.prefill(
            model, ids[:, :9], lengths, model.init_cache(2, 8), key, ed.Sampling()
        )
        jax.block_until_ready(tokens)
    step = (model, ids[:, 8], jnp.ones(2, jnp.int32), cache, key, ed.Sampling())
    chunk = (model, ids[:, 8:10], jnp.ones(2, jnp.int32), cache, key, ed.Sampling())
    for run, args in ((ed.inference.decode_step, step), (ed.inference.prefill, chunk)):
        for checked in (True, False):
            program = eqx.filter_jit(lambda *a, run=run, c=checked: run(*a, checked=c)).lower(*args)
            assert ("callback" in program.as_text()) == checked, (run, checked)


def test_cache_bytes_by_hand():
    config = tiny_config()
    per_token = ed.inference.cache_bytes_per_token(config, jnp.float32)
    assert per_token == {S: 0.0, C: (32 + 16) * 4 / 4, H: 32 * 4 / 8}
    sizes = ed.inference.cache_bytes(config, 64, batch=1, dtype=jnp.float32)
    # What init_cache allocates (the float32 compressor buffers included).
    model = abstract(ed.DeepseekV4, config)
    cache = eqx.filter_eval_shape(lambda m: m.init_cache(1, 64, jnp.float32), model)
    allocated = sum(np.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(cache))
    assert sizes["compressed"] == allocated - 4  # the positions counter is not cache
    assert sizes["plain_mqa"] == 9 * 64 * 2 * 32 * 4


def test_last_only_logits(setups):
    model, ids, full = setups["flash_like"]
    lengths = jnp.asarray([7, 30], jnp.int32)
    logits, _ = decode_last(model, ids[:, :30], model.init_cache(2, LENGTH), lengths)
    assert logits.shape == (2, 1, model.config.vocab_size)
    np.testing.assert_allclose(logits[0, 0], full[0, 6], **LOGITS)
    np.testing.assert_allclose(logits[1, 0], full[1, 29], **LOGITS)


@eqx.filter_jit
def decode_last(model, ids, cache, num_tokens):
    return model.decode(ids, cache, num_tokens, last_only=True)


def _decode_step(model, max_len: int) -> jax.stages.Compiled:
    """The one-token decode step with the cache donated, as `generate` runs it, compiled for
    `model` (abstract or not) and a cache of `max_len`."""
    cache = eqx.filter_eval_shape(lambda m: m.init_cache(1, max_len), model)
    ids = jax.ShapeDtypeStruct((1, 1), jnp.int32)
    step = jax.jit(lambda m, i, c: m.decode(i, c), donate_argnums=2)
    return step.lower(model, ids, cache).compile()


def _decode_step_temporaries(model, max_len: int) -> int:
    """Temporaries of the one-token decode step with the cache donated, as `generate` runs it."""
    return _decode_step(model, max_len).memory_analysis().temp_size_in_bytes


def _csa_hca_stack(periods: int, scan: bool, **overrides) -> ed.Config:
    """`periods` (CSA, HCA) pairs in one layer stack, scanned or run by the Python loop."""
    return tiny_config(
        layer_types=(C, H) * periods,
        num_hash_layers=0,
        scan_min_repeats=2,
        scan_layers=scan,
        num_nextn_predict_layers=0,
        **overrides,
    )


@pytest.mark.parametrize("scan", [True, False])
def test_decode_gathers_the_picks_from_the_stacked_entries(scan):
    # A decode step with a long cache gathers each CSA layer's picked entries straight from
    # the cache's stack. Sliced out of the stack first, each layer's entries were copied whole
    # every step on the TPU, as XLA did not fuse the slice into the gather
    # (benchmarks/tpu_roofline.py, the 1M-token rows).
    config = _csa_hca_stack(2, scan)
    model = abstract(ed.DeepseekV4, config)
    cache = eqx.filter_eval_shape(lambda m: m.init_cache(1, 4096), model)
    ids = jax.ShapeDtypeStruct((1, 1), jnp.int32)
    jaxpr = eqx.filter_make_jaxpr(lambda m, i, c: m.decode(i, c))(model, ids, cache)[0]
    layer = (1, 4096 // config.compress_rate_csa, config.head_dim)  # one layer's entries
    all_equations = list(equations(jaxpr.jaxpr))
    whole = [
        e
        for e in all_equations
        if e.primitive.name in ("slice", "dynamic_slice") and e.outvars[0].aval.shape[-3:] == layer
    ]
    assert not whole, [str(e)[:200] for e in whole]
    gathers = [
        e
        for e in all_equations
        if e.primitive.name == "gather"
        and e.invars[0].aval.shape[-3:] == layer
        and e.invars[0].aval.ndim == 4
    ]
    assert gathers  # from the stack, [layers, batch, entries, head_dim]


@pytest.mark.parametrize("scan", [True, False])
def test_decode_reads_the_chosen_experts_from_the_stacked_weights(scan):
    # Under the TPU policy (`Policy.experts_in_place`) a one-sequence decode step on fsdp x
    # expert reads each layer's few chosen experts straight from the stacked weights, one
    # dynamic slice per product. Sliced out of the stack first, every layer's experts were
    # copied whole every step by the TPU compiler, and gathered, the chosen ones copied again
    # (benchmarks/tpu_roofline.py, the 1M-token batch-1 row).
    config = _csa_hca_stack(2, scan, n_routed_experts=12, moe_intermediate_size=16)
    policy = ed.execution.Policy.for_platform("tpu")
    model = ed.execution.with_policy(abstract(ed.DeepseekV4, config), policy)
    cache = eqx.filter_eval_shape(lambda m: m.init_cache(1, 64), model)
    ids = jax.ShapeDtypeStruct((1, 1), jnp.int32)
    mesh = ed.make_mesh(fsdp=4, expert=2)
    with jax.set_mesh(mesh):
        jaxpr = eqx.filter_make_jaxpr(lambda m, i, c: m.decode(i, c))(model, ids, cache)[0]
    e, f, d = config.n_routed_experts, config.moe_intermediate_size, config.hidden_size
    all_equations = list(equations(jaxpr.jaxpr))
    local = e // 2  # the experts of a device
    copies = [  # a layer's every expert out of the stack, or the chosen ones gathered
        eq
        for eq in all_equations
        if eq.outvars[0].aval.shape in ((e, f, d), (e, d, f))
        or (eq.primitive.name == "gather" and local in eq.invars[0].aval.shape[-4:-2])
    ]
    assert not copies, [str(eq)[:200] for eq in copies]
    slices = [  # inside the shard_map: [layers, local experts, rows, columns]
        eq
        for eq in all_equations
        if eq.primitive.name == "dynamic_slice"
        and eq.invars[0].aval.ndim == 4
        and eq.invars[0].aval.shape[1] == local
    ]
    traced = 2 if scan else 4  # MoE layers traced: the scanned period's, or every layer's
    top_k = config.num_experts_per_tok
    assert len(slices) == traced * 3 * top_k  # w1, w3, w2 for each of the token's experts


# Unrolled layers, as in the small config of the benchmarks (no layer scan): one of each kind.
BF16_CONFIG = tiny_config(
    layer_types=(S, C, H), num_hash_layers=1, scan_min_repeats=100, num_nextn_predict_layers=0
)
# A cache long enough that a conversion of it would dominate a step's temporaries.
BF16_MAX_LEN = 4096


@pytest.fixture(scope="module")
def bf16_step():
    """A bf16 model under this machine's policy and its decode step, compiled once for both
    tests below: one measures its temporaries, the other runs it."""
    model = random_fill(abstract(ed.DeepseekV4, BF16_CONFIG, dtype=jnp.bfloat16), seed=3)
    cpu = ed.execution.Policy.for_platform("cpu")
    model = ed.execution.with_policy(model, cpu)
    return model, _decode_step(model, BF16_MAX_LEN)


def test_bf16_cache_writes_do_not_convert_the_cache(bf16_step):
    # XLA:CPU ran a bf16 scatter in float32, converting each compressed cache there and back
    # every step: with every write a scatter (`Policy.few_writes` below any count), this step
    # holds more than twice float32's temporaries. `set_rows` writes a step's few rows in place
    # (benchmarks/archive/NOTES.md, Round 9).
    f32 = _decode_step_temporaries(abstract(ed.DeepseekV4, BF16_CONFIG), BF16_MAX_LEN)
    bf16 = bf16_step[1].memory_analysis().temp_size_in_bytes
    assert bf16 < 2 * f32, (bf16, f32)


def test_bf16_decode_equals_the_scatter_writes(bf16_step):
    # The same bf16 decode with every cache write a scatter (`Policy.few_writes` below any
    # count): bit for bit the same caches and logits.
    model, cpu_step = bf16_step
    ids = np.random.default_rng(3).integers(0, BF16_CONFIG.vocab_size, (1, 24))
    ids = jnp.asarray(ids, jnp.int32)

    def run(placed, step):  # one token a step, so that every write is a decode step's
        cache, out = placed.init_cache(1, BF16_MAX_LEN), []
        for t in range(ids.shape[1]):
            logits, cache = step(placed, ids[:, t : t + 1], cache)
            out.append(logits)
        return out, cache

    cpu = model.policy
    assert cpu.widen_16bit and cpu.few_writes >= 1
    ours = run(model, cpu_step)
    scatter = ed.execution.with_policy(model, dataclasses.replace(cpu, few_writes=-1))
    scattered = run(scatter, _decode_step(scatter, BF16_MAX_LEN))
    for got, want in zip(jax.tree.leaves(ours), jax.tree.leaves(scattered), strict=True):
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


@pytest.mark.parametrize("scan", [True, False])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_stacked_cache_is_updated_in_place(dtype, scan):
    # A decode step through a layer stack (scanned or unrolled) wrote a new copy of the whole
    # stack's cache every token: sliced out per layer, then stacked anew (the small config at
    # 43 layers and a 64k context: 285 MiB of temporaries against a 263 MiB cache). In bf16, a
    # write that wrote the old row back for a dropped index also copied the stack. From 256 to
    # 4096 tokens the temporaries grew by more than the cache (archive/NOTES.md, items 32-33);
    # now by a small part of it: a layer's index keys and HCA entries, copied out of the stack
    # for their products (bf16: the HCA entries converted to float32 there). Two periods: the
    # fewest layers that make a stack.
    config = _csa_hca_stack(2, scan)
    model = abstract(ed.DeepseekV4, config, dtype=dtype)
    assert [type(layer) for layer in model.layers] == [LayerStack]

    def cache_bytes(max_len):
        cache = eqx.filter_eval_shape(lambda m: m.init_cache(1, max_len), model)
        return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(cache))

    grown = _decode_step_temporaries(model, 4096) - _decode_step_temporaries(model, 256)
    assert grown < (cache_bytes(4096) - cache_bytes(256)) / 3, grown
