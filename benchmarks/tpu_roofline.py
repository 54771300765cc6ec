"""A TPU roofline without a TPU: V4-Flash's (and V4-Pro's) prefill and decode step on a v5p
slice, estimated from the TPU compiler's cost analysis and set beside a floor from first
principles.

Each run is `python -m equinox_dsv4.compile --topology v5p:4x4x4 --unrolled ...` (libtpu's
compiler, no TPU): 64 chips, fsdp 8 x expert 8, the default rules and the TPU's execution
policy, bf16 activations, one 4096-token sequence per `fsdp` row, a decode step of 8 sequences
(64 for the batch-64 row) with a 4352-token cache (a 1M-token cache for the 1M rows, of 8
sequences and of one). The "before" rows are the prefill and the decode step under the
policy's earlier forms (`BEFORE`: the layers' slices behind a barrier, a decode step's tokens
split along the batch, the tokens of at most 64 assignments travelling to the experts, a
prefill's sequences whole on each chip of an `expert` row), compiled in the same run. The
`flash-b-64-exchange` rows hold the routed experts whole on each chip
(`--rule experts=expert+fsdp`, `parallel.EXCHANGE_RULES`) and exchange a prefill's rows by
all-to-all (`--policy expert_exchange=true`).
`--unrolled` because XLA's cost analysis counts a loop's body once: with the layers scanned it
would cover one layer of each scanned group. XLA's per-chip FLOPs and bytes accessed become a
step time at v5p's published peak (`PEAK_FLOPS`, `HBM_BYTES_PER_S`): `max(FLOPs / peak,
bytes / bandwidth)`, compute and memory traffic overlapped perfectly. The floor counts what
the step must do:

- prefill: the model's useful FLOPs (`ed.train.forward_flops`, per sequence) over the slice's
  peak, and every weight read once over the slice's bandwidth; the larger of the two.
- decode: the weight bytes the batch must read (embedding and hash tables one row per
  sequence, each layer's routed experts the expected fraction a batch of `B` tokens touches
  with top-k of E uniform routing, `1 - (1 - k/E)^B`, everything else whole) and the cache
  bytes each sequence must read (`cache_read_bytes`), over the slice's bandwidth; the FLOPs,
  two per active parameter per token, over its peak; the larger of the two.

For each step, the bytes each part of the model reads and writes (`traffic_by_part`, from the
compiled HLO text: every kernel's operands and results, an operand only sliced charged its
slices, a buffer updated in place (a dynamic update slice or a scatter) its updates, by the op
names JAX gives them) say where the traffic beyond the floor comes from; and
one prefill layer alone, the first five layers' program less the first four's
(`layer_traffic`).

Pallas kernels (the TPU policy's attention of a long chunk, `Policy.attention_kernel`) are
charged what their own cost estimates say, and at least their operands and results
(`hlo.pallas_shortfall`, added to XLA's bytes; the row's `pallas`); their part is "attention:
the kernel".

These are estimates from the compiler's own accounting, not runs on a TPU.

    python benchmarks/tpu_roofline.py [--only flash-b-64 ...] [--phases decode]
        [--work /tmp/tpu-roofline]

With `--only` or `--phases`, the rows not compiled are kept from the results file with the
date they were recorded.

Writes benchmarks/results/tpu_roofline.{json,md}.
"""

import argparse
import collections
import dataclasses
import glob
import json
import math
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import typing

import hlo
import jax
from common import ROOT, markdown, recorded, today, weight_kinds, write
from tpu_memory import RULES, compile_arguments

import equinox_dsv4 as ed
from equinox_dsv4.compile import TPU_PEAKS


# Published per-chip figures for TPU v5p (cloud.google.com/tpu/docs/v5p): 459 TFLOP/s bf16,
# 2,765 GB/s HBM2e.
PEAK_FLOPS, HBM_BYTES_PER_S = TPU_PEAKS["v5p"]
PREFILL = 4096
TOPOLOGY, MESH = "v5p:4x4x4", "fsdp=8,expert=8"


class Run(typing.NamedTuple):
    """One compiled configuration: the model, whether its weights are the release's FP8/FP4,
    the phases, the batch (default: one sequence per `fsdp` row), the decode step's cache
    length (default: the prefill + 256), `--policy` and `--rule` overrides, and the label its
    rows carry in the table."""

    model: str
    quantized: bool
    phases: tuple[str, ...]
    batch: int | None = None
    max_len: int | None = None
    policy: tuple[str, ...] = ()
    rules: tuple[str, ...] = ()
    label: str = ""


# The TPU policy's fields as they were before its measured changes (docs/design.md).
BEFORE = ("barrier_slices=true", "stationary_tokens=0", "stationary_rows=64", "split_chunks=0")
BEFORE += ("expert_buffer=0",)
RUNS = {
    "flash-b-64": Run("v4-flash", False, ("prefill", "decode")),
    "flash-b-64-batch-64": Run("v4-flash", False, ("decode",), batch=64, label=", batch 64"),
    # The forms before the TPU's `barrier_slices` and `stationary_tokens` (docs/design.md):
    # each layer's slices copied, and in a decode step every dense weight gathered to every
    # chip.
    "flash-b-64-before": Run(
        "v4-flash",
        False,
        ("prefill", "decode"),
        policy=BEFORE,
        label=", before",
    ),
    "flash-b-64-batch-64-before": Run(
        "v4-flash",
        False,
        ("decode",),
        batch=64,
        policy=BEFORE,
        label=", batch 64, before",
    ),
    "flash-b-64-1m": Run("v4-flash", False, ("decode",), max_len=1 << 20, label=", 1M cache"),
    "flash-b-64-1m-batch-1": Run(
        "v4-flash", False, ("decode",), batch=1, max_len=1 << 20, label=", 1M cache"
    ),
    "flash-q-64": Run("v4-flash", True, ("prefill", "decode")),
    # V4-Pro on the same slice and mesh (issue 46, point 7).
    "pro-b-64": Run("v4-pro", False, ("prefill", "decode")),
    # The routed experts split whole over expert x fsdp and their rows exchanged by
    # all-to-all (`Policy.expert_exchange`, `parallel.EXCHANGE_RULES`); a decode step's tokens
    # stay on every chip, each running its own experts' share.
    "flash-b-64-exchange": Run(
        "v4-flash",
        False,
        ("prefill", "decode"),
        policy=("expert_exchange=true",),
        rules=("experts=expert+fsdp",),
        label=", experts exchanged",
    ),
}
# What a run without `--only` compiles (`flash-q-64` on request).
DEFAULT_RUNS = ("flash-b-64", "flash-b-64-before", "flash-b-64-batch-64")
DEFAULT_RUNS += ("flash-b-64-batch-64-before",)
DEFAULT_RUNS += ("flash-b-64-1m", "flash-b-64-1m-batch-1", "pro-b-64", "flash-b-64-exchange")


def compile_report(name: str, phase: str, work: pathlib.Path, layers: int | None = None) -> dict:
    """The compiler's report for `phase` of run `name` (reused from `work` when there; the
    unrolled prefill takes about 13 minutes to compile here, the decode step 3), its first
    `layers` decoder layers only if given. The compiled module's text goes to
    `work/NAME[-L-layers].PHASE.txt`: from `compiled.as_text()`, or where that fails (the TPU
    prefill) from XLA's dump of the same module after optimisation."""
    suffix = f"-{layers}-layers" if layers else ""
    out = work / f"{name}-{phase}{suffix}.json"
    if not out.exists():
        run = RUNS[name]
        cmd = [sys.executable, "-m", "equinox_dsv4.compile"]
        cmd += [a for field in run.policy for a in ("--policy", field)]
        cmd += compile_arguments(run.model, run.quantized, TOPOLOGY, MESH, phase, out)
        cmd += [a for rule in run.rules for a in ("--rule", rule)]
        cmd += ["--batch", str(run.batch)] if run.batch else []
        cmd += ["--max-len", str(run.max_len)] if run.max_len else []
        cmd += ["--unrolled", "--prefill", str(PREFILL), "--hlo", str(work / (name + suffix))]
        cmd += ["--layers", str(layers)] if layers else []
        text = work / f"{name}{suffix}.{phase}.txt"
        with tempfile.TemporaryDirectory() as dump:
            flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_dump_to={dump} --xla_dump_hlo_as_text"
            env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=flags)
            result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
            if result.returncode != 0:
                raise RuntimeError(
                    f"{name} {phase}: compile failed (exit {result.returncode}):\n"
                    f"{result.stderr[-3000:]}"
                )
            if not text.exists():
                dumped = glob.glob(f"{dump}/*jit_step*.after_optimizations.txt")
                shutil.copy(max(dumped, key=os.path.getsize), text)
    return json.loads(out.read_text())


# Operations that move no data of their own.
_FREE = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "while", "call"}
_FREE |= {"conditional", "copy-done", "all-gather-done", "after-all", "partition-id"}


_ROUND = r"moe/shard_map/while/.*cond"
# The parts of the model, by the op names JAX gives their operations (a regular expression
# searched for; the first match wins).
PARTS = (
    # The experts' weights gathered over fsdp (`_gathering`), or where the weights stay, the
    # tokens gathered over expert and fsdp (`_stationary`).
    (r"moe/shard_map/all_gather", "routed experts: tokens or weights gathered"),
    # A round of a device's own assignments (`Policy.expert_buffer`): a branch in a loop.
    (_ROUND + r"/.*dot_general", "routed experts: the products"),
    (_ROUND + r"/.*gather", "routed experts: rows or weights gathered per assignment"),
    (_ROUND + r"/.*scatter", "routed experts: a round's outputs added to their tokens"),
    (_ROUND, "routed experts: sorting, masks, the sums over top-k and devices"),
    (r"moe/shard_map/while", "routed experts: the expert loop (products, block writes)"),
    # ragged_dot's grouped products (a prefill's), or a decode step's products.
    (r"moe/shard_map/(vmap\(\.\.\.i,oi|.*dot_general)", "routed experts: the products"),
    (r"moe/shard_map/gather", "routed experts: rows or weights gathered per assignment"),
    (r"moe/shard_map", "routed experts: sorting, masks, the sums over top-k and devices"),
    (r"/moe/", "router, shared expert"),
    (r"indexer", "attention: indexer"),
    (r"compressor", "attention: compressors"),
    # The Pallas kernel of a long chunk's window and compressed entries
    # (`Policy.attention_kernel`).
    (r"window_and_entries_attention", "attention: the kernel (window and entries)"),
    (r"attention", "attention: the rest (projections, blocks, softmax)"),
    (r"/block/", "mHC and norms (the 4 streams)"),
    (r"(jit\(_\w+\)|dynamic_index_in_dim\))/squeeze$", "layer stacks sliced per layer"),
    (r"^model\.(head|embed)|jit\(_\w+\)/[^/]*dot_general$", "embedding, head"),
)


def traffic_by_part(text: str) -> collections.Counter:
    """Bytes each part of the model reads and writes in a compiled module: every kernel's
    operands and results (`hlo.kernel_bytes`: an operand a fusion only slices, directly or in
    a fusion nested in it, charged its slices; a buffer updated in place its updates; a
    loop's body once, as XLA's cost analysis
    counts it), by `PARTS` from its op name, or its operand's where it has none (an
    asynchronous collective's steps); relayout copies and collectives that name no source
    op apart."""
    table, computations = hlo.parse(text)
    entry = re.search(r"^ENTRY %?([\w.\-]+)", text, re.M)[1]
    out = collections.Counter()

    def source(name, depth=0):
        m = re.search(r'op_name="([^"]*)"', table[name].attributes)
        if m or depth == 3 or not table[name].operands:
            return m[1] if m else ""
        return (
            source(table[name].operands[0], depth + 1) if table[name].operands[0] in table else ""
        )

    def walk(computation):
        for name in computations[computation]:
            instruction = table[name]
            if instruction.opcode in ("while", "call", "conditional"):
                # A loop's body, a call's computation, every branch of a conditional (a
                # skipped branch moves next to nothing).
                called = re.findall(r"(?:body|calls)=%?([\w.\-]+)", instruction.attributes)
                branches = re.search(r"branch_computations=\{([^}]*)\}", instruction.attributes)
                called += re.findall(r"%?([\w.\-]+)", branches[1]) if branches else []
                for c in called:
                    if c in computations:
                        walk(c)
                continue
            if instruction.opcode in _FREE:
                continue
            op = source(name)
            part = next((p for key, p in PARTS if re.search(key, op)), None)
            if part is None:
                part = _unnamed(name, instruction.opcode)
            out[part] += hlo.kernel_bytes(name, table, computations)

    walk(entry)
    return out


def layer_traffic(work: pathlib.Path, name: str = "flash-b-64") -> dict:
    """One decoder layer of run `name`'s prefill, by part (`traffic_by_part`): the first five
    layers' program less the first four's (V4-Flash's fifth layer: compressed sparse
    attention, learned routing), each compiled unrolled with the run's mesh and rules."""
    counts, xla = [], []
    for layers in (4, 5):
        report = compile_report(name, "prefill", work, layers)
        xla.append(report["phases"]["prefill"]["bytes_accessed"])
        counts.append(traffic_by_part((work / f"{name}-{layers}-layers.prefill.txt").read_text()))
    parts = {k: counts[1][k] - counts[0][k] for k in counts[1]}
    parts = dict(sorted(parts.items(), key=lambda kv: -kv[1]))
    return {"run": name, "layer": 5, "parts": parts, "xla_bytes": xla[1] - xla[0]}


def _unnamed(name: str, opcode: str) -> str:
    # An operation no source op names: a collective, or the zero-filled buffer (a broadcast,
    # then a dynamic-update-slice of the local part) that an all-reduce gathers a weight
    # into; a relayout copy; else other.
    zero_filled = opcode == "broadcast" or "dynamic-update-slice" in name
    if re.match(r"all-|collective|reduce-scatter", opcode) or zero_filled:
        return "collectives, and the zero-filled buffers of all-reduce gathers"
    return "relayout copies" if "copy" in opcode else "other"


def floors(
    config: ed.Config, quantized: bool, chips: int, batch: int, context: int
) -> dict[str, dict]:
    """Per-chip floor (seconds) of a prefill of `batch` x PREFILL tokens and of a decode step of
    `batch` tokens with `context` tokens in each sequence's cache, each with its bytes and
    FLOPs."""
    kinds = weight_kinds(config, jax.numpy.bfloat16, quantized)
    e, k = config.n_routed_experts, config.num_experts_per_tok
    touched = 1 - (1 - k / e) ** batch
    decode_bytes = kinds["other"] + kinds["experts"] * touched + kinds["row"] * batch
    decode_bytes += cache_read_bytes(config, context) * batch
    decode_flops = 2 * ed.train.active_parameters(config) * batch
    prefill_bytes = kinds["tables"] + kinds["experts"] + kinds["other"]
    prefill_fl = ed.train.forward_flops(config, PREFILL) * batch
    out = {}
    for phase, nbytes, flops in (
        ("prefill", prefill_bytes, prefill_fl),
        ("decode", decode_bytes, decode_flops),
    ):
        nbytes, flops = nbytes / chips, flops / chips
        out[phase] = {
            "bytes": nbytes,
            "flops": flops,
            "seconds": max(nbytes / HBM_BYTES_PER_S, flops / PEAK_FLOPS),
        }
    out["decode"]["experts_touched"] = touched
    return out


def cache_read_bytes(config: ed.Config, context: int, itemsize: int = 2) -> int:
    """Bytes of cache a decode step must read for one sequence with `context` tokens before
    it: every layer's sliding window; an HCA layer's every compressed entry; a CSA layer's
    indexer keys of every compressed entry and its `index_topk` picked entries."""
    total = 0
    for kind in config.layer_types:
        total += min(config.sliding_window, context) * config.head_dim
        if kind == ed.config.HCA:
            total += context // config.compress_rate_hca * config.head_dim
        elif kind == ed.config.CSA:
            entries = context // config.compress_rate_csa
            picked = min(config.index_topk, entries)
            total += entries * config.index_head_dim + picked * config.head_dim
    return total * itemsize


def table_cells(row: dict, run: Run) -> list[str]:
    """The table's row of one compiled step (`row`, as the results file holds it)."""
    gib, recorded = 2**30, f" ({row['recorded']})" if "recorded" in row else ""
    chips = math.prod(int(axis.split("=")[1]) for axis in row["mesh"].split(","))
    return [
        f"{run.model}, {row['weights']}" + run.label + recorded,
        f"{chips} ({row['topology']}), {row['mesh']}",
        f"{row['phase']}, {row['tokens']} tokens",
        f"{row['xla_flops_per_chip'] / 1e12:.2f} / {row['floor_flops_per_chip'] / 1e12:.2f} "
        f"({row['flops_over_floor']:.2f}x)",
        f"{row['xla_bytes_per_chip'] / gib:.2f} / {row['floor_bytes_per_chip'] / gib:.2f} "
        f"({row['bytes_over_floor']:.2f}x)",
        f"{1e3 * row['compute_seconds']:.2f} / {1e3 * row['memory_seconds']:.2f}",
        f"{1e3 * row['estimate_seconds']:.2f}",
        f"{1e3 * row['floor_seconds']:.2f}",
        f"{row['estimate_over_floor']:.2f}x",
        f"{100 * row['mfu_estimate']:.0f}%",
    ]


def breakdown_lines(row: dict) -> list[list[str]]:
    """The six parts of one compiled step that read and write the most (`traffic_by_part`)."""
    parts = collections.Counter(row.get("traffic_by_part", {}))
    total = sum(parts.values())
    return [
        [row["name"], row["phase"], part, f"{n / 2**30:.2f}", f"{100 * n / total:.0f}%"]
        for part, n in parts.most_common(6)
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--only",
        nargs="+",
        choices=sorted(RUNS),
        help="these runs only; the other rows are kept from results/tpu_roofline.json",
    )
    parser.add_argument(
        "--phases",
        nargs="+",
        choices=("prefill", "decode"),
        help="these phases only (of the runs that have them); the others' rows are kept",
    )
    parser.add_argument("--work", default="/tmp/tpu-roofline", help="per-run JSON (reused)")
    args = parser.parse_args()
    work = pathlib.Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    rows, table, breakdown = [], [], []
    names = args.only or list(DEFAULT_RUNS)
    phases = {n: [p for p in RUNS[n].phases if p in (args.phases or RUNS[n].phases)] for n in names}
    old = recorded("tpu_roofline") if args.only or args.phases else {}
    kept = {(r["name"], r["phase"]): r for r in old.get("rows", [])}
    layer = old.get("prefill_layer")
    # Every compile first: this process must not start JAX's TPU client (libtpu admits one
    # process at a time) before its compiler subprocesses are done. The decode step's report
    # gives the batch and cache length of the floors.
    compiled = {n: {p: compile_report(n, p, work) for p in {*phases[n], "decode"}} for n in names}
    if "prefill" in phases.get("flash-b-64", ()) or layer is None:
        layer = layer_traffic(work)
    date = today()
    for name in [*DEFAULT_RUNS, *(n for n in RUNS if n not in DEFAULT_RUNS)]:
        run = RUNS[name]
        model, quantized, topology, mesh = run.model, run.quantized, TOPOLOGY, MESH
        if name in compiled:
            reports = compiled[name]
            report = reports["decode"]
            config = {"v4-flash": ed.Config.v4_flash, "v4-pro": ed.Config.v4_pro}[model]()
            config = dataclasses.replace(config, num_nextn_predict_layers=0)
            chips, batch = report["devices"], report["batch"]
            floor = floors(config, quantized, chips, batch, report["max_len"] - 1)
        for phase in run.phases:
            if phase not in phases.get(name, ()):
                if (name, phase) in kept:
                    row = kept[(name, phase)]
                    rows.append(row)
                    table.append(table_cells(row, run))
                    breakdown += breakdown_lines(row)
                continue
            r = reports[phase]["phases"][phase]
            flops, nbytes = r["flops"], r["bytes_accessed"]
            text = work / f"{name}.{phase}.txt"
            # Pallas kernels charged at least their operands and results where their cost
            # estimates say less (`hlo.pallas_shortfall`).
            kernels, short = hlo.pallas_shortfall(text.read_text()) if text.exists() else (0, 0)
            nbytes += short
            compute, memory = flops / PEAK_FLOPS, nbytes / HBM_BYTES_PER_S
            estimate = max(compute, memory)
            f = floor[phase]
            tokens = batch * (PREFILL if phase == "prefill" else 1)
            row = {
                "name": name,
                "recorded": date,
                "phase": phase,
                "topology": topology,
                "mesh": mesh,
                "weights": "FP8/FP4" if quantized else "bf16",
                "batch": batch,
                "tokens": tokens,
                "cache_length": report["max_len"],
                "policy": list(run.policy),
                "xla_flops_per_chip": flops,
                "xla_bytes_per_chip": nbytes,
                "compute_seconds": compute,
                "memory_seconds": memory,
                "estimate_seconds": estimate,
                "floor_flops_per_chip": f["flops"],
                "floor_bytes_per_chip": f["bytes"],
                "floor_seconds": f["seconds"],
                "bytes_over_floor": nbytes / f["bytes"],
                "flops_over_floor": flops / f["flops"],
                "estimate_over_floor": estimate / f["seconds"],
                "mfu_estimate": f["flops"] / estimate / PEAK_FLOPS,
                "argument_bytes": r["argument_bytes"],
                "temp_bytes": r["temp_bytes"],
                "pallas": {"kernels": kernels, "added_bytes": short},
            }
            if text.exists():
                row["traffic_by_part"] = dict(traffic_by_part(text.read_text()).most_common())
            rows.append(row)
            table.append(table_cells(row, run))
            breakdown += breakdown_lines(row)
            print(table[-1], flush=True)
    header = [
        "model, weights",
        "chips, mesh",
        "step",
        "TFLOPs per chip: XLA / floor",
        "GiB accessed per chip: XLA / floor",
        "ms at peak: compute / memory",
        "estimate ms",
        "floor ms",
        "estimate / floor",
        "MFU (useful FLOPs)",
    ]
    extra = {"peak_flops": PEAK_FLOPS, "hbm_bytes_per_s": HBM_BYTES_PER_S, "rules": RULES}
    md = markdown(header, table)
    if breakdown:
        header = ["run", "step", "part (largest six)", "GiB read + written per chip", "share"]
        md += "\n" + markdown(header, breakdown)
    extra["prefill_layer"] = layer
    header = ["one prefill layer (flash-b-64's 5th: CSA, learned routing)", "GiB per chip", "share"]
    total = sum(layer["parts"].values())
    lines = [[k, f"{v / 2**30:.2f}", f"{100 * v / total:.0f}%"] for k, v in layer["parts"].items()]
    lines.append(["all (operands + results)", f"{total / 2**30:.2f}", "100%"])
    lines.append(["XLA's bytes accessed", f"{layer['xla_bytes'] / 2**30:.2f}", ""])
    md += "\n" + markdown(header, lines)
    write("tpu_roofline", rows, md, extra)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
