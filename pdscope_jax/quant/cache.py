"""Quantized routed experts cached on disk: a checkpoint's experts are quantized once, later loads read them back.

Contract: `cached_quantizing_loader(loader, quant, ckpt, name, dense_shapes, root=None)` wraps the dense loader of
checkpoint `ckpt` (`weights.checkpoint.checkpoint_loader`) into a loader of the quantized model, as
`quant.loader.quantizing_loader` does, with the same values. Non-expert parameters pass through. At the first
request for an expert parameter the cache folder `cache_root(root) / f"{name}-{scheme}-{key}"` is checked:
- complete (a sealed MANIFEST whose files have their listed sizes): expert parameters are read from it, each
  layer file checked against the sha256 the manifest lists before its first read (a damaged one: a warning
  naming it, and that layer quantized from the source);
- otherwise it is built, MoE layer by MoE layer (a progress bar counts them): the layer's two dense stacks are
  loaded from the source where `placement` puts them, quantized, written to `layer-LLL.safetensors` atomically
  (tensor names are the quantized model's parameter paths, each tensor 64-byte aligned where sizes allow) and
  dropped; MANIFEST is written last, so a killed build leaves no manifest. A layer file already there was
  written whole by an earlier run with the same key (atomic renames), so a rebuild keeps it (resumes); temporary
  files of dead processes are deleted. Host memory: the placed state plus one dense layer and its quantized copy.
- a folder that cannot be written: one warning, then each layer is quantized from the source without a cache.
Expert parameters are then read from the files (plain reads into aligned arrays, one tensor at a time) and placed
with `placement`. The dense expert tensors are never read from the source on a hit.
Key (`cache_key`): sha256 over FORMAT_VERSION, the source of `quant.formats` (any change to the quantization
math invalidates old caches), the scheme, the dense dtype the experts are quantized from, and `fingerprint(ckpt)`:
config.json and the index by content; each safetensors file by size and mtime_ns, or by its sha256 where it is a
Hugging Face hub blob (content-addressed: exact, and free).
`cache_root(root)`: `root`, else $PDSCOPE_QUANT_CACHE, else $XDG_CACHE_HOME/pdscope_jax/quantized, else
~/.cache/pdscope_jax/quantized.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import struct
import warnings
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
from rich.progress import Progress

from pdscope_jax.artifacts import integrity
from pdscope_jax.quant import formats
from pdscope_jax.quant.loader import SCALE, dense_path, quantizing_loader
from pdscope_jax.runtime import user_cache_dir
from pdscope_jax.weights.checkpoint import INDEX_FILE, PROGRESS_BYTES, Checkpoint, empty_aligned, read_exact
from pdscope_jax.weights.safetensors_check import read_header

FORMAT_VERSION = 1
ENV = "PDSCOPE_QUANT_CACHE"
MANIFEST = "manifest.json"
ALIGN = 64  # host arrays: the CPU backend adopts 64-byte-aligned buffers without a copy; file offsets too
_ST_DTYPES = {np.dtype(np.int8): "I8", np.dtype(np.uint8): "U8", np.dtype(np.float32): "F32",
              np.dtype(ml_dtypes.bfloat16): "BF16"}
_NP_DTYPES = {v: k for k, v in _ST_DTYPES.items()}
_HUB_BLOB = re.compile(r"[0-9a-f]{64}")


class CacheInvalid(Exception):
    """A cache folder or file that cannot be used as it is (it is rebuilt)."""


def cache_root(root: str | Path | None = None) -> Path:
    if root is not None:
        return Path(root).expanduser()
    if os.environ.get(ENV):
        return Path(os.environ[ENV]).expanduser()
    return user_cache_dir("quantized")


def fingerprint(ckpt: Checkpoint) -> dict:
    """What identifies a checkpoint's contents cheaply (no tensor data is read); see the module docstring."""
    out = {}
    for name in ("config.json", INDEX_FILE):
        path = ckpt.path / name
        if path.is_file():
            out[name] = {"sha256": hashlib.sha256(path.read_bytes()).hexdigest()}
    for file in sorted({info.file for info in ckpt.tensors.values()}):
        stat, blob = file.stat(), file.resolve()
        if blob.parent.name == "blobs" and _HUB_BLOB.fullmatch(blob.name):
            out[file.name] = {"bytes": stat.st_size, "sha256": blob.name}
        else:
            out[file.name] = {"bytes": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    return out


def cache_key(ckpt: Checkpoint, quant: str, dense_dtype) -> dict:
    """The key's inputs; `key_hash` of them names the folder."""
    s = formats.scheme(quant)
    return {"format": FORMAT_VERSION, "quantizer": hashlib.sha256(Path(formats.__file__).read_bytes()).hexdigest(),
            "scheme": {"name": s.name, "bits": s.bits, "group": s.group}, "dense_dtype": np.dtype(dense_dtype).name,
            "source": fingerprint(ckpt)}


def key_hash(key: dict) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def write_safetensors(path: Path, tensors: dict[str, np.ndarray]) -> tuple[str, int]:
    """Write `tensors` as a safetensors file atomically; (sha256, bytes). Largest tensors first and the header
    padded to ALIGN, so every tensor starts aligned while the sizes before it are multiples of ALIGN."""
    order = sorted(tensors, key=lambda k: (-tensors[k].nbytes, k))
    header, offset = {}, 0
    for k in order:
        a = tensors[k]
        header[k] = {"dtype": _ST_DTYPES[a.dtype], "shape": list(a.shape), "data_offsets": [offset, offset + a.nbytes]}
        offset += a.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % ALIGN)  # the format allows trailing spaces in the header

    def fill(fh):
        fh.write(struct.pack("<Q", len(text)))
        fh.write(text)
        for k in order:
            fh.write(np.ascontiguousarray(tensors[k]).reshape(-1).view(np.uint8))

    return integrity.atomic_write(path, fill)


class _Cache:
    """One cache folder: the expected tensors of each MoE layer, building, checking and reading."""

    def __init__(self, folder: Path, key: dict, dense_shapes: dict):
        self.folder, self.key = folder, key
        self.listed: dict[str, dict] = {}  # the manifest's {file name: {"sha256", "bytes"}} once complete
        self.verified: set[int] = set()  # layers whose file matched its listed sha256 in this process
        s = formats.scheme(key["scheme"]["name"])
        self.layers: dict[int, dict[str, tuple]] = {}  # layer -> {parameter path: (shape, dtype)}
        self.dense_bytes = 0
        for path, sds in dense_shapes.items():
            if dense_path(path) is None:
                continue
            self.dense_bytes += sds.size * np.dtype(sds.dtype).itemsize
            *lead, k, n = sds.shape
            q, scale = formats.shapes(tuple(lead), k, n, s)
            tensors = self.layers.setdefault(int(path.split(".")[1]), {})
            tensors[path] = (tuple(q.shape), np.dtype(q.dtype))
            tensors[path + SCALE] = (tuple(scale.shape), np.dtype(scale.dtype))
        self.layers = dict(sorted(self.layers.items()))

    def file(self, layer: int) -> Path:
        return self.folder / f"layer-{layer:03d}.safetensors"

    def header(self, layer: int) -> dict:
        """The TensorInfos of a layer's file; CacheInvalid unless it holds exactly the expected tensors."""
        file = self.file(layer)
        if not file.is_file():
            raise CacheInvalid(f"{file.name} is missing")
        tensors, problems = read_header(file)
        if problems or tensors is None:
            raise CacheInvalid("; ".join(problems))
        got = {k: (info.shape, _NP_DTYPES.get(info.dtype)) for k, info in tensors.items()}
        if got != self.layers[layer]:
            raise CacheInvalid(f"{file.name} holds {got}, not {self.layers[layer]}")
        return tensors

    def complete(self) -> bool:
        """True when the manifest is sealed, has this key, and lists every layer file with its size."""
        path = self.folder / MANIFEST
        if not path.is_file():
            return False
        try:
            doc = integrity.read_json(path, CacheInvalid, "rebuilding")
            integrity.check_seal(doc, CacheInvalid, path, "rebuilding")
            if doc.get("key") != json.loads(json.dumps(self.key)):
                raise CacheInvalid(f"{path} belongs to another source or scheme")
            for layer in self.layers:
                entry = doc["files"].get(self.file(layer).name) or {}
                size = self.file(layer).stat().st_size if self.file(layer).is_file() else None
                if entry.get("bytes") != size:
                    raise CacheInvalid(f"{self.file(layer).name} has {size} bytes, the manifest says "
                                       f"{entry.get('bytes')}")
            self.listed = doc["files"]
        except (CacheInvalid, KeyError, AttributeError, TypeError) as err:
            warnings.warn(f"quantized-expert cache {self.folder} is damaged ({err}); rebuilding it", stacklevel=4)
            path.unlink(missing_ok=True)
            return False
        return True

    def build(self, quantizing, placement) -> None:
        """Write every missing layer file, then the manifest; OSError when the folder cannot be written."""
        self.folder.mkdir(parents=True, exist_ok=True)
        for target in [*(self.file(layer) for layer in self.layers), self.folder / MANIFEST]:
            integrity.remove_stale(target)
        files = {}
        with Progress(transient=True, disable=self.dense_bytes < PROGRESS_BYTES) as progress:
            task = progress.add_task(f"quantizing experts -> {self.folder}", total=len(self.layers))
            for layer, tensors in self.layers.items():
                try:
                    self.header(layer)  # written whole by an interrupted run with the same key: keep it
                    files[self.file(layer).name] = dict(zip(("sha256", "bytes"),
                                                            integrity.sha256_file(self.file(layer))))
                except CacheInvalid:
                    values = quantizing(list(tensors), placement)
                    host = {k: np.asarray(v) for k, v in values.items()}
                    del values
                    digest, size = write_safetensors(self.file(layer), host)
                    files[self.file(layer).name] = {"sha256": digest, "bytes": size}
                    del host
                progress.advance(task)
        doc = integrity.seal({"key": self.key, "layers": {str(layer): self.file(layer).name for layer in self.layers},
                              "files": files})
        integrity.atomic_write_json(self.folder / MANIFEST, doc, indent=1)
        self.listed, self.verified = files, set(self.layers)  # hashed as written (or just now, when kept)

    def read(self, layer: int, paths: list[str], placement) -> dict:
        """The layer's parameters `paths` from its file, placed with `placement`; CacheInvalid when the file's
        content differs from the sha256 the manifest lists (checked once per layer and process)."""
        infos = self.header(layer)
        if layer not in self.verified:
            name = self.file(layer).name
            digest, _ = integrity.sha256_file(self.file(layer))
            if digest != (self.listed.get(name) or {}).get("sha256"):
                raise CacheInvalid(f"{name}: its content differs from the sha256 in the manifest (damaged on disk)")
            self.verified.add(layer)
        out = {}
        for path in paths:
            out[path] = jax.device_put(_read_aligned(infos[path]), placement(path))
            out[path].block_until_ready()  # the host buffer is dropped before the next one is read
        return out


def _read_aligned(info) -> np.ndarray:
    """A tensor read with plain file reads into a new ALIGN-aligned array, which the CPU backend adopts without
    a copy (a memory map would count its touched pages as resident while it is open, and an adopted map would
    tie the live model to the file)."""
    buf = empty_aligned((info.nbytes,), np.dtype(np.uint8))
    with open(info.file, "rb", buffering=0) as f:
        f.seek(info.start)
        if not read_exact(f, buf):
            raise CacheInvalid(f"{info.file.name} ended inside a tensor")
    return buf.view(_NP_DTYPES[info.dtype]).reshape(info.shape)


def cached_quantizing_loader(loader, quant: str, ckpt: Checkpoint, name: str, dense_shapes: dict,
                             root: str | Path | None = None):
    """The loader of the quantized model, its experts served from (and, the first time, written to) the cache."""
    dense_dtype = next(s.dtype for p, s in dense_shapes.items() if dense_path(p) is not None)
    key = cache_key(ckpt, quant, dense_dtype)
    safe_name = re.sub(r"[^A-Za-z0-9._-]+", "--", name).strip("-.") or "model"
    cache = _Cache(cache_root(root) / f"{safe_name}-{formats.scheme(quant).name}-{key_hash(key)}", key,
                   dense_shapes)
    quantizing = quantizing_loader(loader, quant)
    state = {"ready": None}  # None: not checked yet; True: serve from the files; False: quantize, no cache

    def ready(placement) -> bool:
        if state["ready"] is None:
            try:
                state["ready"] = cache.complete()
                if not state["ready"]:
                    cache.build(quantizing, placement)
                    state["ready"] = True
            except OSError as err:
                warnings.warn(f"the quantized-expert cache {cache.folder} cannot be written ({err}); quantizing "
                              f"without a cache: set ${ENV} to a writable folder, or pass quant_cache=False",
                              stacklevel=3)
                state["ready"] = False
        return state["ready"]

    def load(paths, placement):
        paths = list(paths)
        by_layer: dict[int, list[str]] = {}
        for p in paths:
            if dense_path(p) is not None:
                by_layer.setdefault(int(p.split(".")[1]), []).append(p)
        rest = [p for p in paths if dense_path(p) is None]
        out = loader(rest, placement) if rest else {}
        if by_layer:
            from_cache = ready(placement)
            for layer, wanted in sorted(by_layer.items()):  # one layer at a time bounds the dense copies
                try:
                    out.update(cache.read(layer, wanted, placement) if from_cache else quantizing(wanted, placement))
                except CacheInvalid as err:  # the file changed after the check: this layer from the source
                    warnings.warn(f"quantized-expert cache {cache.folder}: {err}; quantizing layer {layer} from the "
                                  "source", stacklevel=2)
                    out.update(quantizing(wanted, placement))
        return {p: out[p] for p in paths}

    load.cache_folder = cache.folder
    return load
