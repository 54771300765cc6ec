"""Reading safetensors checkpoints without torch: headers, index, and tensors one at a time.

A safetensors file is an 8-byte little-endian header length, a JSON header
`{name: {dtype, shape, data_offsets: [begin, end]}}` and the raw data. Headers are parsed and
checked against the file size up front, so a truncated or corrupt file is reported before any
data is read. Tensors are read with `os.pread` into a fresh buffer (no memory map: pages of a
mapped file would stay resident and count towards the process's memory), and F8 types are
viewed with `ml_dtypes`, which numpy's safetensors loader cannot do.
"""

import dataclasses
import json
import math
import os
import pathlib

import ml_dtypes
import numpy as np


DTYPES = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "F8_E8M0": np.dtype(ml_dtypes.float8_e8m0fnu),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """Where one tensor's bytes are: `file`, absolute byte range `[start, end)`."""

    name: str
    file: pathlib.Path
    dtype: np.dtype
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


def read_header(path: pathlib.Path, problems: list[str]) -> dict[str, TensorInfo]:
    """The tensors of one safetensors file; problems (corrupt, truncated) are appended."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            problems.append(f"{path.name}: truncated ({size} bytes, no header)")
            return {}
        n = int.from_bytes(head, "little")
        if n > size - 8:
            problems.append(
                f"{path.name}: corrupt or truncated header ({n} header bytes, file {size})"
            )
            return {}
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            problems.append(f"{path.name}: corrupt header ({e})")
            return {}
    if not isinstance(header, dict):
        problems.append(f"{path.name}: corrupt header (not a JSON object)")
        return {}
    header.pop("__metadata__", None)
    out = {}
    for name, entry in header.items():
        try:
            dtype = DTYPES[entry["dtype"]]
            shape = tuple(int(d) for d in entry["shape"])
            begin, end = (int(o) for o in entry["data_offsets"])
        except (KeyError, TypeError, ValueError):
            problems.append(f"{path.name}: corrupt header entry for {name!r}: {entry!r}")
            continue
        if end - begin != math.prod(shape) * dtype.itemsize or begin < 0:
            problems.append(
                f"{path.name}: {name!r} has {end - begin} bytes for {list(shape)} {entry['dtype']}"
            )
            continue
        if 8 + n + end > size:
            problems.append(
                f"{path.name}: truncated: {name!r} ends at byte {8 + n + end}, the file has {size}"
            )
            continue
        out[name] = TensorInfo(name, path, dtype, shape, 8 + n + begin, 8 + n + end)
    return out


def write_safetensors(path: pathlib.Path, tensors: dict[str, np.ndarray]) -> None:
    """Write `tensors` as one safetensors file (F8 and BF16 included, from `ml_dtypes` arrays)."""
    names = {dtype: name for name, dtype in DTYPES.items()}
    header, offset = {}, 0
    for name in sorted(tensors):
        array = tensors[name]
        header[name] = {
            "dtype": names[array.dtype],
            "shape": list(array.shape),
            "data_offsets": [offset, offset + array.nbytes],
        }
        offset += array.nbytes
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for name in sorted(tensors):
            f.write(np.ascontiguousarray(tensors[name]).tobytes())


def read_tensor(info: TensorInfo) -> np.ndarray:
    """The tensor's values, in a new buffer."""
    fd = os.open(info.file, os.O_RDONLY)
    try:
        data = bytearray(info.nbytes)
        view, done = memoryview(data), 0
        while done < info.nbytes:
            got = os.preadv(fd, [view[done:]], info.start + done)
            if got == 0:
                raise ValueError(f"{info.file.name}: unexpected end of file reading {info.name!r}")
            done += got
    finally:
        os.close(fd)
    return np.frombuffer(data, info.dtype).reshape(info.shape)


def list_tensors(hf_dir: pathlib.Path, problems: list[str]) -> dict[str, TensorInfo]:
    """Every tensor of the checkpoint in `hf_dir` (`model.safetensors.index.json` with its
    shards, or one `model.safetensors`). Index and headers are cross-checked; problems are
    appended. Pickled weights are refused."""
    if not hf_dir.is_dir():
        raise FileNotFoundError(f"{hf_dir} is not a directory")
    index = hf_dir / INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            problems.append(f"{INDEX}: not a valid index ({e})")
            return {}
        files = sorted(set(weight_map.values()))
    elif (hf_dir / SINGLE).is_file():
        weight_map, files = None, [SINGLE]
    else:
        pickles = sorted(p.name for p in hf_dir.iterdir() if p.suffix in PICKLE_SUFFIXES)
        if pickles:
            raise ValueError(
                f"{hf_dir} holds pickled weights ({', '.join(pickles)}) and no safetensors: "
                "refusing to load them, unpickling runs arbitrary code. Convert them to "
                "safetensors first."
            )
        stray = sorted(p.name for p in hf_dir.glob("*.safetensors"))
        if stray:
            raise ValueError(f"{hf_dir} has {stray} but no {INDEX} saying what they hold")
        raise FileNotFoundError(f"{hf_dir} has no {SINGLE} and no {INDEX}")
    tensors: dict[str, TensorInfo] = {}
    readable = set()
    for file in files:
        path = hf_dir / file
        if not path.is_file():
            problems.append(f"{INDEX} names shard {file}, which does not exist")
            continue
        before = len(problems)
        header = read_header(path, problems)
        if len(problems) == before:
            readable.add(file)
        for name, info in header.items():
            if name in tensors:
                problems.append(f"{name!r} is in both {tensors[name].file.name} and {file}")
            elif weight_map is not None and weight_map.get(name) != file:
                problems.append(f"{file} holds {name!r}, which {INDEX} does not place there")
            else:
                tensors[name] = info
    if weight_map is not None:
        for name, file in weight_map.items():
            if name not in tensors and file in readable:
                problems.append(f"{INDEX} places {name!r} in {file}, which does not hold it")
    return tensors
