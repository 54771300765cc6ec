"""python -m equinox_dsv4.compile: compile a full-size prefill and decode step without weights.

Builds the model abstractly (`eqx.filter_eval_shape`, nothing allocated), places it on a mesh
of N devices (simulated CPU devices unless real ones exist) by the sharding rules, lowers and
compiles a prefill of `--prefill` tokens and one decode step with the compressed KV cache, and
prints XLA's per-device memory analysis (arguments, outputs, temporaries, generated code), the
cost analysis (FLOPs, bytes accessed) and the compile times. This is how to check that a model
and mesh fit before renting the hardware.

With `--topology` the programs are compiled for chips that need not be here (`pip install -e
'.[aot]'`): a TPU topology (e.g. `v5p:4x4x4`) by XLA's TPU compiler through libtpu, or NVIDIA
GPUs (`h100:8`, `h200:8`, `b200:16`: a node of 8 or whole nodes) by XLA's GPU compiler
through the CUDA plugin, from the committed target configuration of that GPU
(`equinox_dsv4/compile/gpus/`) or `--target-config` (one captured from a real GPU). The
memory figures are then the chip's, per chip; a GPU program that needs more than the GPU's
memory (arguments + outputs + temporaries - aliased) is refused (exit 1, naming the phase).
The table adds a roofline estimate at the chip's published peak (`TPU_PEAKS`, `GPU_PEAKS`):
the step's time as `max(FLOPs / peak, bytes accessed / HBM bandwidth)` from XLA's cost
analysis, and the MFU that time gives the step's useful FLOPs (`train_flops`,
`forward_flops`). XLA counts a loop's body once, so the estimate covers every layer only with
`--unrolled`, and even then the experts' loop within a layer counts once: an upper bound on
the MFU, printed for unrolled programs only. XLA's GPU compiler counts no FLOPs: no estimate.

`--quantized` keeps the release's FP8/FP4 weights quantised, as
`convert.load_hf(..., quantized=True)` does. `--train` compiles one training step instead
(`make_train_step`: AdamW with its moments placed as the parameters, per-layer `--remat`,
`--micro-batches` of gradient accumulation) on `--batch` sequences of `--seq-len` tokens;
with `--lora RANK`, of LoRA adapters of that rank on the default targets (`ed.lora.add`; with
`--quantized`, QLoRA), the base frozen, the optimizer's moments of the adapters only.

    python -m equinox_dsv4.compile --model v4-flash --devices 64 --mesh fsdp=8,expert=8
    python -m equinox_dsv4.compile --model v4-flash --topology v5p:4x4x4 --quantized
    python -m equinox_dsv4.compile --model v4-pro --topology h200:8 --mesh expert=8 --quantized
    python -m equinox_dsv4.compile --train --topology v5p:4x8x8 --mesh fsdp=32,expert=8 \
        --seq-len 4096 --batch 32
    python -m equinox_dsv4.compile --train --lora 16 --quantized --topology v5p:2x2x1 \
        --mesh fsdp=1,expert=4 --seq-len 4096 --batch 1
"""

import argparse
import json
import sys
import time

from ..parallel import AXES, parse_mesh, parse_rules
from ._programs import draft_step, placed, train_step
from ._report import estimate, print_table
from ._targets import Target, target


MODELS = ("v4-flash", "v4-pro", "v4-flash-0731", "tiny")
PHASES = ("prefill", "decode", "draft", "train")


def parse_policy(texts: list[str]) -> dict[str, object]:
    """`["experts=ragged", "stationary_rows=0"]` -> `Policy` field overrides, each value in its
    field's type."""
    import dataclasses

    from ..execution import Policy

    fields = {f.name: f for f in dataclasses.fields(Policy)}
    out: dict[str, object] = {}
    for text in texts:
        name, sep, value = text.partition("=")
        field = fields.get(name)
        if not sep or field is None or name == "platform":
            raise ValueError(
                f"bad --policy {text!r}: use FIELD=VALUE with FIELD one of "
                f"{sorted(set(fields) - {'platform'})}"
            )
        default = field.default
        if isinstance(default, bool):
            if value not in ("true", "false"):
                raise ValueError(f"bad --policy {text!r}: {name} is true or false")
            out[name] = value == "true"
        elif isinstance(default, int):
            if not value.lstrip("-").isdigit():
                raise ValueError(f"bad --policy {text!r}: {name} is an integer")
            out[name] = int(value)
        else:
            out[name] = value
    return out


def parse_args(
    argv: list[str] | None = None,
) -> tuple[argparse.Namespace, dict[str, int], list[str]]:
    """The command line `argv` as `run` takes it: `(args, mesh_shape, phases)`; a bad flag
    exits with argparse's usage message."""
    parser = argparse.ArgumentParser(
        prog="python -m equinox_dsv4.compile",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--model", choices=MODELS, default="v4-flash")
    parser.add_argument("--devices", type=int, default=64, help="simulated CPU devices")
    parser.add_argument("--mesh", default="fsdp=8,expert=8", help="e.g. fsdp=8,expert=8")
    parser.add_argument(
        "--prefill",
        "--seq-len",
        dest="prefill",
        type=int,
        default=4096,
        help="tokens per sequence of the prefill and of the train step",
    )
    parser.add_argument("--batch", type=int, help="sequences (default: data x fsdp)")
    parser.add_argument("--max-len", type=int, help="cache length (default: prefill + 256)")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--mtp", action="store_true", help="include the MTP block's weights")
    parser.add_argument(
        "--unrolled",
        action="store_true",
        help="every layer unrolled (Config.scan_layers=False): XLA's cost analysis counts a "
        "loop's body once, so only an unrolled program's FLOPs and bytes cover every layer",
    )
    parser.add_argument(
        "--topology",
        help="compile for the chips of this TPU topology (e.g. v5p:4x4x4) or these NVIDIA GPUs "
        "(h100:8, h200:8, b200:8; more than 8: whole nodes) instead of simulated CPU devices "
        "(needs the aot extra, not the chips); the mesh must use all of them",
    )
    parser.add_argument(
        "--target-config",
        metavar="FILE",
        help="a GPU topology's GpuTargetConfigProto text (e.g. captured on a real GPU with "
        "jax._src.lib.xla_client.get_topology_for_devices(jax.devices()).target_config) instead "
        "of the committed one for its GPU",
    )
    parser.add_argument(
        "--quantized",
        action="store_true",
        help="the release's FP8/FP4 weights kept quantised (values and ue8m0 scales)",
    )
    parser.add_argument(
        "--phases",
        default="prefill,decode",
        help="comma-separated: prefill, decode, draft (a speculative step with the model's "
        "DSpark drafter, e.g. --model v4-flash-0731), train",
    )
    parser.add_argument("--train", action="store_true", help="the train step only (--phases train)")
    parser.add_argument(
        "--remat",
        choices=("dots", "nothing", "none"),
        default="dots",
        help="the train step's rematerialisation policy per layer (REMAT_POLICIES; 'none': keep "
        "every activation)",
    )
    parser.add_argument(
        "--micro-batches",
        type=int,
        default=1,
        help="the train step's gradient accumulation: micro-batches per step (make_train_step)",
    )
    parser.add_argument(
        "--lora",
        type=int,
        metavar="RANK",
        help="with the adapters of ed.lora.add at this rank (the train step trains only them)",
    )
    parser.add_argument(
        "--layers", type=int, help="keep only the first N decoder layers (Config.first_layers)"
    )
    parser.add_argument(
        "--numerics",
        choices=("exact", "release"),
        default="exact",
        help="'release': the official inference code's FP8/FP4 round trips (Config.numerics)",
    )
    parser.add_argument(
        "--rule",
        action="append",
        default=[],
        metavar="NAME=AXIS[+AXIS]",
        help="override a sharding rule (repeatable), e.g. embed=fsdp+expert: dense weights "
        "split over fsdp and expert (routed experts: over expert, and fsdp along their hidden "
        "units, expert_up, or d_model, expert_in and expert_out); experts=expert+fsdp: the "
        "routed experts whole on each chip, their rows exchanged by all-to-all (the policy's "
        "expert_exchange, which this placement turns on)",
    )
    parser.add_argument(
        "--policy",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="override a field of the platform's execution Policy (repeatable), e.g. "
        "experts=ragged or stationary_rows=0",
    )
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument("--hlo", help="write each phase's compiled HLO text to HLO.PHASE.txt")
    args = parser.parse_args(argv)
    try:
        mesh_shape = parse_mesh(args.mesh)
    except ValueError as e:
        parser.error(str(e))
    try:
        args.rules = parse_rules(args.rule)
        args.policy = parse_policy(args.policy)
    except ValueError as e:
        parser.error(str(e))
    if args.lora is not None and args.lora < 1:
        parser.error(f"--lora must be a positive rank, got {args.lora}")
    phases = ["train"] if args.train else [p for p in args.phases.split(",") if p]
    if not phases or any(p not in PHASES for p in phases):
        parser.error(f"bad --phases {args.phases!r}: choose from {', '.join(PHASES)}")
    return args, mesh_shape, phases


def main(argv: list[str] | None = None) -> int:
    args, mesh_shape, phases = parse_args(argv)

    import jax

    if not args.topology:  # before any backend starts: this many simulated CPU devices
        jax.config.update("jax_num_cpu_devices", args.devices)
    try:
        results = run(args, mesh_shape, phases)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


def _target(args: argparse.Namespace) -> Target:
    import jax

    if args.topology:
        return target(args.topology, args.target_config)
    if args.target_config:
        raise ValueError("--target-config needs a GPU --topology (e.g. h100:8)")
    devices = jax.devices()[: args.devices]
    if len(devices) < args.devices:
        raise ValueError(f"{args.devices} devices asked for, {len(devices)} available")
    kind = devices[0].device_kind
    return Target(devices[0].platform, devices[0].platform, devices, kind, None, None)


def _mesh(devices: list, mesh_shape: dict[str, int]):
    import jax
    import numpy as np
    from jax.sharding import Mesh

    shape = tuple(mesh_shape.get(a, 1) for a in AXES)
    if int(np.prod(shape)) != len(devices):
        named = ",".join(f"{a}={n}" for a, n in zip(AXES, shape, strict=True))
        raise ValueError(f"mesh {named} does not match {len(devices)} devices")
    # Built directly: `jax.make_mesh` refuses shapes that split a TPU torus axis.
    return Mesh(
        np.array(devices).reshape(shape), AXES, axis_types=(jax.sharding.AxisType.Auto,) * 4
    )


def run(args: argparse.Namespace, mesh_shape: dict[str, int], phases: list[str]) -> dict:
    import dataclasses

    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec

    import equinox_dsv4 as ed

    config = {
        "v4-flash": ed.Config.v4_flash,
        "v4-pro": ed.Config.v4_pro,
        "v4-flash-0731": ed.Config.v4_flash_0731,
        "tiny": ed.Config.tiny,
    }[args.model]()
    if "draft" in phases and not config.dspark:
        raise ValueError(f"--phases draft needs a model with a DSpark drafter, not {args.model}")
    if not args.mtp and "draft" not in phases:
        config = config.trunk_only()
    config = dataclasses.replace(config, numerics=args.numerics, scan_layers=not args.unrolled)
    if args.layers:
        config = config.first_layers(args.layers)
    chip = _target(args)
    devices = chip.devices
    mesh = _mesh(devices, mesh_shape)
    batch = args.batch or mesh.shape["data"] * mesh.shape["fsdp"]
    max_len = args.max_len or args.prefill + 256
    dtype = jnp.dtype(args.dtype)

    t0 = time.perf_counter()
    model = eqx.filter_eval_shape(ed.DeepseekV4, config, key=jax.random.key(0), dtype=dtype)
    if args.quantized:
        model = ed.quant.abstract_quantized(model)
    if args.lora:
        model = eqx.filter_eval_shape(
            lambda m: ed.lora.add(m, rank=args.lora, key=jax.random.key(1)), model
        )
    rules = ed.parallel.ShardingRules.for_mesh(mesh).replace(**args.rules)
    model = placed(model, ed.parallel.named_shardings(model, mesh, rules))
    # The policy the placed model resolves to (the platform's, with the routed experts' form
    # that their placement takes), with the fields `--policy` overrides: fixed on the model,
    # which the programs below trace as abstract arrays that carry no placement.
    policy = dataclasses.replace(model.resolved_policy(), **args.policy)
    model = ed.execution.with_policy(model, policy)
    cache = eqx.filter_eval_shape(lambda m: m.init_cache(batch, max_len), model)
    cache = placed(cache, ed.parallel.cache_shardings(cache, mesh))
    param_bytes = ed.quant.weight_bytes(model)["total"]
    held = jax.tree.leaves(model, is_leaf=lambda x: isinstance(x, ed.quant.QuantizedWeight))
    parameters = sum(int(np.prod(x.shape)) for x in held)  # logical, quantised or not
    build = time.perf_counter() - t0
    with jax.set_mesh(mesh):
        rows = NamedSharding(mesh, PartitionSpec(ed.execution.batch_axes(batch), None))

    def step(model, ids, cache):
        # As `generate` runs them: a prefill needs only the last position's logits.
        return model.decode(ids, cache, last_only=ids.shape[1] > 1)

    results = {
        "model": args.model,
        "devices": len(devices),
        "topology": args.topology,
        "platform": devices[0].platform,
        "quantized": args.quantized,
        "lora": args.lora,
        "numerics": args.numerics,
        "unrolled": args.unrolled,
        "layers": config.num_hidden_layers,
        "remat": args.remat if "train" in phases else None,
        "micro_batches": args.micro_batches if "train" in phases else None,
        "device": chip.description,
        "device_memory_bytes": chip.memory_bytes,
        "peak": chip.peak,
        "mesh": dict(mesh.shape),
        "batch": batch,
        "max_len": max_len,
        "dtype": args.dtype,
        "rules": rules.changes(),
        "policy": args.policy,
        "parameters": parameters,
        "parameter_bytes": param_bytes,
        "parameter_bytes_per_device_ideal": param_bytes / len(devices),
        "cache_bytes": sum(
            int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(cache)
        ),
        "build_seconds": build,
        "phases": {},
    }
    print(
        f"{args.model}: {results['parameters'] / 1e9:.2f} B parameters, "
        f"{param_bytes / 2**30:.1f} GiB ({'FP8/FP4 + ' if args.quantized else ''}"
        f"{args.dtype}); mesh {dict(mesh.shape)}; "
        f"batch {batch}, cache {max_len} tokens",
        file=sys.stderr,
    )
    # Weights that alone exceed a device's memory are refused before compiling: no program
    # can make them fit, and a full-size compile takes the compiler a while.
    refusal = chip.fit_error(phases[0], _bytes_per_device(model), "the weights alone")
    if refusal:
        raise DoesNotFit(refusal, results)
    for phase in phases:
        tokens = {"decode": 1, "draft": (config.dspark_block_size or 0) + 1}.get(
            phase, args.prefill
        )
        t0 = time.perf_counter()
        with jax.set_mesh(mesh):
            if phase == "draft":
                lowered = draft_step(model, batch, max_len, mesh, rows)
            elif phase == "train":
                remat = None if args.remat == "none" else args.remat
                lowered = train_step(model, batch, tokens, rows, remat, args.micro_batches)
            else:
                ids = jax.ShapeDtypeStruct((batch, tokens), jnp.int32, sharding=rows)
                lowered = jax.jit(step, donate_argnums=2).lower(model, ids, cache)
        t1 = time.perf_counter()
        compiled = lowered.compile()
        t2 = time.perf_counter()
        if args.hlo:
            try:
                text = compiled.as_text()
            except jax.errors.JaxRuntimeError as e:  # seen for a TPU prefill: XLA's printer
                print(f"{phase}: no HLO text ({e})", file=sys.stderr)
            else:
                with open(f"{args.hlo}.{phase}.txt", "w") as f:
                    f.write(text)
        memory = compiled.memory_analysis()
        cost = compiled.cost_analysis() or {}
        row = {
            "tokens_per_sequence": tokens,
            "trace_lower_seconds": t1 - t0,
            "compile_seconds": t2 - t1,
            "argument_bytes": memory.argument_size_in_bytes,
            "output_bytes": memory.output_size_in_bytes,
            "alias_bytes": memory.alias_size_in_bytes,
            "temp_bytes": memory.temp_size_in_bytes,
            "generated_code_bytes": memory.generated_code_size_in_bytes,
            "flops": cost.get("flops"),
            "bytes_accessed": cost.get("bytes accessed"),
            "transcendentals": cost.get("transcendentals"),
        }
        row["needed_bytes"] = (
            row["argument_bytes"] + row["output_bytes"] + row["temp_bytes"] - row["alias_bytes"]
        )
        row.update(estimate(args, chip.peak, config, phase, tokens, batch, len(devices), row))
        results["phases"][phase] = row
        print(
            f"{phase}: arguments {row['argument_bytes'] / 2**30:.2f} GiB + temporaries "
            f"{row['temp_bytes'] / 2**30:.2f} GiB per device (compiled in {t2 - t1:.0f} s)",
            file=sys.stderr,
        )
        refusal = chip.fit_error(phase, row["needed_bytes"])
        if refusal:
            raise DoesNotFit(refusal, results)
    print_table(results)
    return results


def _bytes_per_device(tree) -> int:
    """The most bytes that any device holds of `tree`'s placed `ShapeDtypeStruct`s."""
    import jax
    import numpy as np

    held: dict = {}
    for leaf in jax.tree.leaves(tree):
        for device, index in leaf.sharding.devices_indices_map(leaf.shape).items():
            shape = [len(range(*i.indices(n))) for i, n in zip(index, leaf.shape, strict=True)]
            held[device] = held.get(device, 0) + int(np.prod(shape)) * leaf.dtype.itemsize
    return max(held.values())


class DoesNotFit(ValueError):
    """A phase needs more than the device's memory; `results` holds the phases compiled."""

    def __init__(self, message: str, results: dict):
        super().__init__(message)
        self.results = results
