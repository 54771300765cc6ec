"""The chips that `python -m equinox_dsv4.compile --topology` compiles for without having them.

TPU topologies (`v5p:4x4x4`) come from libtpu; NVIDIA GPU nodes (`h100:8`, `h200:16`) from
the CUDA PJRT plugin given a GPU target configuration: the committed `gpus/<name>.txtpb`
(written from published specifications), or one captured from a real GPU
(`--target-config`). Both are in the `aot` install extra. Beside each chip: its published
dense bf16 peak and memory bandwidth (for the report's roofline estimate) and, for GPUs, the
memory size that the fit check holds a program to (XLA's GPU compiler compiles programs larger
than the device with only a log warning; XLA's TPU compiler refuses them itself).
"""

import dataclasses
import math
import pathlib
import re


# Published per-chip peaks: dense bf16 FLOP/s, HBM bytes/s. TPUs: Google Cloud's TPU pages.
# GPUs: NVIDIA's datasheets (H100 / H200 SXM: 989 TFLOP/s dense bf16, 3.35 / 4.8 TB/s; B200:
# 2.25 PFLOP/s dense bf16 in DGX B200, 8 TB/s).
TPU_PEAKS = {
    "v4": (275e12, 1228e9),
    "v5e": (197e12, 819e9),
    "v5p": (459e12, 2765e9),
    "v6e": (918e12, 1640e9),
}
GPU_PEAKS = {
    "h100": (989e12, 3.35e12),
    "h200": (989e12, 4.8e12),
    "b200": (2.25e15, 8e12),
}
GPU_CONFIGS = pathlib.Path(__file__).resolve().parent / "gpus"
# A node's GPUs: a GPU topology of more is whole nodes of this many.
NODE_GPUS = 8


@dataclasses.dataclass(frozen=True)
class Target:
    """What a `--topology` names: the platform (`tpu`, `gpu`), the chip (`v5p`, `h100`), the
    devices, and what is published about one of them."""

    platform: str
    chip: str
    devices: list
    description: str
    memory_bytes: int | None  # None: not checked here (TPUs: the compiler checks)
    peak: dict | None

    def fit_error(
        self,
        phase: str,
        needed: int,
        what: str = "arguments + outputs + temporaries - aliased",
    ) -> str | None:
        """The refusal's one line when `needed` bytes per device (of `what`) exceed the
        device's memory."""
        if self.memory_bytes is None or needed <= self.memory_bytes:
            return None
        unit, name = (2**30, "GiB") if self.memory_bytes >= 2**30 else (2**20, "MiB")
        return (
            f"{phase}: {needed / unit:.2f} {name} per device ({what}) exceed the "
            f"{self.description}'s {self.memory_bytes / unit:.2f} {name}"
        )


def _peak(chip: str, table: dict) -> dict | None:
    if chip not in table:
        return None
    flops, hbm = table[chip]
    return {"chip": chip, "bf16_flops_per_s": flops, "hbm_bytes_per_s": hbm}


def gpu_config_field(text: str, field: str) -> str:
    """One scalar field of a GpuTargetConfigProto in text format (`device_memory_size`,
    `device_description_str`, ...), as written."""
    found = re.search(rf"^\s*{field}:\s*(\"[^\"]*\"|\S+)", text, re.MULTILINE)
    if found is None:
        raise ValueError(f"the GPU target configuration has no {field}")
    return found.group(1).strip('"')


def parse_topology(topology: str) -> tuple[str, str, int | None]:
    """`"h100:8"` -> `("gpu", "h100", 8)`; `"v5p:4x4x4"` -> `("tpu", "v5p", None)`."""
    chip, sep, shape = topology.partition(":")
    if chip in GPU_PEAKS or (GPU_CONFIGS / f"{chip}.txtpb").exists():
        if not sep or not shape.isdigit() or int(shape) < 1:
            raise ValueError(f"bad GPU topology {topology!r}: use NAME:COUNT, e.g. {chip}:8")
        count = int(shape)
        if count > NODE_GPUS and count % NODE_GPUS:
            raise ValueError(
                f"bad GPU topology {topology!r}: more than {NODE_GPUS} GPUs are whole nodes of "
                f"{NODE_GPUS}"
            )
        return "gpu", chip, count
    return "tpu", chip, None


def target(topology: str, target_config: str | None = None) -> Target:
    """The devices of `topology` (compile-only) and what is known of them; `target_config`: a
    GpuTargetConfigProto text file to use instead of the committed one for the GPU."""
    from jax.experimental import topologies

    platform, chip, count = parse_topology(topology)
    if platform == "tpu":
        if target_config:
            raise ValueError("--target-config is for GPU topologies (e.g. h100:8)")
        try:
            desc = topologies.get_topology_desc(platform="tpu", topology_name=topology)
        except Exception as e:  # libtpu missing, or a name it does not know
            raise ValueError(
                f"cannot get TPU topology {topology!r} (GPUs: "
                f"{', '.join(sorted(GPU_PEAKS))}, as NAME:COUNT): {e}"
            ) from e
        devices = list(desc.devices)
        kind = getattr(devices[0], "device_kind", f"TPU {chip}")
        return Target("tpu", chip, devices, kind, None, _peak(chip, TPU_PEAKS))
    path = pathlib.Path(target_config) if target_config else GPU_CONFIGS / f"{chip}.txtpb"
    try:
        text = path.read_text()
    except OSError as e:
        raise ValueError(f"cannot read the GPU target configuration {str(path)!r}: {e}") from e
    hosts = math.ceil(count / NODE_GPUS)
    try:
        desc = topologies.get_topology_desc(
            platform="cuda", topology=f"1x{hosts}x{count // hosts}", target_config=text
        )
    except Exception as e:  # the CUDA plugin missing, or a configuration it rejects
        raise ValueError(
            f"cannot compile for {topology!r} from {path.name}: {e} (GPU compiles need the CUDA "
            "plugin: pip install -e '.[aot]')"
        ) from e
    memory = int(gpu_config_field(text, "device_memory_size"))
    description = gpu_config_field(text, "device_description_str")
    return Target("gpu", chip, list(desc.devices), description, memory, _peak(chip, GPU_PEAKS))
