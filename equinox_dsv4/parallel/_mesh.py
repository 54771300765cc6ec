"""Device meshes: the four named axes, and their construction from sizes or from a command
line's `--mesh` / `--rule` arguments."""

from typing import Any

import jax
from jax.sharding import Mesh

from .._typecheck import typechecked
from ._sharding import DEFAULT_RULES


# The mesh axes, by convention: `data` and `fsdp` split the batch, `fsdp` also the weights,
# `tensor` heads and hidden units, `expert` the routed experts (see `ShardingRules`).
AXES = ("data", "fsdp", "tensor", "expert")


@typechecked
def make_mesh(
    *, data: int = 1, fsdp: int = 1, tensor: int = 1, expert: int = 1, devices: Any = None
) -> Mesh:
    """A `(data, fsdp, tensor, expert)` mesh over `devices` (default: all), with automatic
    axis types (the partitioner propagates shardings)."""
    devices = jax.devices() if devices is None else list(devices)
    shape = (data, fsdp, tensor, expert)
    if any(n < 1 for n in shape) or data * fsdp * tensor * expert != len(devices):
        raise ValueError(
            f"mesh data={data} x fsdp={fsdp} x tensor={tensor} x expert={expert} does not match "
            f"{len(devices)} devices"
        )
    return jax.make_mesh(
        shape,
        AXES,
        axis_types=(jax.sharding.AxisType.Auto,) * 4,
        devices=devices,
    )


@typechecked
def parse_mesh(text: str) -> dict[str, int]:
    """`"fsdp=8,expert=8"` -> `{"fsdp": 8, "expert": 8}` (a `--mesh` argument; axes `AXES`)."""
    out: dict[str, int] = {}
    for part in filter(None, text.split(",")):
        name, _, size = part.partition("=")
        if name not in AXES or not size.isdigit():
            raise ValueError(f"bad --mesh entry {part!r}: use data=N,fsdp=N,tensor=N,expert=N")
        out[name] = int(size)
    return out


@typechecked
def parse_rules(texts: list[str]) -> dict[str, str | tuple[str, ...] | None]:
    """`["vocab=fsdp+expert", "embed="]` -> rule overrides for `ShardingRules.replace` (`--rule`
    arguments: a logical axis of `DEFAULT_RULES`, mesh axes joined by `+`, none to replicate)."""
    out: dict[str, str | tuple[str, ...] | None] = {}
    for text in texts:
        name, _, value = text.partition("=")
        axes = tuple(filter(None, value.split("+")))
        if name not in DEFAULT_RULES or "=" not in text or any(a not in AXES for a in axes):
            raise ValueError(
                f"bad --rule {text!r}: use NAME=AXIS[+AXIS] (or NAME= to replicate) with NAME "
                f"one of {sorted(DEFAULT_RULES)} and axes from {AXES}"
            )
        out[name] = None if not axes else axes[0] if len(axes) == 1 else axes
    return out
