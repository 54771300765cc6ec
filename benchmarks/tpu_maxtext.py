"""MaxText's DeepSeek-V4-Flash train step beside ours, by one method: both compiled here for the
same TPU v5p slice by libtpu's compiler (no TPU ran them), per-chip figures from XLA's cost and
memory analyses of the compiled programs.

The workload: V4-Flash, bf16 weights and activations, v5p:4x8x8 (256 chips), fsdp 32 x expert 8,
4096-token sequences, a global batch of 32, each framework's default remat (ours `"dots"`,
MaxText's `full`), AdamW. Ours are `tpu_train.py`'s `flash-256` row (its default forms) and its
`flash-256-exchange` row (the routed experts whole on each chip, their rows exchanged by
all-to-all: `Policy.expert_exchange`). MaxText's is its own `deepseek4-284b` model compiled by
its own `train_compile`, in its own environment (below), with these settings and its defaults
for everything else (dropless routed experts through megablox's grouped matmul,
`capacity_factor=-1`):

- `compile_topology=v5p-512` (MaxText names a v5p slice by TensorCores: 4x8x8),
  `ici_fsdp_parallelism=32 ici_expert_parallelism=8`, every other parallelism 1;
- `custom_mesh_and_rule=ep-as-cp`: under MaxText's default rules the batch splits over fsdp x
  expert (256), which 32 sequences cannot; this rule set, its own for a batch smaller than
  the chips with expert parallelism, splits the sequence over `expert` outside the experts,
  as our TPU policy does (`Policy.split_chunks`);
- `per_device_batch_size=0.125` (32 sequences; MaxText loads 256 rows of token ids and
  trains on the first 32), `max_target_length=4096`, `dtype=bfloat16 weight_dtype=bfloat16`;
- `attention=dot_product` (its V4 refuses its default, `autoselected`);
- `ragged_buffer_factor`: unset (MaxText's default: each chip's receive buffer holds the worst
  case, dropless) or 2 (twice the balanced share; assignments past it are dropped): the
  configurations `default` and `rbf2`. Ours is dropless with `Policy.expert_buffer=2` (a
  chip's own assignments run twice their even share at a time, in as many rounds as they
  need); its rounds' loop counts once, so both counts hold for routing within twice the
  balanced share.

XLA's cost analysis counts a loop's body once, so FLOPs and bytes come from each side's first 5
and first 7 decoder layers compiled unrolled (MaxText: `scan_layers=false
base_num_decoder_layers=N override_model_config=true`; its first layers follow the model's
`compress_ratios`, as ours do), extrapolated to 43 layers as `five + 19 * (seven - five)`; a
roofline time at v5p's published peak, `max(FLOPs / peak, bytes / HBM bandwidth)`; the MFU it
gives the step's useful FLOPs (`ed.train.train_flops`, the same for both: same model, same
tokens). Memory per chip is the whole model's program, each compiled as it runs by default
(layers scanned). Both MFUs are lower bounds: each side's routed experts are counted over the
rows of its buffers, not over the assignments routed (ours: `tpu_train.py`'s docstring;
MaxText's megablox kernels charge their whole buffer, `ragged_buffer_factor` times the
balanced share or the worst case). The routed experts' products are Pallas (Mosaic) kernels
on both sides (XLA lowers our `ragged_dot` to its own), which XLA charges what their own cost
estimates say: each is charged at least its operands and result (`hlo.pallas_shortfall` on
the optimised module, dumped by XLA), the bytes that adds are in the table. Estimates from
the compiler on a CPU host.

MaxText's environment (a benchmark dependency, not CI; about 3 minutes of `pip`):

1. A source snapshot of MaxText at commit e591f30cbbf217ed67ef71263ec0538239f9c3b8 (its
   `src/` tree is all that is used; a checkout may lack its tokenizer assets, which no compile
   reads). On Python 3.11, two PEP 695 lines are rewritten as plain assignments, nothing
   else: `type Implementation = ...` in `src/maxtext/kernels/mhc/api.py` and
   `type KernelContext = ...` in `src/maxtext/kernels/mhc/common.py`.
2. A virtual environment with jax, jaxlib and libtpu held at this project's pins:
   `python3 -m venv V && V/bin/pip install -c C jax==0.10.2 jaxlib==0.10.2 libtpu==0.0.52 -r
   MAXTEXT/src/dependencies/requirements/generated_requirements/tpu-requirements.txt`, where
   `C` holds the same three pins. MaxText runs from its tree (its package asks for Python 3.12
   and is not installed).

    python benchmarks/tpu_maxtext.py --maxtext MAXTEXT --maxtext-python V/bin/python
        [--work /tmp/tpu-maxtext] [--only ours ours-exchange default rbf2]

Each compile takes 7-9 minutes on a 2-core host (12 in all); its JSON in `--work` is reused when
there. Writes benchmarks/results/tpu_maxtext.{json,md}; with `--only`, the rows not compiled
are kept from the results file with the date they were recorded.
"""

import argparse
import json
import os
import pathlib
import shutil
import subprocess
import sys
import time


# MaxText's settings for the workload above; `CONFIGS` adds each configuration's own.
MAXTEXT_SETTINGS = (
    "model_name=deepseek4-284b",
    "compile_topology=v5p-512",
    "compile_topology_num_slices=1",
    "custom_mesh_and_rule=ep-as-cp",
    "ici_fsdp_parallelism=32",
    "ici_expert_parallelism=8",
    "ici_data_parallelism=1",
    "ici_tensor_parallelism=1",
    "ici_sequence_parallelism=1",
    "ici_context_parallelism=1",
    "ici_pipeline_parallelism=1",
    "dcn_data_parallelism=1",
    "max_target_length=4096",
    "per_device_batch_size=0.125",
    "weight_dtype=bfloat16",
    "dtype=bfloat16",
    "attention=dot_product",
    "enable_checkpointing=false",
)
CONFIGS = {"default": (), "rbf2": ("ragged_buffer_factor=2",)}
# Our rows (`tpu_train.py`'s runs): its default forms, and the routed experts whole on each chip
# with their rows exchanged by all-to-all (`Policy.expert_exchange`).
OURS = {"ours": "flash-256", "ours-exchange": "flash-256-exchange"}
# The model and tokens, the same in every row.
WORKLOAD = OURS["ours"]


def maxtext_arguments(config: str, layers: int | None) -> list[str]:
    """MaxText's `train_compile` overrides for `config`: its first `layers` decoder layers
    unrolled, or (`None`) the whole model as it runs by default (layers scanned)."""
    depth = ("scan_layers=false", "override_model_config=true", f"base_num_decoder_layers={layers}")
    name = f"run_name=tpu-maxtext-{config}-{layers or 'all'}"
    return [*MAXTEXT_SETTINGS, *CONFIGS[config], *(depth if layers else ()), name]


def dump_flags(dump: pathlib.Path) -> str:
    """`XLA_FLAGS` that also dump each compiled module's text into `dump`: the optimised
    module's text, which `compiled.as_text()` fails to print for a TPU module with
    asynchronous collectives, for `charged`."""
    return f"{os.environ.get('XLA_FLAGS', '')} --xla_dump_to={dump} --xla_dump_hlo_as_text"


def keep_dumped(dump: pathlib.Path, text: pathlib.Path) -> None:
    """The largest optimised module in `dump` (the step's) moved to `text`; `dump` removed."""
    modules = sorted(dump.glob("*after_optimizations.txt"), key=lambda p: p.stat().st_size)
    if modules:
        modules[-1].rename(text)
    shutil.rmtree(dump, ignore_errors=True)


def child(tree: pathlib.Path, config: str, layers: int | None, out: pathlib.Path) -> None:
    """In MaxText's environment: its `train_compile.main` unchanged, the compiled program
    caught as `jax.stages.Lowered.compile` returns it, and its analyses written to `out`."""
    os.environ["JAX_PLATFORMS"] = "cpu"
    dump = out.with_suffix(".dump")
    os.environ["XLA_FLAGS"] = dump_flags(dump)
    sys.path.insert(0, str(tree / "src"))
    import jax  # noqa: PLC0415 (MaxText's environment, not this project's)
    from maxtext.trainers.pre_train import train_compile  # noqa: PLC0415

    caught = {}
    compile_ = jax.stages.Lowered.compile

    def catch(self, *args, **kwargs):
        start = time.perf_counter()
        caught["compiled"] = compile_(self, *args, **kwargs)
        caught["seconds"] = time.perf_counter() - start
        return caught["compiled"]

    jax.stages.Lowered.compile = catch
    argv = maxtext_arguments(config, layers)
    train_compile.main(["train_compile", str(tree / "src/maxtext/configs/base.yml"), *argv])
    compiled = caught["compiled"]
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list | tuple) else cost
    memory = compiled.memory_analysis()
    fields = ("argument", "output", "alias", "temp", "generated_code")
    commit = subprocess.run(
        ["git", "-C", str(tree), "rev-parse", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    report = {
        "config": config,
        "layers": layers,
        "argv": argv,
        "maxtext_commit": commit or None,
        "jax": jax.__version__,
        "flops": float(cost["flops"]),
        "bytes_accessed": float(cost["bytes accessed"]),
        **{f"{f}_bytes": int(getattr(memory, f"{f}_size_in_bytes")) for f in fields},
        "compile_seconds": caught["seconds"],
    }
    keep_dumped(dump, out.with_suffix(".hlo.txt"))
    out.write_text(json.dumps(report, indent=2) + "\n")


def maxtext_compile(
    python: str, tree: pathlib.Path, config: str, layers: int | None, work: pathlib.Path
) -> dict:
    """MaxText's compile of `config` (`layers` as in `maxtext_arguments`), run in a process of
    its environment (reused from `work` when there): its report, or `{"error": ...}`."""
    out = work / f"maxtext-{config}-{layers or 'all'}.json"
    if not out.exists():
        # Compile only: libtpu may load beside another process's (a test, another compile).
        env = dict(os.environ, JAX_PLATFORMS="cpu", ALLOW_MULTIPLE_LIBTPU_LOAD="1")
        cmd = [python, __file__, "--child", str(tree), config, str(layers or 0), str(out)]
        result = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if result.returncode != 0:
            return {"error": f"exit {result.returncode}: {result.stderr[-2000:]}"}
    return json.loads(out.read_text())


def charged(cost: dict, text: pathlib.Path) -> dict:
    """A cost compile's report with its Pallas kernels charged at least their operands and
    results (`hlo.pallas_shortfall` on its module's `text`, where there is one): the kernels'
    count and the bytes added, under `"pallas"`, and `bytes_accessed` with them added."""
    from hlo import pallas_shortfall  # noqa: PLC0415 (this project's environment)

    if "error" in cost or not text.exists():
        return cost
    kernels, short = pallas_shortfall(text.read_text())
    pallas = {"kernels": kernels, "added_bytes": short, "xla_bytes": cost["bytes_accessed"]}
    return cost | {"bytes_accessed": cost["bytes_accessed"] + short, "pallas": pallas}


def our_row(work: pathlib.Path, name: str) -> dict:
    """Our row of `tpu_train.py`'s run `name`: as `tpu_train.measured`, with each cost
    compile's optimised module kept (`dump_flags`) to read its Pallas kernels (`charged`)."""
    from tpu_memory import compiled  # noqa: PLC0415 (this project's environment)
    from tpu_train import COST_LAYERS, arguments, layers, mfu_is, roofline, useful_flops

    memory = compiled(arguments(name, work / f"{name}.json"), work / f"{name}.json")
    costs = []
    for n in COST_LAYERS:
        out, dump = work / f"{name}-{n}.json", work / f"{name}-{n}.dump"
        cost = compiled(arguments(name, out, n), out, env={"XLA_FLAGS": dump_flags(dump)})
        keep_dumped(dump, out.with_suffix(".hlo.txt"))
        if "error" not in cost:
            cost["phases"]["train"] = charged(cost["phases"]["train"], out.with_suffix(".hlo.txt"))
        costs.append(cost)
    row = {"name": name, "memory": memory, "costs": costs}
    if not any("error" in c for c in costs):
        row |= roofline(costs, layers(name), useful_flops(name)) | {"mfu_is": mfu_is(costs)}
    return row


def maxtext_row(python: str, tree: pathlib.Path, config: str, work: pathlib.Path) -> dict:
    """MaxText's row: its whole-model compile (memory) and its cost compiles, their Pallas
    kernels charged at least their operands and results (`charged`)."""
    from tpu_train import COST_LAYERS, layers, roofline, useful_flops  # noqa: PLC0415

    memory = maxtext_compile(python, tree, config, None, work)
    texts = [work / f"maxtext-{config}-{n}.hlo.txt" for n in COST_LAYERS]
    costs = [
        charged(maxtext_compile(python, tree, config, n, work), text)
        for n, text in zip(COST_LAYERS, texts, strict=True)
    ]
    row = {"name": f"maxtext-{config}", "memory": memory, "costs": costs}
    if not any("error" in c for c in costs):
        shaped = [{"phases": {"train": c}} for c in costs]
        row |= roofline(shaped, layers(WORKLOAD), useful_flops(WORKLOAD))
    return row


def cells(row: dict) -> list[str]:
    """A row's table cells."""
    from equinox_dsv4.compile import TPU_PEAKS  # noqa: PLC0415

    gib = 2**30
    memory = row["memory"]
    if "error" in memory:
        held = f"refused: {memory['error'][-200:]}"
    else:  # ours: the compile tool's report; MaxText's: `child`'s
        held = memory["phases"]["train"] if "phases" in memory else memory
        held = f"{(held['argument_bytes'] + held['temp_bytes']) / gib:.2f} GiB"
    recorded = f" ({row['recorded']})" if "recorded" in row else ""
    if "cost_per_chip" not in row:
        return [row["name"] + recorded, held, "-", "-", "-", "-", "-"]
    peak, hbm = TPU_PEAKS["v5p"]
    cost = row["cost_per_chip"]
    bound = "compute" if cost["flops"] / peak >= cost["bytes_accessed"] / hbm else "memory"
    return [
        row["name"] + recorded,
        held,
        f"{cost['flops'] / 1e12:.1f}",
        f"{cost['bytes_accessed'] / gib:,.1f}",
        f"{row['estimate_seconds']:.2f} ({bound})",
        f">= {row['mfu_estimate']:.0%}",
        pallas_cell(row["costs"]),
    ]


def pallas_cell(costs: list[dict]) -> str:
    """The Pallas kernels of a row's cost compiles and the bytes their estimates left out
    (`charged`), or that their module texts were not read."""
    trains = [c["phases"]["train"] if "phases" in c else c for c in costs]
    if not all("pallas" in t for t in trains):
        return "not read (no module text)"
    from tpu_train import COST_LAYERS, at_depth, layers  # noqa: PLC0415

    counts = "/".join(str(t["pallas"]["kernels"]) for t in trains)
    added = at_depth(*(t["pallas"]["added_bytes"] for t in trains), layers(WORKLOAD))
    depths = "/".join(map(str, COST_LAYERS))
    return f"{counts} in the {depths}-layer programs; +{added / 2**30:.2f} GiB in the step"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--maxtext", type=pathlib.Path, help="MaxText's source tree")
    parser.add_argument("--maxtext-python", help="the Python of MaxText's environment")
    parser.add_argument(
        "--only",
        nargs="+",
        choices=[*OURS, *CONFIGS],
        help="these rows only; the others are kept from results/tpu_maxtext.json",
    )
    parser.add_argument("--work", default="/tmp/tpu-maxtext", help="per-compile JSON (reused)")
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        tree, config, layers, out = args.child
        child(pathlib.Path(tree), config, int(layers) or None, pathlib.Path(out))
        return 0

    from common import markdown, recorded, today, write  # noqa: PLC0415
    from tpu_train import layers  # noqa: PLC0415

    wanted = args.only or [*OURS, *CONFIGS]
    if set(wanted) & set(CONFIGS) and not (args.maxtext and args.maxtext_python):
        parser.error("MaxText's rows need --maxtext and --maxtext-python (the docstring)")
    work = pathlib.Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    kept = {r["name"]: r for r in recorded("tpu_maxtext").get("rows", [])}
    date = today()
    rows = []
    for key in [*OURS, *CONFIGS]:
        name = OURS.get(key, f"maxtext-{key}")
        if key not in wanted:
            if name in kept:
                rows.append(kept[name])
            continue
        if key in OURS:
            row = our_row(work, name)
        else:
            row = maxtext_row(args.maxtext_python, args.maxtext, key, work)
        rows.append({"recorded": date, **row})
        print(cells(rows[-1]), flush=True)
    header = ["train step (recorded)", "arguments + temporaries / chip (whole model)"]
    header += ["TFLOPs / chip", "GiB accessed / chip", "roofline s, v5p peak", "MFU estimate"]
    header += ["Pallas kernels, bytes their estimates left out"]
    table = markdown(header, [cells(r) for r in rows])
    extra = {"maxtext_settings": MAXTEXT_SETTINGS, "configs": CONFIGS, "layers": layers(WORKLOAD)}
    extra["table"] = table  # the performance page's (docs/performance.md)
    write("tpu_maxtext", rows, table, extra)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
