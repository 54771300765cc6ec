"""The routed experts' forms for many assignments on a TPU, side by side: the sorted expert
loop (`Policy.experts="loop"`, XLA:CPU's form), `jax.lax.ragged_dot` over every assignment of
a device's tokens in one buffer, the same in rounds of twice a device's even share of its own
assignments (`expert_buffer=2`), and in rounds with the tokens travelling to the experts'
hidden units (`experts_stay`, where fewer rows move that way: the TPU policy), in V4-Flash's
bf16 prefill and decode on v5p:4x4x4 (64 chips, fsdp 8 x expert 8, the default rules),
compiled here by libtpu's compiler without a TPU (`python -m equinox_dsv4.compile --policy
...`). Per chip: arguments, temporaries, and XLA's cost analysis. The programs are scanned, so
XLA counts each loop's body once: the loop's expert FLOPs and bytes are one expert's, the
rounds' one round's, the one buffer's all of them; the memory figures compare, the cost
figures do not. A decode step's few assignments take the decode forms under every one of
them. Estimates from a compiler.

    python benchmarks/tpu_experts.py [--work /tmp/tpu]

Writes benchmarks/results/tpu_experts.{json,md}.
"""

import argparse
import pathlib

from common import markdown, write
from tpu_memory import TOPOLOGIES, compile_arguments, compiled


# name -> the TPU policy's fields it overrides.
FORMS = {
    "loop": ("experts=loop", "expert_buffer=0", "experts_stay=false"),
    "ragged, one buffer": ("expert_buffer=0", "experts_stay=false"),
    "ragged, rounds": ("experts_stay=false",),
    "ragged, rounds, weights stay": (),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", default="/tmp/tpu", help="per-run JSON files (reused)")
    args = parser.parse_args(argv)
    work = pathlib.Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    topology, mesh = TOPOLOGIES[64]
    gib = 2**30
    rows, table = [], []
    for kernel, fields in FORMS.items():
        out = work / f"flash-b-64-experts-{kernel.replace(', ', '-').replace(' ', '-')}.json"
        arguments = compile_arguments("v4-flash", False, topology, mesh, "decode,prefill", out)
        report = compiled(arguments + [a for f in fields for a in ("--policy", f)], out)
        if "error" in report:
            raise SystemExit(f"{kernel}: {report['error']}")
        for phase in ("prefill", "decode"):
            r = report["phases"][phase]
            rows.append({"kernel": kernel, "phase": phase, "topology": topology, **r})
            table.append(
                [
                    kernel,
                    phase,
                    f"{r['argument_bytes'] / gib:.2f} GiB",
                    f"{r['temp_bytes'] / gib:.3f} GiB",
                    f"{r['flops']:.3g}" if r["flops"] else "-",
                    f"{r['bytes_accessed'] / gib:.1f} GiB" if r["bytes_accessed"] else "-",
                ]
            )
    header = ["experts", "phase", "arguments", "temporaries", "FLOPs (XLA)", "bytes (XLA)"]
    write("tpu_experts", rows, markdown(header, table), {"model": "v4-flash", "mesh": mesh})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
