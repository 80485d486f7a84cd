"""Reading and checking one safetensors file's header, with bounded memory, before any tensor is read.

Contract: `read_header(file) -> (tensors | None, problems)`. A safetensors file is an 8-byte little-endian header
length n, n bytes of JSON {name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}, then
the data; offsets count from the end of the header. `tensors` maps each name to a `TensorInfo` with absolute
byte offsets. Problems, each naming the file (and the tensor where there is one) and the fix:
- corrupt header, `tensors` None (nothing in the file can be trusted): a file shorter than 8 bytes; a header
  length beyond the file or beyond `MAX_HEADER_BYTES` (never read into memory); a header that is not UTF-8 JSON
  or not an object; an entry without dtype, shape or data_offsets, with a shape that is not non-negative
  integers, offsets that are not 0 <= begin <= end, a dtype safetensors does not define, a byte span that
  does not match dtype x shape, or data overlapping another tensor's (every such entry is named);
- truncated file, `tensors` kept: the data of some tensors lies past the end of the file.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path

# Item sizes of every safetensors dtype, to check headers' data offsets even for tensors we cannot load.
ITEM_SIZES = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
    "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1,
}
MAX_HEADER_BYTES = 100_000_000  # the safetensors library's own bound; real headers are a few MB at most
REDOWNLOAD = "download or convert the checkpoint again"
_MAX_ENTRY_PROBLEMS = 20  # per file; a wholly garbled header would otherwise repeat one line per tensor


@dataclass(frozen=True)
class TensorInfo:
    file: Path
    dtype: str  # safetensors dtype name, e.g. "BF16"
    shape: tuple[int, ...]
    start: int  # absolute byte offsets in `file`
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _entry_problem(key: str, entry) -> tuple[str | None, tuple | None]:
    """(what is wrong with one header entry, or None; (dtype, shape, begin, end) when it is sound)."""
    if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= entry.keys():
        return f"tensor '{key}' lacks dtype, shape or data_offsets", None
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if not isinstance(shape, list) or not all(_is_int(n) and n >= 0 for n in shape):
        return f"tensor '{key}' has shape {shape!r} (want a list of non-negative integers)", None
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_int(o) for o in offsets)
            and 0 <= offsets[0] <= offsets[1]):
        return f"tensor '{key}' has data_offsets {offsets!r} (want [begin, end] with 0 <= begin <= end)", None
    if dtype not in ITEM_SIZES:
        return f"tensor '{key}' has unknown dtype {dtype!r} (safetensors defines {', '.join(ITEM_SIZES)})", None
    need = math.prod(shape) * ITEM_SIZES[dtype]
    if offsets[1] - offsets[0] != need:
        return (f"tensor '{key}' spans {offsets[1] - offsets[0]} bytes but {dtype}{shape} needs {need}", None)
    return None, (dtype, tuple(shape), offsets[0], offsets[1])


def read_header(file: Path) -> tuple[dict[str, TensorInfo] | None, list[str]]:
    """The tensors of one file's header and its problems; see the module docstring."""
    file = Path(file)
    size = file.stat().st_size

    def corrupt(*reasons: str) -> tuple[None, list[str]]:
        return None, [f"{file.name} has a corrupt safetensors header ({reason}): {REDOWNLOAD}" for reason in reasons]

    with open(file, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            return corrupt(f"the file has only {size} bytes")
        (length,) = struct.unpack("<Q", prefix)
        if length > size - 8:
            return corrupt(f"header length {length} exceeds the file size {size}")
        if length > MAX_HEADER_BYTES:
            return corrupt(f"header length {length} exceeds the sane bound of {MAX_HEADER_BYTES} bytes")
        raw = f.read(length)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (ValueError, UnicodeDecodeError) as err:  # JSONDecodeError is a ValueError
        return corrupt(f"the header is not UTF-8 JSON: {err}")
    if not isinstance(header, dict):
        return corrupt(f"the header is a JSON {type(header).__name__}, not an object")
    header.pop("__metadata__", None)
    base = 8 + length
    tensors: dict[str, TensorInfo] = {}
    problems: list[str] = []
    for key, entry in header.items():
        problem, sound = _entry_problem(key, entry)
        if problem:
            problems.append(problem)
        else:
            dtype, shape, begin, end = sound
            tensors[key] = TensorInfo(file, dtype, shape, base + begin, base + end)
    reach, reach_key = -1, ""  # the furthest end so far and its tensor: catches nested spans too
    for start, end, key in sorted((i.start, i.end, k) for k, i in tensors.items() if i.end > i.start):
        if start < reach:
            problems.append(f"the data of tensors '{reach_key}' and '{key}' overlap")
        if end > reach:
            reach, reach_key = end, key
    if problems:
        shown = problems[:_MAX_ENTRY_PROBLEMS]
        if len(problems) > len(shown):
            shown.append(f"... and {len(problems) - len(shown)} more entries")
        return corrupt(*shown)
    data_end = max((info.end for info in tensors.values()), default=base)
    if data_end > size:
        cut = sorted(key for key, info in tensors.items() if info.end > size)
        named = ", ".join(f"'{k}'" for k in cut[:5]) + (f" and {len(cut) - 5} more" if len(cut) > 5 else "")
        return tensors, [f"{file.name} is truncated: its header places data up to byte {data_end} but the file has "
                         f"{size} bytes (tensors {named} lie past the end): {REDOWNLOAD}"]
    return tensors, []
