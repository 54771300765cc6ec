"""Reading XLA's compiled HLO text and XLA:CPU's profiler traces, for the scripts that put a
step's time or bytes on its kernels (`decode_profile.py`, `prefill_profile.py`,
`tpu_roofline.py`)."""

import glob
import re
import tempfile
from collections.abc import Callable
from typing import NamedTuple

import jax
import numpy as np


_ITEMSIZE = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e8m0fnu": 1, "f4e2m1fn": 1}
_ITEMSIZE |= {"bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4, "s32": 4, "u32": 4}
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (.+?) ([\w\-]+)\((.*?)\)(.*)$")
_COMPUTATION = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) .*\{\s*$")


class Instruction(NamedTuple):
    shape: str  # the result's shape text, a tuple's included
    opcode: str
    operands: list[str]  # operand instruction names
    attributes: str  # the rest of the line
    computation: str  # the computation it belongs to


def shape_bytes(text: str) -> int:
    """Bytes of every array in a shape text (a tuple's elements summed)."""
    total = 0
    for dtype, dims in re.findall(r"\b(\w+)\[([\d,]*)\]", text):
        if dtype in _ITEMSIZE:
            total += _ITEMSIZE[dtype] * int(np.prod([int(d) for d in dims.split(",") if d]))
    return total


def dims(shape: str) -> list[int]:
    """The dimensions of a shape text's first array."""
    m = re.search(r"\w+\[([\d,]*)\]", shape)
    return [int(d) for d in m[1].split(",") if d] if m else []


def parse(hlo: str) -> tuple[dict[str, Instruction], dict[str, list[str]]]:
    """Every instruction of a compiled module's text by name, and each computation's
    instruction names."""
    table, computations, current, last = {}, {}, "", None
    for line in hlo.splitlines():
        head = _COMPUTATION.match(line)
        if head:
            current, last = head[1], None
            computations[current] = []
            continue
        m = _INSTRUCTION.match(line)
        if line.strip() == "}":  # a computation's end
            last = None
        elif not m and last is not None:
            # An instruction over several lines (a Pallas kernel's metadata holds newlines):
            # the rest of its attributes, its op name and backend config among them.
            table[last] = table[last]._replace(attributes=table[last].attributes + line)
            continue
        if m:
            last = m[1]
            # Long operand lists carry `/*index=N*/` comments before every fifth operand.
            listed = re.sub(r"/\*index=\d+\*/", "", m[4])
            operands = [o.strip().lstrip("%") for o in listed.split(",") if o.strip()]
            table[m[1]] = Instruction(m[2], m[3], operands, m[5], current)
            computations.setdefault(current, []).append(m[1])
    return table, computations


def pallas_kernels(text: str) -> list[dict]:
    """The Pallas (Mosaic TPU) kernels of a compiled module's text: for each, the bytes its own
    cost estimate gives (what XLA's cost analysis charges it; `None` where it gave none) and
    its operands and result (`kernel_bytes`). A kernel in a loop's body is listed once, as
    XLA's cost analysis counts it."""
    table, computations = parse(text)
    kernels = []
    for name, instruction in table.items():
        if instruction.opcode != "custom-call" or "tpu_custom_call" not in instruction.attributes:
            continue
        # The estimate is in the kernel's backend config, a JSON string inside the text.
        estimate = re.search(r'bytes_accessed\\?"\s*:\s*\\?"?(\d+)', instruction.attributes)
        kernels.append(
            {
                "name": name,
                "estimate_bytes": int(estimate[1]) if estimate else None,
                "operand_and_result_bytes": kernel_bytes(name, table, computations),
            }
        )
    return kernels


def pallas_shortfall(text: str) -> tuple[int, int]:
    """How many Pallas kernels a compiled module holds, and the bytes by which their cost
    estimates fall short of their operands and results, summed (`pallas_kernels`): what an
    honest count adds to XLA's bytes accessed, so that each kernel is charged at least what
    it must read and write."""
    kernels = pallas_kernels(text)
    short = sum(max(0, k["operand_and_result_bytes"] - (k["estimate_bytes"] or 0)) for k in kernels)
    return len(kernels), short


def fused_computations(table: dict[str, Instruction]) -> set[str]:
    """The computations that fusions call (their instructions run inside another kernel)."""
    return {c for i in table.values() if i.opcode == "fusion" for c in _called(i)}


def products(name: str, table: dict[str, Instruction], computations: dict) -> list[str]:
    """The dots kernel `name` computes: itself, or the dots of the computation its fusion
    calls."""
    instruction = table.get(name)
    if instruction is None:
        return []
    if instruction.opcode == "dot":
        return [name]
    if instruction.opcode != "fusion":
        return []
    return [n for n in _inside(instruction, computations) if table[n].opcode == "dot"]


def op_name(name: str, table: dict[str, Instruction], computations: dict) -> str:
    """JAX's op name of kernel `name`: its own, or where a fusion has none, that of the first
    instruction inside it that has one ("" where none does)."""
    names = [name, *_inside(table[name], computations)]
    for n in names:
        m = re.search(r'op_name="([^"]*)"', table[n].attributes)
        if m:
            return m[1]
    return ""


def kernel_bytes(name: str, table: dict[str, Instruction], computations: dict) -> int:
    """Bytes kernel `name` reads and writes: its operands and result, except that an operand
    only sliced is charged its slices, and a buffer updated in place (a dynamic update slice,
    or a scatter, as XLA's cost analysis counts them) its updates, read and written, and a
    scatter's indices."""
    instruction = table[name]
    if instruction.opcode in _SLICES:
        return 2 * shape_bytes(instruction.shape)
    if instruction.opcode == "dynamic-update-slice":
        return 2 * _operand_bytes(instruction, 1, table)
    if instruction.opcode == "scatter":
        # Operands, indices, updates (k of each but the indices).
        k = (len(instruction.operands) - 1) // 2
        updates = sum(_operand_bytes(instruction, k + 1 + i, table) for i in range(k))
        return _operand_bytes(instruction, k, table) + 2 * updates
    written = shape_bytes(instruction.shape)
    if instruction.opcode != "fusion":
        operands = range(len(instruction.operands))
        return sum(_operand_bytes(instruction, i, table) for i in operands) + written
    inside = _inside(instruction, computations)
    params = {n: int(table[n].operands[0]) for n in inside if table[n].opcode == "parameter"}
    read = {i: _operand_bytes(instruction, i, table) for i in params.values()}
    for param, i in params.items():
        sliced = _sliced(param, inside, table, computations)
        if sliced is not None:
            read[i] = sliced * _ITEMSIZE.get(table[param].shape.split("[")[0], 0)
    root = table[inside[-1]] if inside else instruction
    if root.opcode == "dynamic-update-slice" and root.operands[0] in params:
        read[params[root.operands[0]]] = 0
        written = shape_bytes(table[root.operands[1]].shape)
    if root.opcode == "scatter" and len(root.operands) == 3 and root.operands[0] in params:
        # The updates are computed inside (their inputs are read above); only they are written.
        read[params[root.operands[0]]] = 0
        written = shape_bytes(table[root.operands[2]].shape)
    return sum(read.values()) + written


_SLICES = ("slice", "dynamic-slice", "gather")
# Operations through which a value is still read only where a slice of it is.
_ELEMENTWISE = ("convert", "bitcast", "copy", "reshape")


def _sliced(
    value: str, inside: list[str], table: dict[str, Instruction], computations: dict
) -> int | None:
    # The elements of `value` a fusion reads where every use of it is a slice, directly, through
    # element-wise ops (XLA:CPU converts a 16-bit operand, then slices it) or inside a fusion
    # nested in this one (XLA's TPU backend slices a layer out of a stack that way); else None.
    users = [n for n in inside if value in table[n].operands]
    total = 0
    for n in users:
        if table[n].opcode in _SLICES and table[n].operands[0] == value:
            more = int(np.prod(dims(table[n].shape)))
        elif table[n].opcode in _ELEMENTWISE:
            more = _sliced(n, inside, table, computations)
        elif table[n].opcode == "fusion" and table[n].operands.count(value) == 1:
            nested = _inside(table[n], computations)
            index = str(table[n].operands.index(value))
            param = [m for m in nested if table[m].opcode == "parameter"]
            param = [m for m in param if table[m].operands[0] == index]
            more = _sliced(param[0], nested, table, computations) if param else None
        else:
            more = None
        if more is None:
            return None
        total += more
    return total if users else None


def _operand_bytes(instruction: Instruction, i: int, table: dict[str, Instruction]) -> int:
    operand = instruction.operands[i] if i < len(instruction.operands) else None
    return shape_bytes(table[operand].shape) if operand in table else 0


def _inside(instruction: Instruction, computations: dict) -> list[str]:
    # The instructions of the computations `instruction` calls (a fusion's body).
    return [n for c in _called(instruction) for n in computations.get(c, [])]


def _called(instruction: Instruction) -> list[str]:
    return re.findall(r"calls=%?([\w.\-]+)", instruction.attributes)


# Profiler events on XLA:CPU's threads that are not kernels: the executor's, loops and calls
# (which contain kernels), and the thread pool's waits and bookkeeping.
_NOT_KERNELS = ("ThunkExecutor", "while", "end: ", "call", "SlinkyThreadPool", "ThreadpoolListener")


def kernel_events(fn: Callable[[], None], calls: int) -> list[tuple[str, float]]:
    """`(kernel name, seconds)` of every XLA:CPU kernel (thunk) that `calls` calls of `fn`
    ran, from a `jax.profiler` trace; loops, calls and the executor's own events, which
    contain kernels, and the thread pool's waits are left out."""
    with tempfile.TemporaryDirectory() as d:
        jax.profiler.start_trace(d)
        for _ in range(calls):
            fn()
        jax.profiler.stop_trace()
        (path,) = glob.glob(f"{d}/**/*.xplane.pb", recursive=True)
        data = jax.profiler.ProfileData.from_file(path)
    events = []
    for plane in data.planes:
        for line in plane.lines:
            if "XLAEigen" not in line.name:
                continue
            for event in line.events:
                if not event.name.startswith(_NOT_KERNELS):
                    events.append((event.name, event.duration_ns / 1e9))
    return events
