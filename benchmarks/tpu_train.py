"""What trains where: V4-Flash and V4-Pro train steps compiled for TPU v5p slices here, without a
TPU (libtpu's compiler, per-chip figures).

Each row is one `make_train_step` step (AdamW, its moments placed as the parameters; the
forward, backward, optimizer update and router-bias update) on the default rules
(`tpu_memory.RULES` on these meshes), bf16 weights, 4096-token sequences, compiled with
`python -m equinox_dsv4.compile --train --topology ...`:

- the whole model, layers scanned as the library runs them: arguments and temporaries per chip;
- for the rows marked in `RUNS` (each of these compiles takes 7-9 minutes on a 2-core host),
  its first 5 and first 7 layers with every layer unrolled: XLA's cost analysis counts a loop's
  body once, so FLOPs and bytes accessed per chip come from unrolled programs, and the layers
  past the 5th alternate (HCA, CSA) in both models, so the whole model's figures are those of
  5 layers plus (layers - 5) / 2 times the difference the 6th and 7th make.

From those: a roofline step time at v5p's published peak (`max(FLOPs / peak, bytes / HBM
bandwidth)`) and the MFU it gives the step's useful FLOPs (`ed.train.train_flops`). How the
routed experts count depends on the form the row was compiled with (a cost compile's JSON
names its `policy` since the TPU policy took `ragged_dot`; the older rows have none):
- the experts' loop (the older rows) counts once per layer, so the time is a lower bound and
  the MFU an upper bound;
- `ragged_dot` (the TPU policy's) is counted over every row of a device's assignment buffer.
  Under expert parallelism, about 1 / `expert` of a device's tokens' assignments are its own
  experts'. Without `expert_buffer` (the rows before it; their policy names none) the buffer
  holds them all, so the routed experts' FLOPs count about `expert` times over. With it, the
  forward's round holds `expert_buffer` times the device's even share and the rounds' loop
  counts once (about `expert_buffer` times over, for routing in which every device's own
  assignments fit one round); where the weights are gathered, the backward is one round of
  every row (`expert` times over again). Either way the time is an upper bound and the MFU a
  lower bound.
The `flash-256-exchange` row holds the routed experts whole on each chip (`--rule
experts=expert+fsdp`) and exchanges their rows by all-to-all (`--policy expert_exchange=true`),
its gradient by the same rounds backward: each expert's slots hold `expert_buffer` times its
even share of a device's rows, counted over every slot (a lower bound, as above).
Estimates from the compiler on a CPU host; no TPU ran them.

    python benchmarks/tpu_train.py [--only flash-256 ...] [--work /tmp/tpu-train]

Writes benchmarks/results/tpu_train.{json,md}; with `--only`, the rows not compiled are kept
from the results file with the date they were recorded.
"""

import argparse
import math
import pathlib
import re

from common import markdown, recorded, today, write
from tpu_memory import RULES, compile_arguments, compiled

import equinox_dsv4 as ed
from equinox_dsv4.compile import TPU_PEAKS


SEQ_LEN = 4096
# name -> (model, topology, mesh, global batch, remat, micro-batches, with the cost compiles[,
# rules overriding the default ones]). The unrolled cost compiles take 7-9 minutes each on
# a 2-core host: run for few rows.
RUNS = {
    "flash-64": ("v4-flash", "v5p:4x4x4", "fsdp=8,expert=8", 8, "dots", 1, False),
    "flash-64-nothing": ("v4-flash", "v5p:4x4x4", "fsdp=8,expert=8", 8, "nothing", 1, False),
    "flash-64-embed-fsdp": (
        *("v4-flash", "v5p:4x4x4", "fsdp=8,expert=8", 8, "dots", 1, False),
        ("embed=fsdp",),
    ),
    "flash-64-e16": ("v4-flash", "v5p:4x4x4", "fsdp=4,expert=16", 4, "dots", 1, False),
    "flash-64-f16": ("v4-flash", "v5p:4x4x4", "fsdp=16,expert=4", 16, "dots", 1, True),
    "flash-128": ("v4-flash", "v5p:4x4x8", "fsdp=16,expert=8", 16, "dots", 1, True),
    "flash-256": ("v4-flash", "v5p:4x8x8", "fsdp=32,expert=8", 32, "dots", 1, True),
    # The routed experts whole on each chip, their rows exchanged by all-to-all (`POLICIES`).
    "flash-256-exchange": (
        *("v4-flash", "v5p:4x8x8", "fsdp=32,expert=8", 32, "dots", 1, True),
        ("experts=expert+fsdp",),
    ),
    "pro-256": ("v4-pro", "v5p:4x8x8", "fsdp=32,expert=8", 32, "dots", 1, False),
    "pro-256-nothing": ("v4-pro", "v5p:4x8x8", "fsdp=32,expert=8", 32, "nothing", 1, False),
    "pro-256-e16": ("v4-pro", "v5p:4x8x8", "fsdp=16,expert=16", 16, "dots", 1, False),
    "pro-512": ("v4-pro", "v5p:8x8x8", "fsdp=16,expert=32", 16, "nothing", 1, True),
}
COST_LAYERS = (5, 7)
# name -> the fields of the TPU's execution policy a run overrides (`--policy`).
POLICIES = {"flash-256-exchange": ("expert_exchange=true",)}


def overrides(name: str) -> tuple[str, ...]:
    """The run's rules overriding the default ones (its optional last field)."""
    return RUNS[name][7] if len(RUNS[name]) > 7 else ()


def arguments(name: str, out: pathlib.Path, layers: int | None = None) -> list[str]:
    model, topology, mesh, batch, remat, micro = RUNS[name][:6]
    args = compile_arguments(model, False, topology, mesh, "train", out)
    args += [a for rule in overrides(name) for a in ("--rule", rule)]
    args += [a for field in POLICIES.get(name, ()) for a in ("--policy", field)]
    args += ["--batch", str(batch), "--seq-len", str(SEQ_LEN), "--remat", remat]
    args += ["--micro-batches", str(micro)]
    return args + (["--layers", str(layers), "--unrolled"] if layers else [])


def at_depth(shallow: float, deeper: float, layers: int) -> float:
    """A per-chip figure of `layers` layers from the unrolled 5- and 7-layer programs' (see the
    module's docstring)."""
    pairs = (layers - COST_LAYERS[0]) / (COST_LAYERS[1] - COST_LAYERS[0])
    return shallow + pairs * (deeper - shallow)


def extrapolated(shallow: dict, deeper: dict, layers: int) -> dict[str, float]:
    """FLOPs and bytes accessed per chip of `layers` layers (`at_depth`)."""
    a, b = shallow["phases"]["train"], deeper["phases"]["train"]
    return {k: at_depth(a[k], b[k], layers) for k in ("flops", "bytes_accessed")}


def compiled_run(
    arguments, name: str, work: pathlib.Path, with_cost: bool
) -> tuple[dict, list[dict]]:
    """Run `name`'s whole-model compile and, `with_cost`, its unrolled cost compiles
    (`COST_LAYERS`): `arguments(name, out, layers)` gives the compile tool's arguments."""
    memory = compiled(arguments(name, work / f"{name}.json"), work / f"{name}.json")
    costs = [
        compiled(arguments(name, work / f"{name}-{n}.json", n), work / f"{name}-{n}.json")
        for n in (COST_LAYERS if with_cost else ())
    ]
    return memory, costs


def out_of_memory(error: str) -> str | None:
    """The TPU compiler's out-of-memory refusal as "XB of temporaries > YB", else `None`."""
    why = re.search(r"HLO temporaries \(([\d.]+G)\) exceeds available HBM \(([\d.]+G)\)", error)
    return f"{why[1]}B of temporaries > {why[2]}B" if why else None


def roofline(costs: list[dict], layers: int, useful: float) -> dict:
    """From the unrolled cost compiles: the whole model's cost per chip, the roofline step time
    at v5p's peak, and the MFU bound that gives `useful` FLOPs per chip."""
    peak, hbm = TPU_PEAKS["v5p"]
    cost = extrapolated(*costs, layers)
    seconds = max(cost["flops"] / peak, cost["bytes_accessed"] / hbm)
    return {
        "cost_per_chip": cost,
        "useful_flops_per_chip": useful,
        "estimate_seconds": seconds,
        "mfu_estimate": useful / seconds / peak,
    }


def measured(name: str, work: pathlib.Path) -> dict:
    """Run `name`'s compiles (reused from `work`) and its row: the reports, and where the cost
    compiles ran, the roofline (`roofline`)."""
    memory, costs = compiled_run(arguments, name, work, RUNS[name][6])
    row = {"name": name, "memory": memory, "costs": costs}
    if costs and not any("error" in c for c in costs):
        row |= roofline(costs, layers(name), useful_flops(name))
        row["mfu_is"] = mfu_is(costs)
    return row


def _config(name: str) -> ed.Config:
    return {"v4-flash": ed.Config.v4_flash, "v4-pro": ed.Config.v4_pro}[RUNS[name][0]]()


def layers(name: str) -> int:
    """The decoder layers of run `name`'s model."""
    return _config(name).num_hidden_layers


def useful_flops(name: str) -> float:
    """The useful FLOPs per chip of run `name`'s step (`ed.train.train_flops`)."""
    model, topology, mesh, batch = RUNS[name][:4]
    chips = math.prod(int(part.split("=")[1]) for part in mesh.split(","))
    return ed.train.train_flops(_config(name), SEQ_LEN) * batch / chips


def mfu_is(costs: list[dict]) -> str:
    """Whether the MFU estimate from these cost compiles is an upper or a lower bound: the
    routed experts' loop counts once per layer (upper; the older compiles, which name no
    `policy`), `ragged_dot` over every row of the assignment buffer (lower; see the module's
    docstring)."""
    policy = costs[0].get("policy")
    ragged = policy is not None and policy.get("experts", "ragged") == "ragged"
    return "lower bound" if ragged else "upper bound"


def cells(name: str, row: dict) -> list:
    """The row's table cells (a kept row's with the date it was recorded)."""
    model, topology, mesh, batch, remat, micro = RUNS[name][:6]
    chips = math.prod(int(part.split("=")[1]) for part in mesh.split(","))
    recorded = f" ({row['recorded']})" if "recorded" in row else ""
    out = [model + recorded, f"{chips} ({topology})", mesh, SEQ_LEN, batch]
    out += [", ".join((remat, *overrides(name), *POLICIES.get(name, ()))), micro]
    memory, costs = row["memory"], row["costs"]
    if "error" in memory:
        why = out_of_memory(memory["error"])
        why = f"out of memory: {why}" if why else memory["error"]
        out += [f"refused ({why})", "-", "-"]
    else:
        gib = 2**30
        train = memory["phases"]["train"]
        arg, temp = train["argument_bytes"] / gib, train["temp_bytes"] / gib
        out += [f"{arg:.2f} GiB", f"{temp:.2f} GiB", f"{arg + temp:.2f} GiB"]
    if not costs:
        out.append("not estimated (its cost compiles not run)")
    elif any("error" in c for c in costs):
        out.append("n/a: " + next(c["error"] for c in costs if "error" in c))
    else:
        peak, hbm = TPU_PEAKS["v5p"]
        cost = row["cost_per_chip"]
        bound = "compute" if cost["flops"] / peak >= cost["bytes_accessed"] / hbm else "memory"
        mfu, seconds = row["mfu_estimate"], row["estimate_seconds"]
        sign = ">=" if mfu_is(costs) == "lower bound" else "<="
        out.append(f"{sign} {mfu:.0%} ({seconds:.2f} s, {bound})")
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--only",
        nargs="+",
        choices=sorted(RUNS),
        help="these runs only; the other rows are kept from results/tpu_train.json",
    )
    parser.add_argument("--work", default="/tmp/tpu-train", help="per-run JSON files (reused)")
    args = parser.parse_args()
    work = pathlib.Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    peak, hbm = TPU_PEAKS["v5p"]
    kept = {r["name"]: r for r in recorded("tpu_train").get("rows", [])} if args.only else {}
    date = today()
    rows, table = [], []
    for name in RUNS:
        if args.only and name not in args.only:
            row = kept.get(name)
        else:
            row = {"recorded": date, **measured(name, work)}
        if row is None:
            continue
        rows.append(row)
        table.append(cells(name, row))
        print(table[-1], flush=True)
    header = ["model", "chips (topology)", "mesh", "sequence", "global batch", "remat"]
    header += ["micro-batches", "arguments / chip", "temporaries / chip", "total / chip"]
    header += ["MFU estimate (step time), v5p peak"]
    extra = {"rules": RULES, "peak_flops": peak, "hbm_bytes_per_s": hbm, "seq_len": SEQ_LEN}
    write("tpu_train", rows, markdown(header, table), extra)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
