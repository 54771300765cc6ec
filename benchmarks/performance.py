"""Writes docs/performance.md from benchmarks/results/*.json: the machines the results were
measured on, the project's performance targets against the figures the result files give, and
one table per result file.

Every figure on the page is computed here from a result file; the targets are data
(`TARGETS`): what is measured, the threshold, the result file and how the figure is computed
from it. A target whose figure no result file gives reads "no result file". The output depends
on the result files alone (sorted, fixed formatting), so regenerating gives the same bytes;
`--check` says whether the page on disk is what this would write.

    python benchmarks/performance.py [--out docs/performance.md] [--check]

Standard library only: no JAX, no torch.
"""

import argparse
import dataclasses
import difflib
import json
import operator
import pathlib
import re
import sys
from collections.abc import Callable


ROOT = pathlib.Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
PAGE = ROOT / "docs" / "performance.md"
NO_RESULT = "no result file"
MIB, GIB = 2**20, 2**30


class Missing(LookupError):
    """A figure's result file, or the row it reads, is not there."""


# --- result files --------------------------------------------------------------------------


def load(results: pathlib.Path) -> dict[str, dict]:
    """Every `results/*.json` by its stem, in name order."""
    paths = sorted(results.glob("*.json"), key=lambda p: p.stem)
    return {p.stem: json.loads(p.read_text()) for p in paths}


def payload(results: dict[str, dict], name: str) -> dict:
    if name not in results:
        raise Missing(f"{name}.json")
    return results[name]


def row(results: dict[str, dict], name: str, /, **match) -> dict:
    """The first row of result file `name` whose fields equal `match`."""
    for r in payload(results, name).get("rows", []):
        if all(r.get(k) == v for k, v in match.items()):
            return r
    where = ", ".join(f"{k}={v}" for k, v in match.items())
    raise Missing(f"{name}.json has no row with {where}")


# --- targets -------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Figure:
    """A target's measured figure: `value` is compared with the threshold (None: reported
    only); `text` is what the page shows."""

    value: float | None
    text: str


@dataclasses.dataclass(frozen=True)
class Target:
    """A stated target: `name` (what is measured), `threshold` as stated, `compare` (">=",
    "<=", or None for a figure reported without a threshold) against `limit`, the result files
    it reads (`files`, the first being the one it is measured in) and `figure`, which computes
    the figure from the loaded result files (raising `Missing` when they lack it)."""

    name: str
    threshold: str
    compare: str | None
    limit: float | None
    files: tuple[str, ...]
    figure: Callable[[dict[str, dict]], Figure]


def _of_floor(name: str) -> Callable[[dict[str, dict]], Figure]:
    # decode_profile.py: the step against the floor of reading its weights at the float32 head's
    # rate, timed alternately in one run.
    def figure(results):
        r = row(results, name, batch=1, context=4096)
        text = f"{r['of_floor']:.0%} ({r['step_ms']:.2f} ms step, {r['floor_ms']:.2f} ms floor)"
        return Figure(r["of_floor"], text)

    return figure


def _batched(results) -> Figure:
    rows = sorted(payload(results, "batched_decode")["rows"], key=lambda r: r["batch"])
    if not rows:
        raise Missing("batched_decode.json has no rows")
    batches = " / ".join(str(r["batch"]) for r in rows)
    tok = " / ".join(f"{r['ours_tok_s']:.0f}" for r in rows)
    floor = " / ".join(f"{r['ours_of_floor']:.0%}" for r in rows)
    ratio = " / ".join(f"{r['ratio']:.2f}x" for r in rows)
    text = f"batch {batches}: {tok} tok/s; {floor} of the floor; {ratio} transformers"
    return Figure(None, text)


def _prefill_bf16_of_matmul(results) -> Figure:
    r = row(results, "prefill_profile", dtype="bfloat16", tokens=2048)
    text = (
        f"{r['of_matmul']:.0%} ({r['useful_GFLOPs']:.0f} of {r['matmul_GFLOPs']:.0f} GFLOP/s, "
        "median of alternating pairs)"
    )
    return Figure(r["of_matmul"], text)


def _tpu_roofline(results) -> Figure:
    parts = []
    for phase in ("decode", "prefill"):
        r = row(results, "tpu_roofline", name="flash-b-64", phase=phase)
        parts.append(
            f"{phase} {1e3 * r['estimate_seconds']:.2f} ms against a "
            f"{1e3 * r['floor_seconds']:.2f} ms floor ({r['estimate_over_floor']:.2f}x, "
            f"MFU {r['mfu_estimate']:.1%})"
        )
    return Figure(None, "; ".join(parts) + " (estimates)")


def _tpu_maxtext_figure(results) -> Figure:
    rows = [r for r in payload(results, "tpu_maxtext").get("rows", []) if "estimate_seconds" in r]
    mine = [r for r in rows if not r["name"].startswith("maxtext")]
    theirs = [r for r in rows if r["name"].startswith("maxtext")]
    if not mine or not theirs:
        raise Missing("tpu_maxtext.json has no estimated row of ours and of MaxText")
    # Each side's best row; whether the two were compiled in one run (recorded the same day).
    ours, best = (min(side, key=lambda r: r["estimate_seconds"]) for side in (mine, theirs))
    ratio = ours["estimate_seconds"] / best["estimate_seconds"]
    when = {ours.get("recorded"), best.get("recorded")}
    run = f"one run, {when.pop()}" if len(when) == 1 else "recorded apart"
    text = (
        f"ours ({ours['name']}) {ours['estimate_seconds']:.2f} s (MFU >= "
        f"{ours['mfu_estimate']:.0%}), MaxText's best ({best['name']}) "
        f"{best['estimate_seconds']:.2f} s (MFU >= {best['mfu_estimate']:.0%}): ours takes "
        f"{ratio:.2f}x its time ({run}; estimates)"
    )
    return Figure(ratio, text)


def _speedup(name: str, key: str, **match) -> Callable[[dict[str, dict]], Figure]:
    def figure(results):
        r = row(results, name, **match)
        if r.get(key) is None:
            raise Missing(f"{name}.json has no {key} where {match}")
        return Figure(r[key], f"{r[key]:.2f}x")

    return figure


def _decode_speedup(name: str, floor: bool = False) -> Callable[[dict[str, dict]], Figure]:
    # `floor`: say the best ratio decode_floor.json allows (float32, the same config).
    def figure(results):
        r = row(results, name, context=4096)
        if r.get("speedup") is None:
            raise Missing(f"{name}.json has no transformers time at 4096")
        text = f"{r['speedup']:.2f}x ({r['ours_ms']:.2f} against {r['transformers_ms']:.1f} ms)"
        if floor and "decode_floor" in results:
            best = row(results, "decode_floor", dtype="float32")["best_ratio"]
            text += f"; at most {best:.1f}x possible by decode_floor.json"
        return Figure(r["speedup"], text)

    return figure


def _long_context(name: str) -> Callable[[dict[str, dict]], Figure]:
    def figure(results):
        short, long = row(results, name, context=1024), row(results, name, context=65536)
        ratio = long["ours_ms"] / short["ours_ms"]
        text = f"{ratio:.2f}x ({long['ours_ms']:.2f} against {short['ours_ms']:.2f} ms)"
        return Figure(ratio, text)

    return figure


def _compile_depth(results) -> Figure:
    r = row(results, "compile_depth", layers=43, scan=True)
    base = row(results, "compile_depth", layers=4, scan=True)
    rounds = " / ".join(f"{x:.2f}" for x in r["vs_shallowest_runs"])
    text = (
        f"{r['vs_shallowest']:.2f}x ({r['total_seconds']:.1f} against "
        f"{base['total_seconds']:.1f} s; each round: {rounds})"
    )
    return Figure(r["vs_shallowest"], text)


def _prefill_of_matmul(name: str, dtype: str) -> Callable[[dict[str, dict]], Figure]:
    def figure(results):
        r = row(results, name, dtype=dtype, tokens=2048)
        text = (
            f"{r['fraction_of_matmul']:.0%} ({r['ours_flops_per_s'] / 1e9:.1f} of "
            f"{r['matmul_flops_per_s'] / 1e9:.1f} GFLOP/s)"
        )
        return Figure(r["fraction_of_matmul"], text)

    return figure


# The targets the project states: first against the machine's own limits (the floor of reading
# the weights a decoded token needs at the measured bandwidth, the matmul rate measured in the
# same run), then the earlier ratios against transformers, kept as reported figures.
TARGETS: tuple[Target, ...] = (
    Target(
        "decode, float32, batch 1, 4k context: step against its bandwidth floor",
        ">= 70% of the floor",
        ">=",
        0.70,
        ("decode_profile",),
        _of_floor("decode_profile"),
    ),
    Target(
        "decode, bfloat16, batch 1, 4k context: step against its floor (half the bytes)",
        ">= 60% of the floor",
        ">=",
        0.60,
        ("decode_profile-bfloat16",),
        _of_floor("decode_profile-bfloat16"),
    ),
    Target(
        "batched decode, float32, 4k context: tokens/s against a touched-experts floor",
        "reported (no threshold)",
        None,
        None,
        ("batched_decode",),
        _batched,
    ),
    Target(
        "prefill, bfloat16, 2048 tokens: useful FLOP/s against the bf16 matmul rate",
        ">= 45% of the matmul rate",
        ">=",
        0.45,
        ("prefill_profile",),
        _prefill_bf16_of_matmul,
    ),
    Target(
        "TPU roofline: V4-Flash, bf16, v5p:4x4x4, compiler estimate against the floor",
        "reported as compiler estimates (no threshold)",
        None,
        None,
        ("tpu_roofline",),
        _tpu_roofline,
    ),
    Target(
        "TPU train step: V4-Flash, bf16, v5p:4x8x8, roofline time beside MaxText's best",
        "reported as compiler estimates (no threshold)",
        None,
        None,
        ("tpu_maxtext",),
        _tpu_maxtext_figure,
    ),
    Target(
        "prefill, float32, 2048 tokens: against transformers",
        ">= 3x",
        ">=",
        3.0,
        ("prefill",),
        _speedup("prefill", "speedup", dtype="float32", tokens=2048),
    ),
    Target(
        "prefill, bfloat16, 2048 tokens: against transformers",
        ">= 3x",
        ">=",
        3.0,
        ("prefill",),
        _speedup("prefill", "speedup", dtype="bfloat16", tokens=2048),
    ),
    Target(
        "prefill, float32, 2048 tokens, freed memory kept: against transformers",
        ">= 3x",
        ">=",
        3.0,
        ("prefill-keep-freed-memory",),
        _speedup("prefill-keep-freed-memory", "speedup", dtype="float32", tokens=2048),
    ),
    Target(
        "prefill, bfloat16, 2048 tokens, freed memory kept: against transformers",
        ">= 3x",
        ">=",
        3.0,
        ("prefill-keep-freed-memory",),
        _speedup("prefill-keep-freed-memory", "speedup", dtype="bfloat16", tokens=2048),
    ),
    Target(
        "decode, float32, 4k context: per token against transformers",
        ">= 10x",
        ">=",
        10.0,
        ("decode", "decode_floor"),
        _decode_speedup("decode", floor=True),
    ),
    Target(
        "decode, bfloat16, 4k context: per token against transformers",
        ">= 10x",
        ">=",
        10.0,
        ("decode-bfloat16",),
        _decode_speedup("decode-bfloat16"),
    ),
    Target(
        "decode, float32, 43 layers (scanned), 4k context: per token against transformers",
        ">= 10x",
        ">=",
        10.0,
        ("decode-43-layers",),
        _decode_speedup("decode-43-layers"),
    ),
    Target(
        "decode, float32: ms per token at 64k context over at 1k",
        "<= 1.5x",
        "<=",
        1.5,
        ("decode",),
        _long_context("decode"),
    ),
    Target(
        "decode, bfloat16: ms per token at 64k context over at 1k",
        "<= 1.5x",
        "<=",
        1.5,
        ("decode-bfloat16",),
        _long_context("decode-bfloat16"),
    ),
    Target(
        "decode, float32, 43 layers (scanned): ms per token at 64k context over at 1k",
        "<= 1.5x",
        "<=",
        1.5,
        ("decode-43-layers",),
        _long_context("decode-43-layers"),
    ),
    Target(
        "compile, layers scanned: 43 layers' total over 4 layers'",
        "<= 1.5x",
        "<=",
        1.5,
        ("compile_depth",),
        _compile_depth,
    ),
    Target(
        "prefill, float32, 2048 tokens: useful FLOP/s against the matmul rate",
        ">= 30% of the matmul rate",
        ">=",
        0.30,
        ("prefill",),
        _prefill_of_matmul("prefill", "float32"),
    ),
    Target(
        "prefill, bfloat16, 2048 tokens: useful FLOP/s against the matmul rate",
        ">= 30% of the matmul rate",
        ">=",
        0.30,
        ("prefill",),
        _prefill_of_matmul("prefill", "bfloat16"),
    ),
)


COMPARE = {">=": operator.ge, "<=": operator.le}


def evaluate(target: Target, results: dict[str, dict]) -> dict[str, str]:
    """One row of the targets table: `target`, `threshold`, `measured`, `status`, `file`."""
    try:
        try:
            figure = target.figure(results)
        except KeyError as key:
            raise Missing(f"a result file lacks the field {key}") from key
    except Missing as missing:
        # A missing file says no more; a file without the row or field says which.
        measured = NO_RESULT
        if str(missing) not in {f"{n}.json" for n in target.files}:
            measured += f" ({missing})"
        status, source = "-", "-"
    else:
        measured = figure.text
        if target.compare is None or figure.value is None:
            status = "reported"
        else:
            ok = COMPARE[target.compare](figure.value, target.limit)
            status = "met" if ok else "missed"
        source = ", ".join(
            f"[`{n}.json`](#{anchor(n)}) ({results[n].get('date', 'date not recorded')})"
            for n in target.files
            if n in results
        )
    return {
        "target": target.name,
        "threshold": target.threshold,
        "measured": measured,
        "status": status,
        "file": source,
    }


# --- machines ------------------------------------------------------------------------------


def machine_key(machine: dict) -> str:
    return json.dumps(machine, sort_keys=True)


def machines(results: dict[str, dict]) -> dict[str, str]:
    """A letter for each distinct `machine` record, in the order of the first file (by name)
    that records it."""
    labels: dict[str, str] = {}
    for data in results.values():
        if "machine" in data:
            labels.setdefault(machine_key(data["machine"]), chr(ord("A") + len(labels)))
    return labels


def vector_summary(flags: list[str]) -> str:
    """The CPU's vector extensions: the AVX / FMA ones, then AVX-512's and AMX's subsets."""
    plain = sorted(f.upper().replace("_", "-") for f in flags if not f.startswith(("avx5", "amx")))
    avx512 = sorted(
        f.removeprefix("avx512").lstrip("_").upper() for f in flags if f.startswith("avx512")
    )
    amx = sorted(f.removeprefix("amx").lstrip("_").upper() for f in flags if f.startswith("amx"))
    parts = [", ".join(plain)] if plain else []
    parts += [f"AVX-512 ({', '.join(avx512)})"] if avx512 else []
    parts += [f"AMX ({', '.join(amx)})"] if amx else []
    return "; ".join(parts) or "-"


def machine_of(data: dict, labels: dict[str, str]) -> str:
    if "machine" not in data:
        return "not recorded"
    return labels[machine_key(data["machine"])]


# --- formatting ----------------------------------------------------------------------------


def markdown(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def anchor(name: str) -> str:
    # GitHub's anchor for the section heading "`NAME.json`".
    return re.sub(r"[^a-z0-9_ -]", "", f"{name}.json".lower()).replace(" ", "-")


def pct(x: float) -> str:
    return f"{100 * x:.0f}%"


def mesh_text(mesh) -> str:
    if isinstance(mesh, str):
        return mesh
    return ",".join(f"{k}={v}" for k, v in mesh.items() if v != 1) or "1 device"


# --- one table (or a few) per result file ---------------------------------------------------


def _prefill(data: dict) -> str:
    lines = []
    for r in data["rows"]:
        lines.append(
            [
                r["dtype"],
                r["tokens"],
                f"{r['ours_tokens_per_s']:.0f}",
                f"{r['transformers_tokens_per_s']:.0f}",
                f"{r['speedup']:.2f}x",
                f"{r['ours_flops_per_s'] / 1e9:.1f}",
                f"{r['matmul_flops_per_s'] / 1e9:.1f}",
                pct(r["fraction_of_matmul"]),
                f"{r['best_ratio']:.1f}x",
                f"{r['ours_page_faults'] / 1e3:.0f}k / {r['transformers_page_faults'] / 1e3:.0f}k",
            ]
        )
    header = ["dtype", "tokens", "ours tok/s", "transformers tok/s", "ratio", "ours GFLOP/s"]
    header += ["matmul GFLOP/s", "of matmul", "best possible ratio"]
    header += ["page faults per call, ours / transformers"]
    return markdown(header, lines)


def _matmul(data: dict) -> str:
    lines = []
    for r in data["rows"]:
        f32 = r.get("jax_f32_result_gflops")
        f32_ratio = r.get("torch_over_jax_f32_result")
        lines.append(
            [
                r["dtype"],
                " x ".join(str(d) for d in r["shape"]),
                f"{r['jax_gflops']:.0f}",
                "-" if f32 is None else f"{f32:.0f}",
                f"{r['torch_gflops']:.0f}",
                f"{r['torch_over_jax']:.2f}x",
                "-" if f32_ratio is None else f"{f32_ratio:.2f}x",
            ]
        )
    header = ["dtype", "m x k x n", "XLA GFLOP/s", "XLA GFLOP/s, float32 result", "torch GFLOP/s"]
    header += ["torch speed / XLA speed", "torch / XLA, float32 result"]
    return markdown(header, lines)


def _decode(data: dict) -> str:
    rows = data["rows"]
    lines = []
    for r in rows:
        ref = r.get("transformers_ms")
        lines.append(
            [
                r["context"],
                f"{r['ours_ms']:.2f}",
                "-" if ref is None else f"{ref:.1f}",
                "-" if ref is None else f"{r['speedup']:.2f}x",
                f"{r['ours_vs_first']:.2f}",
                f"{r['ours_page_faults']:.0f} / "
                + ("-" if ref is None else f"{r['transformers_page_faults']:.0f}"),
            ]
        )
    header = ["context", "ours ms / token", "transformers ms / token", "ratio"]
    header += [f"ours vs {rows[0]['context']}" if rows else "ours vs first"]
    header += ["page faults per token, ours / transformers"]
    intro = f"{data.get('dtype', 'float32')}, {data['config']['num_hidden_layers']} layers"
    intro += f", {data['steps']} timed steps per context.\n\n" if "steps" in data else ".\n\n"
    return intro + markdown(header, lines)


def _decode_floor(data: dict) -> str:
    out = []
    for r in data["rows"]:
        out.append(
            markdown(
                ["dtype", "head MiB", "JAX ms", "torch ms", "JAX GB/s", "torch GB/s"],
                [
                    [
                        r["dtype"],
                        f"{r['head_bytes'] / MIB:.0f}",
                        f"{r['jax_ms']:.2f}",
                        f"{r['torch_ms']:.2f}",
                        f"{r['jax_GBps']:.1f}",
                        f"{r['torch_GBps']:.1f}",
                    ]
                ],
            )
        )
        out.append(
            markdown(
                [
                    "weights per token MiB",
                    "floor ms (at the faster rate)",
                    f"transformers ms / token at {r['context']}",
                    "best possible ratio",
                ],
                [
                    [
                        f"{r['step_bytes'] / MIB:.0f}",
                        f"{r['floor_ms']:.2f}",
                        f"{r['transformers_step_ms']:.1f}",
                        f"{r['best_ratio']:.1f}x",
                    ]
                ],
            )
        )
    return "\n".join(out)


def _decode_profile(data: dict) -> str:
    out = []
    for r in data["rows"]:
        label = r["dtype"] + ("" if r["batch"] == 1 else f", batch {r['batch']}")
        out.append(
            markdown(
                ["dtype", "context", "step ms", "weights MiB", "float32 head alone ms (GB/s)"]
                + ["floor ms", "of floor"],
                [
                    [
                        label,
                        r["context"],
                        f"{r['step_ms']:.2f}",
                        f"{r['step_bytes'] / MIB:.0f}",
                        f"{r['head_alone_ms']:.2f} ({r['head_GBps']:.1f})",
                        f"{r['floor_ms']:.2f}",
                        pct(r["of_floor"]),
                    ]
                ],
            )
        )
        kernels = [[c, f"{k['kernels']:.0f}", f"{k['ms']:.2f}"] for c, k in r["kernels"].items()]
        total = sum(k["kernels"] for k in r["kernels"].values())
        kernels.append(["all kernels", f"{total:.0f}", f"{r['kernels_ms']:.2f}"])
        out.append(
            markdown(["kernel class (traced steps)", "kernels / step", "ms / step"], kernels)
        )
        alone, head = r["experts_alone"], r["head_alone"]
        out.append(
            markdown(
                [f"kernel alone, {r['dtype']}", "ours GB/s", "torch GB/s"]
                + ["float32 head (bandwidth) GB/s"],
                [
                    [
                        f"routed experts, {alone['bytes'] / MIB:.0f} MiB chosen",
                        f"{alone['ours_GBps']:.1f} ({alone['ours_ms']:.2f} ms)",
                        f"{alone['torch_GBps']:.1f} ({alone['torch_ms']:.2f} ms)",
                        f"{r['head_GBps']:.1f}",
                    ],
                    [
                        "output head",
                        f"{head['ours_GBps']:.1f}",
                        f"{head['torch_GBps']:.1f}",
                        f"{r['head_GBps']:.1f}",
                    ],
                ],
            )
        )
    return "\n".join(out)


def _batched_decode(data: dict) -> str:
    lines = [
        [
            r["batch"],
            f"{r['ours_ms']:.1f}",
            f"{r['transformers_ms']:.1f}",
            f"{r['ours_tok_s']:.0f}",
            f"{r['transformers_tok_s']:.0f}",
            f"{r['ratio']:.2f}x",
            f"{r['floor_bytes'] / MIB:.0f}",
            f"{r['floor_tok_s']:.0f}",
            pct(r["ours_of_floor"]),
        ]
        for r in data["rows"]
    ]
    header = ["batch", "ours ms / step", "transformers ms / step", "ours tok/s"]
    header += ["transformers tok/s", "ratio", "floor MiB / step", "floor tok/s", "ours of floor"]
    intro = f"Context {data['context']} tokens, float32.\n\n" if "context" in data else ""
    return intro + markdown(header, lines)


def _serve(data: dict) -> str:
    lines = [
        [
            r["clients"],
            r["requests"],
            f"{r['served']['requests_per_s']:.2f}",
            f"{r['generate']['requests_per_s']:.2f}",
            f"{r['requests_per_s_ratio']:.2f}x",
            f"{1e3 * r['served']['median_first_token_s']:.0f}",
            f"{1e3 * r['generate']['median_first_token_s']:.0f}",
            f"{r['first_token_ratio']:.2f}x",
        ]
        for r in data["rows"]
    ]
    header = ["clients", "requests", "server req/s", "generate req/s", "server / generate"]
    header += ["server first token ms", "generate first token ms", "generate / server"]
    new = data["rows"][0]["new_tokens"] if data["rows"] else "?"
    intro = (
        f"The {data.get('config', '?')} config, {data.get('layers', '?')} layers, float32; "
        f"replies of {new[0]} to {new[1]} greedy tokens (`generate`: each batch its longest); "
        "first token: the median over requests.\n\n"
    )
    return intro + markdown(header, lines)


def _prefill_profile(data: dict) -> str:
    out = []
    for r in data["rows"]:
        out.append(
            markdown(
                ["dtype, tokens", "prefill ms", "useful GFLOP/s (of matmul)", "matmul GFLOP/s"]
                + ["products: ms, GFLOP/s (of matmul)", "other kernels ms"]
                + ["of matmul if the rest took no time"],
                [
                    [
                        f"{r['dtype']}, {r['tokens']}",
                        f"{r['prefill_ms']:.1f}",
                        f"{r['useful_GFLOPs']:.0f} ({pct(r['of_matmul'])})",
                        f"{r['matmul_GFLOPs']:.0f}",
                        f"{r['products_ms']:.1f}, {r['products_GFLOPs']:.0f} "
                        f"({pct(r['products_of_matmul'])})",
                        f"{r['other_kernels_ms']:.1f}",
                        pct(r["bound_if_rest_free"]),
                    ]
                ],
            )
        )
        out.append(
            markdown(
                ["kernels without a product, by part", "kernels", "ms", "MiB read + written"]
                + [f"GB/s (of the {r['stream_GBs']:.1f} GB/s stream)"],
                [
                    [
                        p["part"],
                        p["kernels"],
                        f"{p['ms']:.1f}",
                        f"{p['bytes'] / MIB:.0f}",
                        f"{p['bytes'] / p['ms'] / 1e6:.1f} ({pct(p['of_stream'])})",
                    ]
                    for p in r["other_kernels"]
                ],
            )
        )
        products = []
        for p in r["longest_products"]:
            sig = p["signature"].replace("|", "\\|")
            ratio = p["torch_GFLOPs"] / p["xla_GFLOPs"]
            products.append(
                [
                    f"`{sig}`",
                    f"{p['ms_in_prefill']:.2f}",
                    f"{p['xla_GFLOPs']:.0f}",
                    f"{p['torch_GFLOPs']:.0f}",
                    f"{ratio:.2f}x",
                ]
            )
        header = ["product (XLA's signature)", "ms in the prefill", "XLA GFLOP/s alone"]
        header += ["torch GFLOP/s alone", "torch / XLA"]
        out.append(markdown(header, products))
    return "\n".join(out)


def _quantized(data: dict) -> str:
    lines = [
        [r["context"], f"{r['quantized_ms']:.2f}", f"{r['bf16_ms']:.2f}", f"{r['ratio']:.2f}"]
        for r in data["rows"]
    ]
    out = markdown(
        ["context", "quantised ms / token", "bf16 ms / token", "bf16 / quantised"], lines
    )
    sizes = data.get("bytes")
    if sizes:
        out += (
            f"\nResident weights: bf16 {sizes['bf16'] / MIB:.1f} MiB, quantised "
            f"{sizes['quantized'] / MIB:.1f} MiB (x{sizes['quantized'] / sizes['bf16']:.2f}).\n"
        )
    return out


def speculative_table(rows: list[dict]) -> str:
    """The table `speculative.py` prints and writes: a row per (trained model, sampling, batch)."""
    header = ["drafter", "trained (lm / mtp loss)", "batch", "sampling", "plain tokens/s"]
    header += ["speculative tokens/s", "speed-up", "acceptance", "tokens / main call"]
    header += ["step cost (spec / plain)"]
    lines = [
        [
            r.get("drafter", "mtp"),
            f"{r['trained_steps']} steps ({r['lm']:.2f} / {r['mtp']:.2f})",
            r["batch"],
            r["sampling"],
            f"{r['plain_tokens_per_s']:.1f}",
            f"{r['speculative_tokens_per_s']:.1f}",
            f"{r['speedup']:.2f}x",
            f"{r['acceptance']:.0%}",
            f"{r['tokens_per_main_call']:.2f}",
            f"{r['speculative_seconds_per_step'] / r['plain_seconds_per_step']:.2f}",
        ]
        for r in rows
    ]
    return markdown(header, lines)


def _speculative(data: dict) -> str:
    intro = ""
    if "training" in data:
        t = data["training"]
        intro = f"Trained {t['steps']} steps in {t['seconds']:.0f} s"
        intro += f" on {data['text_tokens']} tokens" if "text_tokens" in data else ""
        intro += "."
        if "dspark_training" in data:
            d = data["dspark_training"]
            intro += (
                f" DSpark drafter: {d['steps']} steps on the frozen trunk in {d['seconds']:.0f} s."
            )
        intro += "\n\n"
    return intro + speculative_table(data["rows"])


def _compile_depth(data: dict) -> str:
    rows = data["rows"]
    lines = [
        [
            r["layers"],
            "scan" if r["scan"] else "unrolled",
            f"{r['trace_lower_seconds']:.1f}",
            f"{r['compile_seconds']:.1f}",
            f"{r['total_seconds']:.1f}",
            " / ".join(f"{t:.1f}" for t in r["total_seconds_runs"]),
            f"{r['argument_bytes'] / MIB:.0f}",
            f"{r['temp_bytes'] / MIB:.0f}",
            f"{r['vs_shallowest']:.2f}",
            " / ".join(f"{x:.2f}" for x in r["vs_shallowest_runs"]),
        ]
        for r in rows
    ]
    first = min((r["layers"] for r in rows), default=0)
    header = ["layers", "stack", "trace + lower s", "compile s", "total s", "each run's total s"]
    header += ["arguments MiB", "temporaries MiB", f"total vs {first} layers", "each round's"]
    return markdown(header, lines)


def _compile_full(data: dict) -> str:
    lines = []
    for phase, p in data["phases"].items():
        lines.append(
            [
                f"{phase}, sequences of {p['tokens_per_sequence']} "
                + ("token" if p["tokens_per_sequence"] == 1 else "tokens"),
                f"{p['trace_lower_seconds']:.1f}",
                f"{p['compile_seconds']:.1f}",
                f"{p['argument_bytes'] / GIB:.2f}",
                f"{data['parameter_bytes_per_device_ideal'] / GIB:.2f}",
                f"{p['temp_bytes'] / GIB:.2f}",
                f"{p['flops'] / 1e12:.2f}",
            ]
        )
    intro = (
        f"{data['model']}, {data['dtype']}, {data['devices']} devices ({mesh_text(data['mesh'])}), "
        f"batch {data['batch']}, cache {data['max_len']} tokens.\n\n"
    )
    header = ["step", "trace + lower s", "compile s", "arguments GiB / device"]
    header += ["parameters / devices GiB", "temporaries GiB / device"]
    header += ["TFLOPs per device (XLA; a loop body once)"]
    return intro + markdown(header, lines)


def _convert(data: dict) -> str:
    cells = [
        f"{data['checkpoint_bytes'] / 1e9:.2f} GB",
        f"{data['shards']} ({data['largest_shard_bytes'] / MIB:.0f} MiB)",
        f"{data['output_bytes'] / 1e9:.2f} GB",
        f"{data['seconds']:.1f} s",
        f"{data['throughput_mb_s']:.0f} MB/s",
        f"{data['baseline_rss_bytes'] / MIB:.0f} MiB",
        f"{data['peak_rss_bytes'] / MIB:.0f} MiB",
        f"{data['bound_bytes'] / MIB:.0f} MiB",
        f"{data['peak_over_baseline_in_shards']:.2f} shards",
        "yes" if data["within_bound"] else "no",
    ]
    header = ["checkpoint", "shards (largest)", "output", "time", "throughput", "baseline RSS"]
    header += ["peak RSS", "bound (baseline + 1.5 x shard)", "peak - baseline", "within bound"]
    return markdown(header, [cells])


def _refusal(error: str) -> str:
    oom = re.search(r"HLO temporaries \(([\d.]+\w)\) exceeds available HBM \(([\d.]+\w)\)", error)
    if oom:
        return f"out of memory: {oom[1]}B of temporaries > {oom[2]}B"
    return error.replace("|", "\\|")


def _tpu_memory(data: dict) -> str:
    lines = []
    for r in data["rows"]:
        if "error" in r:
            name = r["name"] + (f" ({r['recorded']})" if "recorded" in r else "")
            lines.append([name, "-", "-", "-", "-", "-", "-", "-", _refusal(r["error"])])
            continue
        weights = "FP8/FP4" if r["quantized"] else "bf16"
        weights += f", {r['numerics']} numerics" if r.get("numerics") == "release" else ""
        cells = [
            r["name"] + (f" ({r['recorded']})" if "recorded" in r else ""),
            f"{r['model']}, {weights}",
            f"{r['devices']} ({r['topology']}), {mesh_text(r['mesh'])}",
            f"{r['parameter_bytes_per_device_ideal'] / GIB:.2f} GiB",
        ]
        for phase in ("prefill", "decode", "draft", "train"):
            p = r["phases"].get(phase)
            if p is None:
                cells.append("-")
                continue
            a, t = p["argument_bytes"] / GIB, p["temp_bytes"] / GIB
            cells.append(f"{a:.2f} + {t:.2f} = {a + t:.2f} GiB")
        lines.append(cells + ["-"])
    header = ["run (recorded)", "model, weights", "chips (topology), mesh", "weights / chips"]
    header += ["prefill: arguments + temporaries", "decode: arguments + temporaries"]
    header += ["draft step (DSpark): arguments + temporaries"]
    header += ["train step: arguments + temporaries", "compiler refused"]
    return markdown(header, lines)


def _tpu_experts(data: dict) -> str:
    lines = []
    for r in data["rows"]:
        lines.append(
            [
                r["kernel"],
                f"{r['phase']}, {r['tokens_per_sequence']} tokens",
                f"{r['argument_bytes'] / GIB:.2f} GiB",
                f"{r['temp_bytes'] / GIB:.3f} GiB",
                f"{r['flops']:.3g}",
                f"{r['bytes_accessed'] / GIB:.1f} GiB",
            ]
        )
    header = ["experts", "phase", "arguments / chip", "temporaries / chip"]
    header += ["FLOPs (XLA, loop bodies once)", "bytes (XLA, loop bodies once)"]
    return markdown(header, lines)


def _tpu_roofline(data: dict) -> str:
    out, lines, parts = [], [], []
    for r in data["rows"]:
        lines.append(
            [
                r["name"] + (f" ({r['recorded']})" if "recorded" in r else ""),
                f"{r['weights']}, {r['topology']}, {r['mesh']}",
                f"{r['phase']}, {r['tokens']} tokens",
                f"{r['xla_flops_per_chip'] / 1e12:.2f} / {r['floor_flops_per_chip'] / 1e12:.2f} "
                f"({r['flops_over_floor']:.2f}x)",
                f"{r['xla_bytes_per_chip'] / GIB:.2f} / {r['floor_bytes_per_chip'] / GIB:.2f} "
                f"({r['bytes_over_floor']:.2f}x)",
                f"{1e3 * r['compute_seconds']:.2f} / {1e3 * r['memory_seconds']:.2f}",
                f"{1e3 * r['estimate_seconds']:.2f}",
                f"{1e3 * r['floor_seconds']:.2f}",
                f"{r['estimate_over_floor']:.2f}x",
                pct(r["mfu_estimate"]),
            ]
        )
        traffic = r.get("traffic_by_part", {})
        total = sum(traffic.values())
        largest = sorted(traffic.items(), key=lambda kv: (-kv[1], kv[0]))[:6]
        for part, n in largest:
            parts.append([r["name"], r["phase"], part, f"{n / GIB:.2f}", pct(n / total)])
    header = ["run (recorded)", "weights, topology, mesh", "step", "TFLOPs per chip: XLA / floor"]
    header += ["GiB accessed per chip: XLA / floor", "ms at peak: compute / memory"]
    header += ["estimate ms", "floor ms", "estimate / floor", "MFU (useful FLOPs)"]
    out.append(markdown(header, lines))
    if parts:
        header = ["run", "step", "part (largest six)", "GiB read + written per chip", "share"]
        out.append(markdown(header, parts))
    layer = data.get("prefill_layer")
    if layer:
        total = sum(layer["parts"].values())
        ordered = sorted(layer["parts"].items(), key=lambda kv: (-kv[1], kv[0]))
        lines = [[k, f"{v / GIB:.2f}", pct(v / total)] for k, v in ordered]
        lines.append(["all (operands + results)", f"{total / GIB:.2f}", "100%"])
        lines.append(["XLA's bytes accessed", f"{layer['xla_bytes'] / GIB:.2f}", ""])
        header = [f"one prefill layer ({layer['run']}'s layer {layer['layer']})", "GiB per chip"]
        out.append(markdown(header + ["share"], lines))
    return "\n".join(out)


def _tpu_train(data: dict) -> str:
    lines = []
    for r in data["rows"]:
        memory = r["memory"]
        if "error" in memory:
            lines.append([r["name"]] + ["-"] * 5 + [f"refused ({_refusal(memory['error'])})"])
            lines[-1] += ["-", "-", "-"]
            continue
        train = memory["phases"]["train"]
        a, t = train["argument_bytes"] / GIB, train["temp_bytes"] / GIB
        if "mfu_estimate" in r:
            cost = r["cost_per_chip"]
            compute = cost["flops"] / data["peak_flops"]
            bound = (
                "compute"
                if compute >= cost["bytes_accessed"] / data["hbm_bytes_per_s"]
                else "memory"
            )
            # The older rows, without `mfu_is`, counted the experts' loop once: upper bounds.
            sign = ">=" if r.get("mfu_is") == "lower bound" else "<="
            mfu = f"{sign} {r['mfu_estimate']:.0%} ({r['estimate_seconds']:.2f} s, {bound})"
        elif any("error" in c for c in r["costs"]):
            mfu = "n/a: " + next(_refusal(c["error"]) for c in r["costs"] if "error" in c)
        else:
            mfu = "not estimated (no cost compiles)"
        lines.append(
            [
                r["name"],
                f"{memory['model']}, {memory['layers']} layers",
                f"{memory['devices']} ({memory['topology']}), {mesh_text(memory['mesh'])}",
                f"{memory['batch']} x {train['tokens_per_sequence']}",
                memory["remat"],
                memory["micro_batches"],
                f"{a:.2f} GiB",
                f"{t:.2f} GiB",
                f"{a + t:.2f} GiB",
                mfu,
            ]
        )
    header = ["run", "model", "chips (topology), mesh", "global batch x sequence", "remat"]
    header += ["micro-batches", "arguments / chip", "temporaries / chip", "total / chip"]
    header += ["MFU estimate (step time), v5p peak"]
    return markdown(header, lines)


def _generic(data: dict) -> str:
    rows = [r for r in data.get("rows", []) if isinstance(r, dict)]
    keys = sorted({k for r in rows for k, v in r.items() if isinstance(v, str | int | float)})
    if not rows or not keys:
        return "No table for this file: this script has no renderer for it.\n"

    def cell(v):
        return "-" if v is None else f"{v:.4g}" if isinstance(v, float) else str(v)

    return markdown(keys, [[cell(r.get(k)) for k in keys] for r in rows])


@dataclasses.dataclass(frozen=True)
class Section:
    """How one result file is shown: its title, the script that writes it, a sentence on what
    it is (no figures), whether its figures are a compiler's estimates, and its table(s)."""

    title: str
    script: str
    about: str
    render: Callable[[dict], str]
    estimate: str = ""


_TPU = (
    "**Estimates, not measurements**: XLA's TPU compiler (libtpu) compiled these on a CPU host "
    "and no TPU ran them; memory is the compiler's per-chip analysis"
)
SECTIONS: dict[str, Section] = {
    "prefill": Section(
        "Prefill",
        "prefill.py",
        "Prefill tokens/s against transformers, alternating calls, median of the pairs' ratios; "
        "useful FLOP/s against a large matmul timed in the same run.",
        _prefill,
    ),
    "prefill-keep-freed-memory": Section(
        "Prefill, freed memory kept",
        "prefill.py --keep-freed-memory",
        "As `prefill.json`, with glibc's malloc keeping freed memory for both frameworks.",
        _prefill,
    ),
    "matmul": Section(
        "Matmul kernels",
        "matmul.py",
        "XLA:CPU's matmul against torch's on the prefill's shapes, same operands and threads.",
        _matmul,
    ),
    "decode": Section(
        "Decode",
        "decode.py",
        "Milliseconds per decoded token after a prefill of each context, against transformers' "
        "one-token forwards where it finishes, steps alternating.",
        _decode,
    ),
    "decode-bfloat16": Section(
        "Decode, bfloat16",
        "decode.py --dtype bfloat16",
        "As `decode.json`, both models' weights in bfloat16.",
        _decode,
    ),
    "decode-43-layers": Section(
        "Decode, 43 layers",
        "decode.py --layers 43",
        "As `decode.json` at V4-Flash's depth (its repeating layers scanned).",
        _decode,
    ),
    "decode_floor": Section(
        "Decode floor",
        "decode_floor.py",
        "The output head's matrix-vector product in both frameworks, and the time to read the "
        "weights one decoded token needs at the faster rate, against transformers' step.",
        _decode_floor,
    ),
    "decode_profile": Section(
        "Decode against its bandwidth floor",
        "decode_profile.py",
        "The step alternating with the float32 head alone (the machine's bandwidth); the floor "
        "is the step's weights at that rate. Then its kernels from `jax.profiler`, and the "
        "largest kernels alone against torch's.",
        _decode_profile,
    ),
    "decode_profile-bfloat16": Section(
        "Decode against its bandwidth floor, bfloat16",
        "decode_profile.py --dtype bfloat16",
        "As `decode_profile.json`, bfloat16 weights (the yardstick stays a float32 stream).",
        _decode_profile,
    ),
    "decode_profile-batch-8": Section(
        "Decode against its bandwidth floor, batch 8",
        "decode_profile.py --batch 8",
        "As `decode_profile.json` at batch 8; the floor counts the experts the batch touches.",
        _decode_profile,
    ),
    "batched_decode": Section(
        "Batched decode",
        "batched_decode.py",
        "Tokens/s at each batch against transformers, and against a floor: the weights at the "
        "head's rate with the routed experts the batch touches, plus each row's cache reads.",
        _batched_decode,
    ),
    "serve": Section(
        "Serving: continuous batching against batched generate",
        "serve.py",
        "Requests per second and time to the first token with N clients at once: the server "
        "over HTTP (as many slots as clients) against `ed.generate` on the same prompts in "
        "batches of N, in one run.",
        _serve,
    ),
    "prefill_profile": Section(
        "bfloat16 prefill against the matmul rate",
        "prefill_profile.py",
        "The prefill alternating with a bf16 matmul (the share: median over the pairs), then "
        "profiled: its products, the kernels without a product by part of the model, and the "
        "longest products alone against torch's.",
        _prefill_profile,
    ),
    "quantized": Section(
        "Quantised weights",
        "quantized.py",
        "Decode with the release's FP8/FP4 weights kept quantised against the same model in "
        "bf16, alternating.",
        _quantized,
    ),
    "speculative": Section(
        "Speculative decoding",
        "speculative.py",
        "A small model with an MTP block trained here, then `generate` plain and speculative, "
        "alternating; greedy outputs checked equal.",
        _speculative,
    ),
    "compile_depth": Section(
        "Compile time against depth",
        "compile_depth.py",
        "The jitted prefill lowered and compiled from the abstract model, layers scanned and "
        "unrolled; memory from XLA's analysis of the compiled program.",
        _compile_depth,
    ),
    "compile_v4_flash": Section(
        "V4-Flash compiled for simulated CPU devices",
        "python -m equinox_dsv4.compile --json",
        "The full-size model compiled abstractly for simulated CPU devices: compile times "
        "measured on the host, memory and FLOPs from XLA's analysis of the compiled program.",
        _compile_full,
        "Memory and FLOPs are the compiler's analysis (XLA:CPU, simulated devices), not runs",
    ),
    "compile_v4_pro": Section(
        "V4-Pro compiled for simulated CPU devices",
        "python -m equinox_dsv4.compile --json",
        "As `compile_v4_flash.json`, for V4-Pro.",
        _compile_full,
        "Memory and FLOPs are the compiler's analysis (XLA:CPU, simulated devices), not runs",
    ),
    "convert": Section(
        "Conversion",
        "convert.py",
        "A synthetic checkpoint in the release layout converted by `python -m convert` in a "
        "subprocess: throughput and peak RSS against the bound.",
        _convert,
    ),
    "tpu_memory": Section(
        "TPU memory per chip",
        "tpu_memory.py",
        "V4-Flash and V4-Pro compiled for v5p slices on the default rules.",
        _tpu_memory,
        _TPU,
    ),
    "gpu_fit": Section(
        "What fits a node of 8 GPUs",
        "gpu_fit.py",
        "V4-Flash and V4-Pro, FP8/FP4 and bf16, compiled for 8 x H100 / H200 / B200 on the mesh "
        "expert=8: per-GPU bytes of a prefill and a decode step, and the context and batch "
        "limits in what the decode step leaves free (the table gpu_fit.py renders).",
        lambda data: data["table"],
        "**Estimates, not measurements**: XLA's GPU compiler (the CUDA plugin) compiled these on "
        "a CPU host and no GPU ran them; memory is the compiler's per-GPU analysis",
    ),
    "tpu_experts": Section(
        "TPU routed-experts kernels",
        "tpu_experts.py",
        "V4-Flash's bf16 prefill and decode on v5p:4x4x4 (fsdp 8 x expert 8) with the routed "
        "experts' loop, `ragged_dot` over one buffer for every assignment, in rounds of a "
        "device's own assignments, and in rounds with the tokens travelling to the weights "
        "(the TPU policy); XLA's cost analysis counts a loop's body once, so only the memory "
        "columns compare.",
        _tpu_experts,
        _TPU,
    ),
    "tpu_roofline": Section(
        "TPU roofline",
        "tpu_roofline.py",
        "XLA's per-chip FLOPs and bytes accessed at v5p's published peak give the estimate; the "
        "floor counts the useful FLOPs and the weights read once. Then the bytes by part of the "
        "model.",
        _tpu_roofline,
        _TPU + "; step times are XLA's cost analysis at the published peak",
    ),
    "lora_fit": Section(
        "LoRA / QLoRA train steps",
        "lora_fit.py",
        "Train steps of rank-16 adapters over the FP8/FP4 (QLoRA) weights, compiled for the "
        "smallest v5p slices and for 8-GPU nodes: memory per chip and whether the step fits a "
        "chip (the table lora_fit.py renders).",
        lambda data: data["table"],
        "**Estimates, not measurements**: XLA's TPU compiler (libtpu) and GPU compiler (the CUDA "
        "plugin) compiled these on a CPU host and no TPU or GPU ran them; memory is the "
        "compiler's per-chip analysis",
    ),
    "tpu_maxtext": Section(
        "TPU train step beside MaxText",
        "tpu_maxtext.py",
        "V4-Flash's train step on v5p:4x8x8 (fsdp 32 x expert 8, 32 x 4096 tokens, bf16, each "
        "framework's default remat): ours (tpu_train.py's flash-256, and flash-256-exchange with "
        "the routed experts whole on each chip, their rows exchanged) and MaxText's deepseek4 "
        "compiled by its own train_compile, with its defaults (dropless, as ours is) and with "
        "ragged_buffer_factor=2 (assignments past twice a chip's balanced share dropped); "
        "FLOPs and bytes from 5- and 7-layer unrolled programs extrapolated to 43 layers, "
        "memory from the whole model's program (tpu_maxtext.py's docstring: MaxText's set-up "
        "and settings).",
        lambda data: data["table"],
        _TPU + "; step times and MFU are from XLA's cost analysis at the published peak",
    ),
    "tpu_train": Section(
        "TPU train steps",
        "tpu_train.py",
        "Train steps compiled for v5p slices: memory per chip, and where cost compiles ran, a "
        "roofline step time and the MFU bound it gives: an upper bound (<=) where the "
        "routed experts ran as the loop, counted once per layer; a lower bound (>=) where "
        "they ran as ragged_dot, counted over every row of each device's assignment buffer "
        "(tpu_train.py's docstring). A refused run's file holds the compiler's message "
        "alone: its configuration is `RUNS` in tpu_train.py.",
        _tpu_train,
        _TPU + "; step times and MFU are bounds from XLA's cost analysis at the published peak",
    ),
}


def section(name: str, data: dict, labels: dict[str, str], results: pathlib.Path) -> str:
    spec = SECTIONS.get(name)
    estimate = spec.estimate if spec else ""
    platforms = {str(r.get("platform", "")) for r in data.get("rows", []) if isinstance(r, dict)}
    if not estimate and platforms & {"tpu", "gpu"}:
        estimate = "**Estimates, not measurements**: compiled for a TPU or GPU, none ran"
    title = spec.title if spec else name
    lines = [f"### `{name}.json`", ""]
    where = f"[`benchmarks/results/{name}.json`](../benchmarks/results/{name}.json)"
    script = f"`{spec.script}`" if spec else "an unknown script"
    lines.append(
        f"{title}: {where}, written by {script}. Machine: {machine_of(data, labels)}. "
        f"Recorded: {data.get('date', 'not recorded')}."
    )
    if spec:
        lines += ["", spec.about]
    if estimate:
        lines += ["", estimate + "."]
    try:
        table = spec.render(data) if spec else _generic(data)
    except (KeyError, TypeError) as error:
        raise ValueError(f"{name}.json: not the fields its renderer reads ({error!r})") from error
    lines += ["", table.rstrip("\n")]
    plot = results / f"{name}.png"
    if plot.exists():
        lines += ["", f"![{name}](../benchmarks/results/{name}.png)"]
    return "\n".join(lines) + "\n"


# --- the page ------------------------------------------------------------------------------


def targets_table(results: dict[str, dict]) -> list[dict[str, str]]:
    return [evaluate(t, results) for t in TARGETS]


def render(results_dir: pathlib.Path = RESULTS) -> str:
    results = load(results_dir)
    labels = machines(results)
    out = [
        "# Performance",
        "",
        "<!-- generated by `python benchmarks/performance.py` from benchmarks/results/*.json; "
        "do not edit -->",
        "",
        "Generated by `python benchmarks/performance.py` from `benchmarks/results/*.json`; do "
        "not edit. Every figure here is computed from a result file; how each benchmark "
        "measures is in [benchmarks/README.md](../benchmarks/README.md). A result's date is "
        "the `date` field of its file, the day it was recorded (UTC; files written before the "
        "benchmarks recorded it carry the date of the commit that last changed them). Ratios "
        "are of figures from one run; absolute figures from different machines are not "
        "comparable.",
        "",
        "## Machines",
        "",
    ]
    machine_rows = []
    for key, label in labels.items():
        m = json.loads(key)
        files = [
            f"`{n}`"
            for n, d in results.items()
            if "machine" in d and machine_key(d["machine"]) == key
        ]
        caches = " / ".join(m.get(f"l{i}_cache", "-") for i in (1, 2, 3))
        machine_rows.append(
            [
                label,
                m.get("cpu_model", m.get("cpu", "-")),
                m.get("cores", "-"),
                vector_summary(m.get("vector_flags", [])),
                caches,
                m.get("jax", "-"),
                f"{m.get('torch', '-')} ({m.get('torch_threads', '-')} threads)",
                ", ".join(files),
            ]
        )
    unrecorded = [f"`{n}`" for n, d in results.items() if "machine" not in d]
    if unrecorded:
        machine_rows.append(["-", "not recorded", "-", "-", "-", "-", "-", ", ".join(unrecorded)])
    header = ["machine", "CPU", "cores", "vector extensions", "L1 / L2 / L3", "jax", "torch"]
    out.append(markdown(header + ["result files"], machine_rows).rstrip("\n"))
    out += [
        "",
        "## Targets",
        "",
        "Each target's figure is computed from the result file named beside it; a target no "
        'result file gives reads "no result file". The first five are stated against the '
        "machine's own limits (the floor of reading the weights a decoded token needs at the "
        "bandwidth measured in the same run; the matmul rate measured in the same run); the "
        "ratios against transformers after them are the earlier targets, still reported.",
        "",
    ]
    rows = [
        [r["target"], r["threshold"], r["measured"], r["status"], r["file"]]
        for r in targets_table(results)
    ]
    header = ["target", "threshold", "measured", "status", "result file (recorded)"]
    out.append(markdown(header, rows).rstrip("\n"))
    out += ["", "## Results", ""]
    index = [
        [
            f"[`{n}.json`](#{anchor(n)})",
            SECTIONS[n].title if n in SECTIONS else n,
            machine_of(d, labels),
            d.get("date", "not recorded"),
        ]
        for n, d in results.items()
    ]
    out.append(markdown(["file", "benchmark", "machine", "recorded"], index).rstrip("\n"))
    order = [n for n in SECTIONS if n in results] + sorted(n for n in results if n not in SECTIONS)
    for name in order:
        out += ["", section(name, results[name], labels, results_dir).rstrip("\n")]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--out", type=pathlib.Path, default=PAGE, help="the page to write (default: %(default)s)"
    )
    parser.add_argument(
        "--results",
        type=pathlib.Path,
        default=RESULTS,
        help="the directory of result files (default: %(default)s)",
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="write nothing; exit 1 with a diff summary if the page differs from what would be "
        "written",
    )
    args = parser.parse_args(argv)
    text = render(args.results)
    if args.check:
        old = args.out.read_text() if args.out.exists() else None
        if old == text:
            print(f"{args.out} is up to date")
            return 0
        if old is None:
            print(f"{args.out} does not exist; run python benchmarks/performance.py")
            return 1
        diff = list(
            difflib.unified_diff(
                old.splitlines(), text.splitlines(), str(args.out), "generated", lineterm=""
            )
        )
        removed = sum(1 for d in diff if d.startswith("-") and not d.startswith("---"))
        added = sum(1 for d in diff if d.startswith("+") and not d.startswith("+++"))
        print(f"{args.out} differs from what would be generated: -{removed} +{added} lines")
        print("\n".join(diff[:60]))
        if len(diff) > 60:
            print(f"... ({len(diff) - 60} more diff lines)")
        print("regenerate with: python benchmarks/performance.py")
        return 1
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
