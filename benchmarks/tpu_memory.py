"""Per-chip memory of V4-Flash and V4-Pro on TPU v5p slices, compiled here without a TPU.

Each run is `python -m equinox_dsv4.compile --topology ...` (libtpu's compiler, so the figures
are the TPU's per chip) on the recommended mesh and the default sharding rules (`RULES`),
bf16 activations, batch one sequence per `fsdp` row, a 4096-token prefill and a decode step
with a 4352-token cache, weights in bf16 or kept quantised (`--quantized`), exact numerics
unless the row says otherwise. Runs one after
another (libtpu allows one process at a time); each writes its own JSON under `--work`, and a
run whose JSON is there already is not repeated.

    python benchmarks/tpu_memory.py [--only flash-q-64 ...] [--work /tmp/tpu]

Writes benchmarks/results/tpu_memory.{json,md}.
"""

import argparse
import json
import os
import pathlib
import subprocess
import sys

from common import ROOT, markdown, recorded, today, write

import equinox_dsv4 as ed


# The rules every run here places the weights by: on these fsdp x expert meshes, the default
# (`ShardingRules.for_mesh`), as `--rule` arguments would write them (the results' record).
RULES = [f"{k}={'+'.join(v)}" for k, v in ed.parallel.FSDP_EXPERT_RULES.items()]
TOPOLOGIES = {64: ("v5p:4x4x4", "fsdp=8,expert=8"), 128: ("v5p:4x4x8", "fsdp=16,expert=8")}
TOPOLOGIES |= {256: ("v5p:4x8x8", "fsdp=16,expert=16"), 16: ("v5p:2x2x4", "fsdp=2,expert=8")}
PHASES = ("prefill", "decode", "draft", "train")
# name -> (model, quantised, chips, phases[, numerics])
RUNS = {
    "flash-q-64": ("v4-flash", True, 64, "decode,prefill"),
    "flash-q-64-release": ("v4-flash", True, 64, "decode,prefill", "release"),
    "flash-b-64": ("v4-flash", False, 64, "decode,prefill"),
    "flash-q-128": ("v4-flash", True, 128, "decode,prefill"),
    "flash-q-256": ("v4-flash", True, 256, "decode,prefill"),
    "flash-b-128": ("v4-flash", False, 128, "decode,prefill"),
    "flash-b-256": ("v4-flash", False, 256, "decode,prefill"),
    "flash-q-64-train": ("v4-flash", True, 64, "train"),
    "flash-q-128-train": ("v4-flash", True, 128, "train"),
    "flash-q-256-train": ("v4-flash", True, 256, "train"),
    "flash-b-64-train": ("v4-flash", False, 64, "train"),
    # V4-Flash-0731 with its DSpark drafter: a speculative step (verify 6 tokens, draft 5).
    "flash-0731-q-64-draft": ("v4-flash-0731", True, 64, "decode,draft"),
    "pro-q-16": ("v4-pro", True, 16, "decode"),
    "pro-q-64": ("v4-pro", True, 64, "decode,prefill"),
    "pro-q-128": ("v4-pro", True, 128, "decode,prefill"),
    "pro-q-256": ("v4-pro", True, 256, "decode,prefill"),
    "pro-q-64-train": ("v4-pro", True, 64, "train"),
    "pro-b-64": ("v4-pro", False, 64, "decode,prefill"),
    "pro-b-128": ("v4-pro", False, 128, "decode,prefill"),
    "pro-b-256": ("v4-pro", False, 256, "decode,prefill"),
}


def compile_arguments(
    model: str, quantized: bool, topology: str, mesh: str, phases: str, out: pathlib.Path
) -> list[str]:
    """`python -m equinox_dsv4.compile`'s arguments for a run on the default rules (`RULES`)."""
    args = ["--model", model, "--topology", topology, "--mesh", mesh, "--phases", phases]
    args += ["--json", str(out)]
    return args + (["--quantized"] if quantized else [])


def run(name: str, work: pathlib.Path) -> dict | None:
    """The run's report; `{"error": ...}` when XLA refused to compile it (kept, not retried)."""
    model, quantized, chips, phases, *numerics = RUNS[name]
    topology, mesh = TOPOLOGIES[chips]
    out = work / f"{name}.json"
    extra = ["--numerics", numerics[0]] if numerics else []
    return compiled(compile_arguments(model, quantized, topology, mesh, phases, out) + extra, out)


def compiled(arguments: list[str], out: pathlib.Path, env: dict[str, str] | None = None) -> dict:
    """`python -m equinox_dsv4.compile ARGUMENTS` writing `out`, unless `out` (or the error file
    beside it, `{"error": ...}`: a refusal is kept, not retried) is there already; `env`: more
    environment variables for the compile (e.g. XLA's dump flags)."""
    refused = out.with_suffix(".error")
    if refused.exists():
        return {"error": refused.read_text().strip()}
    if not out.exists():
        cmd = [sys.executable, "-m", "equinox_dsv4.compile", *arguments]
        env = dict(os.environ, JAX_PLATFORMS="cpu", **(env or {}))
        result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        if result.returncode != 0:
            # The last error line; libtpu's start-up warnings (no TPU here) are not errors.
            lines = [x for x in result.stderr.splitlines() if x.strip()] or ["failed"]
            lines = [x for x in lines if x.startswith(("jax.errors", "error:"))] or lines
            if result.returncode < 0:  # e.g. the TPU compiler aborting
                lines = [f"the compiler process died of signal {-result.returncode}"]
            refused.write_text(lines[-1] + "\n")
            print(f"{out.stem}: {lines[-1]}", file=sys.stderr)
            return {"error": lines[-1]}
    return json.loads(out.read_text())


def cells(name: str, report: dict) -> list[str]:
    """The table's row of a run's report."""
    gib = 2**30
    model, quantized, chips, phases, *numerics = RUNS[name]
    weights = f"{model}, {'FP8/FP4' if quantized else 'bf16'}"
    weights += f", {numerics[0]} numerics" if numerics else ""
    if "error" in report:
        why = report["error"].split("CompileTimeHbmOom: ")[-1].split(". HLO")[0]
        out = [weights, f"{chips} ({TOPOLOGIES[chips][0]})", "-"]
        return out + [f"refused: {why}" if p in phases else "-" for p in PHASES]
    out = [
        weights,
        f"{chips} ({report['topology']})",
        f"{report['parameter_bytes_per_device_ideal'] / gib:.2f} GiB",
    ]
    for phase in PHASES:
        r = report["phases"].get(phase)
        if r is None:
            out.append("-")
            continue
        args_, temp = r["argument_bytes"] / gib, r["temp_bytes"] / gib
        out.append(f"{args_:.2f} + {temp:.2f} = {args_ + temp:.2f} GiB")
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--only",
        nargs="+",
        choices=sorted(RUNS),
        help="these runs only; the other rows are kept from results/tpu_memory.json",
    )
    parser.add_argument("--work", default="/tmp/tpu", help="per-run JSON files (reused)")
    args = parser.parse_args()
    work = pathlib.Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    kept = {r["name"]: r for r in recorded("tpu_memory").get("rows", [])} if args.only else {}
    date = today()
    rows, table = [], []
    for name in RUNS:
        if args.only and name not in args.only:
            row = kept.get(name)
        else:
            report = run(name, work)
            row = None if report is None else {"name": name, "recorded": date, **report}
            row = row and {k: v for k, v in row.items() if k != "build_seconds"}
        if row is None:
            continue
        rows.append(row)
        table.append(cells(name, row))
        print(table[-1], flush=True)
    header = ["model, weights", "chips (topology)", "weights / chips"]
    header += ["prefill: arguments + temporaries", "decode: arguments + temporaries"]
    header += ["draft step: arguments + temporaries", "train step: arguments + temporaries"]
    write("tpu_memory", rows, markdown(header, table), {"rules": RULES})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
