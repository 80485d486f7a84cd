"""Lazy safetensors reading, validation of a whole checkpoint, and loading parameter by parameter.

Contract:
- `open_checkpoint(path) -> Checkpoint` takes a directory (or the `model.safetensors` /
  `model.safetensors.index.json` inside it) and reads only the files' headers. File-level problems (a shard the
  index lists but that is absent, a corrupt header or a truncated file: `weights.safetensors_check`) are recorded
  in `Checkpoint.problems`, so that `load_state` reports them together with everything else. Only a path that
  holds no checkpoint at all, or an unreadable index, raises at once.
- `Checkpoint.read(source, shape, dtype) -> np.ndarray` reads the tensors of one `Source` (see
  `weights/spec.py`): each tensor is transposed first when `source.transpose`, the tensors of a group are
  concatenated along the last axis, groups are stacked along a new leading axis when `source.stacked`; the result
  has `shape` and `dtype` (float32/float16/bfloat16 stored tensors are converted on the way).
- `load_state(ckpt, sources, shapes, placement) -> dict[path, jax.Array]` first validates every source against
  the headers (missing, unexpected, left-over expert, wrong shape, wrong or unsupported dtype, plus the file
  problems) and raises ONE `CheckpointError` whose lines name each key or file and the fix; only then it reads
  one parameter at a time, `jax.device_put`s it with `placement(path)` and drops the host copy.
- `checkpoint_loader(ckpt, sources, shapes)` validates the same way up front and returns
  `loader(paths, placement)`, which loads only the parameters asked for (the offload engine's layer-by-layer
  loading).

Memory: tensors are read with plain file reads (no memory map, whose touched pages would count as resident for
as long as it stays open) in chunks straight into one 64-byte-aligned array per parameter, which the CPU backend
then adopts without a copy. Peak host memory is the placed state plus one parameter.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import jax
import ml_dtypes
import numpy as np
from rich.progress import Progress

from pdscope_jax.weights.safetensors_check import REDOWNLOAD as _REDOWNLOAD
from pdscope_jax.weights.safetensors_check import TensorInfo, read_header
from pdscope_jax.weights.spec import Source

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

# Stored dtypes that convert to this package's float parameters.
LOADABLE_DTYPES = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
}
_CHUNK_BYTES = 32 << 20  # a read buffer; bounds the extra memory of transposing or converting a tensor
_TRANSPOSE_ROWS = 64  # transposing a few rows at a time keeps the strided writes in cache
_MAX_LINES = 100  # message lines shown; `CheckpointError.problems` keeps them all
PROGRESS_BYTES = 256 << 20  # loading at least this many bytes shows a progress bar


class CheckpointError(ValueError):
    """Everything wrong with a checkpoint, one problem a line; `problems` holds the lines."""

    def __init__(self, problems: list[str], where: str = ""):
        self.problems = list(problems)
        shown = self.problems[:_MAX_LINES]
        more = len(self.problems) - len(shown)
        head = f"checkpoint {where} cannot be loaded" if where else "checkpoint cannot be loaded"
        lines = [f"{head}: {len(self.problems)} problem(s)"] + [f"  - {p}" for p in shown]
        if more:
            lines.append(f"  ... and {more} more (all in CheckpointError.problems)")
        super().__init__("\n".join(lines))


@dataclass(frozen=True)
class Checkpoint:
    path: Path  # the checkpoint directory
    tensors: dict[str, TensorInfo]  # every tensor of every readable header
    problems: tuple[str, ...]  # file-level problems found by open_checkpoint
    broken_files: frozenset[Path]  # files that cannot be read (absent, corrupt or truncated)
    unaccounted: frozenset[str]  # keys the index places in a file whose header is unavailable
    contents_unknown: bool  # a broken file whose tensors are not known at all (single file, corrupt header)

    @property
    def nbytes(self) -> int:
        return sum(info.nbytes for info in self.tensors.values())

    def check(self, param: str, source: Source, shape: tuple[int, ...]) -> list[str]:
        """Problems of one parameter's source against the headers (shape, dtype, missing tensors)."""
        problems: list[str] = []
        groups = source.keys
        if source.stacked:
            if len(shape) == 0 or shape[0] != len(groups):
                return [f"parameter '{param}' has shape {list(shape)} but its source stacks {len(groups)} "
                        "groups of tensors: the model's checkpoint_sources disagree with its shapes (a model bug)"]
            group_shape = tuple(shape[1:])
        else:
            if len(groups) != 1:
                return [f"parameter '{param}' has {len(groups)} groups of tensors but is not stacked: "
                        "the model's checkpoint_sources are malformed (a model bug)"]
            group_shape = tuple(shape)
        for group in groups:
            infos = []
            for key in group:
                info = self.tensors.get(key)
                if info is None:
                    if key not in self.unaccounted and not self.contents_unknown:
                        problems.append(f"missing tensor '{key}' (parameter '{param}'): the checkpoint lacks it; "
                                        "check that config.json belongs to these weights, or " + _REDOWNLOAD)
                    continue
                if info.dtype not in LOADABLE_DTYPES:
                    problems.append(
                        f"tensor '{key}' in {info.file.name} has dtype {info.dtype}; only "
                        f"{', '.join(LOADABLE_DTYPES)} can be loaded: convert the checkpoint to bfloat16 or float32 "
                        "(dequantize quantized weights first)")
                infos.append((key, info))
            if len(infos) == len(group):
                problems += _check_group(param, infos, group_shape, source.transpose)
        return problems

    def read(self, source: Source, shape: tuple[int, ...], dtype) -> np.ndarray:
        """The parameter made from `source`, as a new (64-byte-aligned) array of `shape` and `dtype`."""
        shape = tuple(shape)
        problems = self.check("<read>", source, shape)
        keys = source.all_keys()
        problems += [f"{f.name} cannot be read (see the checkpoint's problems): {_REDOWNLOAD}"
                     for f in sorted({self.tensors[k].file for k in keys if k in self.tensors} & self.broken_files)]
        problems += [f"tensor '{k}' is in a file that cannot be read (see the checkpoint's problems): {_REDOWNLOAD}"
                     for k in keys if k not in self.tensors and (k in self.unaccounted or self.contents_unknown)]
        if problems:
            raise CheckpointError(problems, str(self.path))
        out = empty_aligned(shape, np.dtype(dtype))
        groups = [out[i] for i in range(shape[0])] if source.stacked else [out]
        for group, dst in zip(source.keys, groups):
            col = 0
            for key in group:
                info = self.tensors[key]
                width = info.shape[0] if source.transpose else info.shape[-1]
                _read_into(info, dst[..., col:col + width], source.transpose)
                col += width
        return out


def open_checkpoint(path: str | Path) -> Checkpoint:
    """Read the headers of a single-file or sharded safetensors checkpoint; no tensor data is read."""
    path = Path(path)
    directory = path if path.is_dir() else path.parent
    index_path, single_path = directory / INDEX_FILE, directory / SINGLE_FILE
    problems: list[str] = []
    tensors: dict[str, TensorInfo] = {}
    broken: set[Path] = set()
    unaccounted: set[str] = set()
    contents_unknown = False

    if index_path.exists():
        weight_map = _read_index(index_path)
        files = sorted({directory / name for name in weight_map.values()})
        for file in files:
            listed = sorted(k for k, v in weight_map.items() if v == file.name)
            if not file.exists():
                broken.add(file)
                unaccounted.update(listed)
                problems.append(f"shard {file.name} is listed in {INDEX_FILE} ({len(listed)} tensors) but absent "
                                f"from {directory}: download it again")
                continue
            header, file_problems = read_header(file)
            if file_problems:
                broken.add(file)
                problems.extend(file_problems)
            if header is None:
                unaccounted.update(listed)
                continue
            for key in sorted(set(listed) - set(header)):
                problems.append(f"{INDEX_FILE} places tensor '{key}' in {file.name}, whose header lacks it: "
                                f"{_REDOWNLOAD}")
            for key, info in header.items():
                if key in tensors:
                    problems.append(f"tensor '{key}' is in both {tensors[key].file.name} and {file.name}: "
                                    f"remove the stale shard or {_REDOWNLOAD}")
                tensors[key] = info
    elif single_path.exists():
        header, file_problems = read_header(single_path)
        if file_problems:
            broken.add(single_path)
            problems.extend(file_problems)
        if header is None:
            contents_unknown = True
        else:
            tensors.update(header)
    else:
        others = sorted(p.name for p in directory.glob("*.safetensors")) if directory.is_dir() else []
        hint = (f"; found {', '.join(others)} without an index: add {INDEX_FILE} with their weight_map"
                if others else "")
        raise CheckpointError([f"no {SINGLE_FILE} or {INDEX_FILE} in {directory}{hint}"], str(directory))
    return Checkpoint(directory, tensors, tuple(problems), frozenset(broken), frozenset(unaccounted),
                      contents_unknown)


def validate(ckpt: Checkpoint, sources: dict[str, Source], shapes: dict[str, jax.ShapeDtypeStruct]) -> list[str]:
    """Every problem of loading `sources` with `shapes` from `ckpt`, one line each; empty when it will load."""
    problems = list(ckpt.problems)
    for path in sorted(sources.keys() ^ shapes.keys()):
        side = "a source but no shape" if path in sources else "a shape but no source"
        problems.append(f"parameter '{path}' has {side}: the model's checkpoint_sources do not cover its "
                        "parameters (a model bug)")
    used: set[str] = set()
    for path, source in sources.items():
        used.update(source.all_keys())
        if path in shapes:
            problems += ckpt.check(path, source, tuple(shapes[path].shape))
    if ckpt.contents_unknown:
        problems.append("the tensors could not be checked against the parameters because of the file problems "
                        "above")
    stacks = _expert_templates(sources)
    for key in sorted(ckpt.tensors.keys() - used):
        file = ckpt.tensors[key].file.name
        leftover = _match_template(key, stacks)
        if leftover:
            param, count, index = leftover
            problems.append(
                f"expert tensor '{key}' in {file} is left over: parameter '{param}' stacks {count} experts "
                f"(0..{count - 1}) and this is expert {index}; set the expert count in config.json to the "
                "checkpoint's, or use the checkpoint that matches config.json")
        else:
            problems.append(f"unexpected tensor '{key}' in {file}: no parameter uses it; check that config.json "
                            "belongs to these weights (model_type, layer count, tied embeddings)")
    return problems


def load_state(
    ckpt: Checkpoint,
    sources: dict[str, Source],
    shapes: dict[str, jax.ShapeDtypeStruct],
    placement: Callable[[str], jax.sharding.Sharding],
) -> dict[str, jax.Array]:
    """Validate everything, then read, place and drop one parameter at a time."""
    return checkpoint_loader(ckpt, sources, shapes)(list(sources), placement)


def checkpoint_loader(
    ckpt: Checkpoint, sources: dict[str, Source], shapes: dict[str, jax.ShapeDtypeStruct]
) -> Callable[[list[str], Callable[[str], jax.sharding.Sharding]], dict[str, jax.Array]]:
    """Validate the whole checkpoint now; return `loader(paths, placement)` that reads just those parameters.

    The offload engine asks for the non-expert parameters first and then one MoE layer's experts at a time."""
    problems = validate(ckpt, sources, shapes)
    if problems:
        raise CheckpointError(problems, str(ckpt.path))

    def loader(paths: list[str], placement: Callable[[str], jax.sharding.Sharding]) -> dict[str, jax.Array]:
        state: dict[str, jax.Array] = {}
        with Progress(transient=True, disable=ckpt.nbytes < PROGRESS_BYTES) as progress:
            task = progress.add_task(f"loading {ckpt.path.name}", total=len(paths))
            for path in paths:
                host = ckpt.read(sources[path], shapes[path].shape, shapes[path].dtype)
                state[path] = jax.device_put(host, placement(path))
                # Wait before reading the next one: at most one host copy is alive beside the placed state.
                state[path].block_until_ready()
                del host
                progress.advance(task)
        return state

    return loader


# ---- headers ---------------------------------------------------------------------------------------------------

def _read_index(index_path: Path) -> dict[str, str]:
    try:
        weight_map = json.loads(index_path.read_text())["weight_map"]
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise TypeError("weight_map is not a mapping of tensor names to file names")
    except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError) as err:
        raise CheckpointError([f"{index_path.name} is not a valid index ({type(err).__name__}: {err}): "
                               f"{_REDOWNLOAD}"], str(index_path.parent)) from None
    return weight_map


# ---- validation helpers ----------------------------------------------------------------------------------------

def _check_group(param: str, infos: list[tuple[str, TensorInfo]], group_shape: tuple[int, ...],
                 transpose: bool) -> list[str]:
    """Tensors of one group, each transposed if asked, must concatenate along the last axis to `group_shape`."""
    shapes = [info.shape[::-1] if transpose else info.shape for _, info in infos]
    fits = (all(len(s) == len(group_shape) and s[:-1] == group_shape[:-1] for s in shapes)
            and len(group_shape) > 0 and sum(s[-1] for s in shapes) == group_shape[-1])
    if fits:
        return []
    if len(infos) == 1:
        key, info = infos[0]
        needed = list(group_shape[::-1] if transpose else group_shape)  # as the file would store it
        return [f"tensor '{key}' in {info.file.name} has shape {list(info.shape)} but parameter '{param}' needs "
                f"{needed}: config.json's sizes do not match these weights; fix config.json or use the matching "
                "checkpoint"]
    parts = ", ".join(f"'{key}' {list(info.shape)}" for key, info in infos)
    return [f"tensors {parts} (in {infos[0][1].file.name}) do not make parameter '{param}' of "
            f"{list(group_shape)} (each {'transposed, ' if transpose else ''}concatenated along the last axis): "
            "config.json's sizes do not match these weights; fix config.json or use the matching checkpoint"]


_NUMBER = re.compile(r"(?<=\.)\d+(?=\.)")


def _expert_templates(sources: dict[str, Source]) -> dict[str, tuple[str, int]]:
    """Key templates of stacked sources ('...experts.*.w1.weight' -> (param, count)) to name left-over experts."""
    templates: dict[str, tuple[str, int]] = {}
    for path, source in sources.items():
        if not source.stacked:
            continue
        for j, key in enumerate(source.keys[0]):
            # The stack index is the dotted number that counts 0, 1, 2, ... through the groups.
            for m in reversed(list(_NUMBER.finditer(key))):
                if m.group() != "0":
                    continue
                template = key[:m.start()] + "*" + key[m.end():]
                if all(group[j] == template.replace("*", str(i), 1) for i, group in enumerate(source.keys)):
                    templates[template] = (path, len(source.keys))
                    break
    return templates


def _match_template(key: str, templates: dict[str, tuple[str, int]]) -> tuple[str, int, int] | None:
    for m in _NUMBER.finditer(key):
        template = key[:m.start()] + "*" + key[m.end():]
        if template in templates:
            param, count = templates[template]
            return param, count, int(m.group())
    return None


# ---- reading ---------------------------------------------------------------------------------------------------

def empty_aligned(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """np.empty aligned to 64 bytes, which the CPU backend's device_put adopts without copying."""
    nbytes = math.prod(shape) * dtype.itemsize
    raw = np.empty(nbytes + 64, np.uint8)
    offset = -raw.ctypes.data % 64
    return raw[offset:offset + nbytes].view(dtype).reshape(shape)


def _read_into(info: TensorInfo, dst: np.ndarray, transpose: bool) -> None:
    """Read one stored tensor into `dst` (its transpose, if asked), converting the dtype on the way."""
    stored = LOADABLE_DTYPES[info.dtype]
    with open(info.file, "rb", buffering=0) as f:
        f.seek(info.start)
        if not transpose and stored == dst.dtype and dst.flags.c_contiguous:
            _read_exact(f, dst.reshape(-1).view(np.uint8), info)
            return
        if len(info.shape) == 0:
            buf = np.empty(1, stored)
            _read_exact(f, buf.view(np.uint8), info)
            dst[...] = buf[0]
            return
        rows = info.shape[0]
        row_items = math.prod(info.shape[1:])
        step = max(1, _CHUNK_BYTES // max(1, row_items * stored.itemsize))
        buf = np.empty(min(rows, step) * row_items, stored)
        for r0 in range(0, rows, step):
            r1 = min(rows, r0 + step)
            chunk = buf[:(r1 - r0) * row_items].reshape((r1 - r0,) + info.shape[1:])
            _read_exact(f, chunk.reshape(-1).view(np.uint8), info)
            if transpose:
                for b in range(r0, r1, _TRANSPOSE_ROWS):
                    e = min(r1, b + _TRANSPOSE_ROWS)
                    dst[..., b:e] = chunk[b - r0:e - r0].transpose()
            else:
                dst[r0:r1] = chunk


def read_exact(f, view: np.ndarray) -> bool:
    """Fill the byte array `view` from `f` (one read() returns at most about 2 GiB on Linux); False when the file
    ends first."""
    memory, done = memoryview(view), 0
    while done < view.nbytes:
        n = f.readinto(memory[done:])
        if not n:
            return False
        done += n
    return True


def _read_exact(f, view: np.ndarray, info: TensorInfo) -> None:
    if not read_exact(f, view):
        raise CheckpointError([f"{info.file.name} ended while reading a tensor at byte {info.start}: "
                               f"{_REDOWNLOAD}"])
