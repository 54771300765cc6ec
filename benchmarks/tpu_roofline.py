"""A TPU roofline without a TPU: V4-Flash's prefill and decode step on a v5p slice, estimated
from the TPU compiler's cost analysis and set beside a floor from first principles.

Each run is `python -m equinox_dsv4.compile --topology v5p:4x4x4 --unrolled ...` (libtpu's
compiler, no TPU): the recommended mesh and rules of `tpu_memory.py`, bf16 activations, one
4096-token sequence per `fsdp` row, a decode step with a 4352-token cache. `--unrolled`
because XLA's cost analysis counts a loop's body once: with the layers scanned it would cover
one layer of each scanned group. XLA's per-chip FLOPs and bytes accessed become a step time at
v5p's published peak (`PEAK_FLOPS`, `HBM_BYTES_PER_S`): `max(FLOPs / peak, bytes / bandwidth)`,
compute and memory traffic overlapped perfectly. The floor counts what the step must do:

- prefill: the model's useful FLOPs (`ed.forward_flops`, per sequence) over the slice's
  peak, and every weight read once over the slice's bandwidth; the larger of the two.
- decode: the weight bytes the batch must read (embedding and hash tables one row per
  sequence, each layer's routed experts the expected fraction a batch of `B` tokens touches
  with top-k of E uniform routing, `1 - (1 - k/E)^B`, everything else whole), over the slice's
  bandwidth; the FLOPs, two per active parameter per token, over its peak; the larger of the
  two. The KV cache read is left out (at 4352 tokens it is under 1% of the weights).

For each step, the bytes each kind of operation writes (from the compiled HLO text; a fusion
at its boundary) say where data is materialised beyond what the floor reads.

These are estimates from the compiler's own accounting, not runs on a TPU.

    python benchmarks/tpu_roofline.py [--only flash-b-64 ...] [--work /tmp/tpu-roofline]

Writes benchmarks/results/tpu_roofline.{json,md}.
"""

import argparse
import collections
import dataclasses
import json
import os
import pathlib
import re
import subprocess
import sys

import hlo
import jax
from common import ROOT, markdown, weight_kinds, write
from tpu_memory import RULES, compile_arguments

import equinox_dsv4 as ed
from equinox_dsv4.compile import TPU_PEAKS


# Published per-chip figures for TPU v5p (cloud.google.com/tpu/docs/v5p): 459 TFLOP/s bf16,
# 2,765 GB/s HBM2e.
PEAK_FLOPS, HBM_BYTES_PER_S = TPU_PEAKS["v5p"]
PREFILL = 4096
# name -> (model, quantised, topology, mesh, phases, experts' STATIONARY_ROWS or None)
RUNS = {
    "flash-b-64": ("v4-flash", False, "v5p:4x4x4", "fsdp=8,expert=8", ("prefill", "decode"), None),
    "flash-q-64": ("v4-flash", True, "v5p:4x4x4", "fsdp=8,expert=8", ("prefill", "decode"), None),
    # The decode step as before Round 19: every chip gathers its experts' weights over fsdp.
    "flash-b-64-gather": ("v4-flash", False, "v5p:4x4x4", "fsdp=8,expert=8", ("decode",), 0),
}


def compile_report(name: str, phase: str, work: pathlib.Path) -> dict:
    """The compiler's report for `phase` of run `name` (reused from `work` when there; the
    unrolled prefill takes about 13 minutes to compile here, the decode step 3)."""
    out = work / f"{name}-{phase}.json"
    if not out.exists():
        model, quantized, topology, mesh, _, stationary = RUNS[name]
        cmd = [sys.executable, "-m", "equinox_dsv4.compile"]
        if stationary is not None:
            patch = "import equinox_dsv4._experts as e, runpy, sys; "
            patch += f"e.STATIONARY_ROWS = {stationary}; sys.argv[0] = 'compile'; "
            patch += "runpy.run_module('equinox_dsv4.compile', run_name='__main__')"
            cmd = [sys.executable, "-c", patch]
        cmd += compile_arguments(model, quantized, topology, mesh, phase, out)
        cmd += ["--unrolled", "--prefill", str(PREFILL), "--hlo", str(work / name)]
        env = dict(os.environ, JAX_PLATFORMS="cpu")
        result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"{name} {phase}: compile failed:\n{result.stderr[-3000:]}")
    return json.loads(out.read_text())


def bytes_written(text: str) -> collections.Counter:
    """Bytes each kind of top-level operation of a compiled module writes (its results; a
    fusion at its boundary), by kind: the opcode, or a fusion's name without its number. The
    writes, not the reads: a slice or gather reads a part of an operand that the text does not
    say, and counting whole operands would charge it the whole."""
    table, _ = hlo.parse(text)
    fused = hlo.fused_computations(table)
    out = collections.Counter()
    for name, instruction in table.items():
        if instruction.computation in fused or instruction.opcode in _FREE:
            continue
        kind = (
            re.sub(r"[.\d]+$", "", name) if instruction.opcode == "fusion" else instruction.opcode
        )
        out[kind] += hlo.shape_bytes(instruction.shape)
    return out


# Operations that move no data of their own.
_FREE = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "while", "call"}
_FREE |= {"conditional", "copy-done", "all-gather-done", "after-all", "partition-id"}


def floors(config: ed.Config, quantized: bool, chips: int, batch: int) -> dict[str, dict]:
    """Per-chip floor (seconds) of a prefill of `batch` x PREFILL tokens and of a decode step of
    `batch` tokens, each with its bytes and FLOPs."""
    kinds = weight_kinds(config, jax.numpy.bfloat16, quantized)
    e, k = config.n_routed_experts, config.num_experts_per_tok
    touched = 1 - (1 - k / e) ** batch
    decode_bytes = kinds["other"] + kinds["experts"] * touched + kinds["row"] * batch
    decode_flops = 2 * ed.active_parameters(config) * batch
    prefill_bytes = kinds["tables"] + kinds["experts"] + kinds["other"]
    prefill_fl = ed.forward_flops(config, PREFILL) * batch
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="+", choices=sorted(RUNS), help="these runs only")
    parser.add_argument("--work", default="/tmp/tpu-roofline", help="per-run JSON (reused)")
    args = parser.parse_args()
    work = pathlib.Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    rows, table, breakdown = [], [], []
    for name in args.only or RUNS:
        model, quantized, topology, mesh, phases, _ = RUNS[name]
        reports = {phase: compile_report(name, phase, work) for phase in phases}
        report = reports["decode"]
        config = {"v4-flash": ed.Config.v4_flash, "v4-pro": ed.Config.v4_pro}[model]()
        config = dataclasses.replace(config, num_nextn_predict_layers=0)
        chips, batch = report["devices"], report["batch"]
        floor = floors(config, quantized, chips, batch)
        for phase in phases:
            r = reports[phase]["phases"][phase]
            flops, nbytes = r["flops"], r["bytes_accessed"]
            compute, memory = flops / PEAK_FLOPS, nbytes / HBM_BYTES_PER_S
            estimate = max(compute, memory)
            f = floor[phase]
            tokens = batch * (PREFILL if phase == "prefill" else 1)
            row = {
                "name": name,
                "phase": phase,
                "topology": topology,
                "mesh": mesh,
                "weights": "FP8/FP4" if quantized else "bf16",
                "batch": batch,
                "tokens": tokens,
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
            }
            hlo = work / f"{name}.{phase}.txt"
            if hlo.exists():
                ops = bytes_written(hlo.read_text())
                row["bytes_written_by_operation"] = dict(ops.most_common(12))
                for kind, n in ops.most_common(6):
                    breakdown.append([name, phase, kind, f"{n / 2**30:.2f}"])
            rows.append(row)
            table.append(
                [
                    f"{model}, {row['weights']}" + (", before" if name.endswith("gather") else ""),
                    f"{chips} ({topology}), {mesh}",
                    f"{phase}, {tokens} tokens",
                    f"{flops / 1e12:.2f} / {f['flops'] / 1e12:.2f} "
                    f"({row['flops_over_floor']:.2f}x)",
                    f"{nbytes / 2**30:.2f} / {f['bytes'] / 2**30:.2f} "
                    f"({row['bytes_over_floor']:.2f}x)",
                    f"{1e3 * compute:.2f} / {1e3 * memory:.2f}",
                    f"{1e3 * estimate:.2f}",
                    f"{1e3 * f['seconds']:.2f}",
                    f"{row['estimate_over_floor']:.2f}x",
                    f"{100 * row['mfu_estimate']:.0f}%",
                ]
            )
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
        header = ["run", "step", "operation", "GiB written per chip"]
        md += "\n" + markdown(header, breakdown)
    write("tpu_roofline", rows, md, extra)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
