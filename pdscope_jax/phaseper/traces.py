"""Routing traces: the training data of PhasePer, written with bounded memory and read back aligned.

Contract
- `TraceWriter(dir, cfg_fingerprint, layers, dim, k, num_experts)` receives, per MoE layer and phase
  ("prefill" / "decode", always kept apart), one call per forward step:
  `add(phase, layer, a [N,D], w [N,K], e [N,K])` with the attention output `a` (stored as float16),
  the routing weights `w` (float32) and the selected experts `e` (int32). Every layer of a step must be
  given the same N tokens in the same order: token i of layer l pairs with token i of the next layer.
- Memory stays bounded: each (phase, layer) buffers fewer than `flush_tokens` tokens plus one step before
  writing a shard, so the writer holds at most about 2 * layers * (flush_tokens + step) * (2D + 8K) bytes.
  `max_tokens[phase]` caps what is kept per layer; the part of a step past the cap is dropped, identically
  at every layer, so alignment survives the cap.
- Every file is written to a temporary name and renamed into place (`integrity.atomic_write`); `manifest.json`
  is rewritten (also atomically, sealed with its own checksum) after each shard and lists each shard file's
  size and sha256, so a crash leaves a directory whose manifest lists only complete shards.
- Per step and per layer the writer records the step's kept token count and its per-expert token counts
  `counts [E]` (used by the Table-5 metric).
- `load_traces(dir) -> Traces`: `Traces.pairs(phase, l)` gives `LayerPairs(a_l, w_l, e_l, e_next, steps)`
  for consecutive MoE layers l -> l+1, truncated to the tokens both layers hold. Layers are read on demand
  and only a few stay cached, so reading is bounded by a few layers' worth of one phase. The manifest's seal
  is checked on opening and each shard file's size and sha256 as it is read; a missing or corrupt file raises
  `TraceError` naming it (format 1 directories, before checksums, are read unchecked).

Layout: `<dir>/manifest.json`, `<dir>/<phase>/layer<l>/{a,w,e,steps,counts}.<shard>.npy`.
"""

from __future__ import annotations

import dataclasses
import io
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np

from pdscope_jax.artifacts import integrity

PHASES = ("prefill", "decode")
FORMAT_VERSION = 2
_LEGACY_VERSION = 1  # no checksums: read unchecked
REMEDY = "collect the traces again into a new directory (`pdscope-jax collect-traces --out NEW_DIR`)"
_FIELDS = ("a", "w", "e", "steps", "counts")
_DEFAULT_MAX_TOKENS = {"prefill": 65536, "decode": 16384}


class TraceError(ValueError):
    """A trace directory or an `add` call that does not match the declared format."""


class TraceWriter:
    """Appends trace chunks to per-(phase, layer) shard files; see the module docstring."""

    def __init__(
        self,
        directory: str | Path,
        cfg_fingerprint: str,
        layers: Sequence[int],
        dim: int,
        k: int,
        num_experts: int,
        *,
        flush_tokens: int = 1024,
        max_tokens: Mapping[str, int] | int = _DEFAULT_MAX_TOKENS,
        description: str = "",
    ):
        if len(layers) < 2:
            raise TraceError("traces need at least two MoE layers (a layer and its successor)")
        self.dir = Path(directory)
        if (self.dir / "manifest.json").exists():
            raise TraceError(f"{self.dir} already holds traces (manifest.json); pick a new directory")
        self.dir.mkdir(parents=True, exist_ok=True)
        self.fingerprint = cfg_fingerprint
        self.layers = tuple(int(l) for l in layers)
        self.dim, self.k, self.num_experts = int(dim), int(k), int(num_experts)
        self.flush_tokens = int(flush_tokens)
        caps = max_tokens if isinstance(max_tokens, Mapping) else {p: int(max_tokens) for p in PHASES}
        self.max_tokens = {p: int(caps[p]) for p in PHASES}
        self.description = description
        self._buf: dict[tuple[str, int], dict[str, list[np.ndarray]]] = {}
        self._buffered: dict[tuple[str, int], int] = {}
        self._kept = {(p, l): 0 for p in PHASES for l in self.layers}
        self._shards: dict[str, dict[str, list[dict]]] = {p: {str(l): [] for l in self.layers} for p in PHASES}
        self._closed = False
        self._write_manifest()

    # ---- writing -------------------------------------------------------------------------------------
    def add(self, phase: str, layer: int, a: np.ndarray, w: np.ndarray, e: np.ndarray) -> int:
        """Record one step of one layer; returns how many of its tokens were kept (0 once the cap is hit)."""
        if self._closed:
            raise TraceError("TraceWriter is closed")
        if phase not in PHASES:
            raise TraceError(f"phase must be one of {PHASES}, got {phase!r}")
        if layer not in self.layers:
            raise TraceError(f"layer {layer} is not one of the declared MoE layers {self.layers}")
        a, w, e = np.asarray(a), np.asarray(w), np.asarray(e)
        n = a.shape[0]
        if a.shape != (n, self.dim) or w.shape != (n, self.k) or e.shape != (n, self.k):
            raise TraceError(
                f"expected a [N,{self.dim}], w [N,{self.k}], e [N,{self.k}]; got {a.shape}, {w.shape}, {e.shape}"
            )
        if n and (e.min() < 0 or e.max() >= self.num_experts):
            raise TraceError(f"expert ids must lie in [0, {self.num_experts})")
        key = (phase, layer)
        take = min(n, self.max_tokens[phase] - self._kept[key])
        if take <= 0:
            return 0
        e_kept = e[:take].astype(np.int32)
        counts = np.bincount(e_kept.reshape(-1), minlength=self.num_experts).astype(np.int32)  # [E]
        buf = self._buf.setdefault(key, {f: [] for f in _FIELDS})
        buf["a"].append(a[:take].astype(np.float16))
        buf["w"].append(w[:take].astype(np.float32))
        buf["e"].append(e_kept)
        buf["steps"].append(np.array([take], np.int32))
        buf["counts"].append(counts[None])
        self._kept[key] += take
        self._buffered[key] = self._buffered.get(key, 0) + take
        if self._buffered[key] >= self.flush_tokens:
            self._flush(key)
        return take

    def _flush(self, key: tuple[str, int]) -> None:
        buf = self._buf.pop(key, None)
        self._buffered.pop(key, None)
        if not buf or not buf["a"]:
            return
        phase, layer = key
        shards = self._shards[phase][str(layer)]
        sub = self.dir / phase / f"layer{layer}"
        sub.mkdir(parents=True, exist_ok=True)
        index = len(shards)
        tokens, files = 0, {}
        for field in _FIELDS:
            array = np.concatenate(buf[field])
            tokens = array.shape[0] if field == "a" else tokens
            digest, size = integrity.atomic_write(sub / f"{field}.{index:06d}.npy",
                                                  lambda fh, a=array: np.save(fh, a, allow_pickle=False))
            files[field] = {"bytes": size, "sha256": digest}
        shards.append({"index": index, "tokens": int(tokens), "steps": len(buf["steps"]), "files": files})
        self._write_manifest()

    def _write_manifest(self) -> None:
        manifest = {
            "format_version": FORMAT_VERSION,
            "fingerprint": self.fingerprint,
            "description": self.description,
            "layers": list(self.layers),
            "dim": self.dim,
            "k": self.k,
            "num_experts": self.num_experts,
            "max_tokens": self.max_tokens,
            "complete": self._closed,
            "shards": self._shards,
        }
        # compact: rewritten after every shard, so its encoding time adds up over a collection
        integrity.atomic_write_json(self.dir / "manifest.json", integrity.seal(manifest))

    def close(self) -> None:
        """Write every buffered chunk and mark the manifest complete."""
        if self._closed:
            return
        for key in list(self._buf):
            self._flush(key)
        self._closed = True
        self._write_manifest()

    def __enter__(self) -> "TraceWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ---- reading ---------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class LayerPairs:
    """Aligned training pairs for the predictor of layer `layer` -> `next_layer` in one phase."""

    layer: int
    next_layer: int
    a: np.ndarray  # [N, D] float16, attention output of `layer`
    w: np.ndarray  # [N, K] float32, routing weights of `layer`
    e: np.ndarray  # [N, K] int32, selected experts of `layer`
    e_next: np.ndarray  # [N, K] int32, selected experts of `next_layer` (the target)
    steps: np.ndarray  # [S] int32, tokens per step; sums to N

    def __len__(self) -> int:
        return self.a.shape[0]


class Traces:
    """A trace directory opened for reading. Arrays are read per (phase, layer) on demand and only the
    `cache_layers` most recently used layers stay in memory, so training layer by layer never holds the
    whole corpus."""

    def __init__(self, directory: Path, manifest: dict, cache_layers: int = 4):
        self.dir = directory
        self.manifest = manifest
        self.fingerprint: str = manifest["fingerprint"]
        self.description: str = manifest.get("description", "")
        self.layers: tuple[int, ...] = tuple(manifest["layers"])
        self.dim: int = manifest["dim"]
        self.k: int = manifest["k"]
        self.num_experts: int = manifest["num_experts"]
        self._cache: dict[tuple[str, int], dict[str, np.ndarray]] = {}
        self._cache_layers = cache_layers

    def tokens(self, phase: str, layer: int) -> int:
        return sum(s["tokens"] for s in self._shards(phase, layer))

    def _shards(self, phase: str, layer: int) -> list[dict]:
        if phase not in PHASES:
            raise TraceError(f"phase must be one of {PHASES}, got {phase!r}")
        if layer not in self.layers:
            raise TraceError(f"layer {layer} is not one of the traced MoE layers {self.layers}")
        return self.manifest["shards"][phase][str(layer)]

    def layer(self, phase: str, layer: int, max_tokens: int | None = None) -> dict[str, np.ndarray]:
        """{a [N,D] f16, w [N,K] f32, e [N,K] i32, steps [S] i32, counts [S,E] i32} of one phase and layer;
        with `max_tokens`, only the shards needed for the first max_tokens tokens are read (not cached)."""
        key = (phase, layer)
        if max_tokens is None and key in self._cache:
            self._cache[key] = self._cache.pop(key)  # most recently used last
            return self._cache[key]
        shards = self._shards(phase, layer)
        if max_tokens is not None:
            needed, total = [], 0
            for s in shards:
                if total >= max_tokens:
                    break
                needed.append(s)
                total += s["tokens"]
            shards = needed
        sub = self.dir / phase / f"layer{layer}"
        empty = {
            "a": np.zeros((0, self.dim), np.float16),
            "w": np.zeros((0, self.k), np.float32),
            "e": np.zeros((0, self.k), np.int32),
            "steps": np.zeros((0,), np.int32),
            "counts": np.zeros((0, self.num_experts), np.int32),
        }
        fields = {}
        for field in _FIELDS:
            parts = [self._read(sub / f"{field}.{s['index']:06d}.npy", s, field) for s in shards]
            fields[field] = np.concatenate(parts) if parts else empty[field]
        if max_tokens is not None:
            return {f: v[:max_tokens] for f, v in fields.items() if f in ("a", "w", "e")}
        self._cache[key] = fields
        while len(self._cache) > self._cache_layers:
            self._cache.pop(next(iter(self._cache)))
        return fields

    def _read(self, path: Path, shard: dict, field: str) -> np.ndarray:
        """One shard file, checked against the manifest's size and sha256 (format 2) before numpy parses it."""
        checked = self.manifest.get("format_version") == FORMAT_VERSION
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            raise TraceError(f"{path} is missing (the manifest lists it): {REMEDY}") from None
        if checked:
            files = shard.get("files")
            integrity.verify_bytes(path, data, files.get(field) if isinstance(files, dict) else None, TraceError,
                                   REMEDY)
        try:
            return np.load(io.BytesIO(data), allow_pickle=False)
        except (ValueError, OSError, EOFError) as err:
            raise TraceError(f"{path} is not a readable .npy file ({err}): {REMEDY}") from None

    def pairs(self, phase: str, layer: int) -> LayerPairs:
        pos = self.layers.index(layer) if layer in self.layers else -1
        if pos < 0:
            raise TraceError(f"layer {layer} is not one of the traced MoE layers {self.layers}")
        if pos + 1 >= len(self.layers):
            raise TraceError(f"layer {layer} is the last MoE layer: it has no successor to predict")
        nxt = self.layers[pos + 1]
        cur, fol = self.layer(phase, layer), self.layer(phase, nxt)
        n = min(cur["a"].shape[0], fol["e"].shape[0])
        steps = _truncate_steps(cur["steps"], n)
        return LayerPairs(layer, nxt, cur["a"][:n], cur["w"][:n], cur["e"][:n], fol["e"][:n], steps)


def _truncate_steps(steps: np.ndarray, n: int) -> np.ndarray:
    ends = np.cumsum(steps)
    keep = steps[ends <= n]
    rest = n - int(keep.sum())
    return np.concatenate([keep, [rest]]).astype(np.int32) if rest else keep.astype(np.int32)


def load_traces(directory: str | Path, cache_layers: int = 4) -> Traces:
    """Open a trace directory. Only shards the manifest lists are ever read; others on disk are ignored."""
    directory = Path(directory)
    path = directory / "manifest.json"
    if not path.exists():
        raise TraceError(f"{directory} holds no manifest.json: not a trace directory (make one with "
                         "`pdscope-jax collect-traces`)")
    manifest = integrity.read_json(path, TraceError, REMEDY)
    version = manifest.get("format_version") if isinstance(manifest, dict) else None
    integrity.check_seal(manifest, TraceError, path, REMEDY, required=version != _LEGACY_VERSION)
    if version not in (FORMAT_VERSION, _LEGACY_VERSION):
        raise TraceError(f"{directory}: trace format {version} != {FORMAT_VERSION}: {REMEDY}")
    missing = [k for k in ("fingerprint", "layers", "dim", "k", "num_experts", "shards") if k not in manifest]
    if missing:
        raise TraceError(f"{path} lacks {', '.join(missing)}: {REMEDY}")
    return Traces(directory, manifest, cache_layers)


def write_synthetic_traces(
    directory: str | Path,
    *,
    layers: Sequence[int] = (0, 1, 2, 3, 4),
    dim: int = 32,
    k: int = 2,
    num_experts: int = 8,
    prefill_steps: Sequence[int] = (64, 64, 64, 64),
    decode_steps: int = 64,
    noise: float = 0.3,
    seed: int = 0,
    fingerprint: str = "synthetic",
) -> Path:
    """Learnable synthetic routing traces (for tests and smoke runs of the training pipeline).

    Each token has a latent vector z [r]; layer l's attention output is a_l = z @ M_l + noise and its
    router picks the top-k of a_l @ R_l, so the next layer's experts are predictable from a_l.
    """
    rng = np.random.default_rng(seed)
    r = 8
    mix = [rng.normal(size=(r, dim)) for _ in layers]  # M_l [r, D]
    router = [rng.normal(size=(dim, num_experts)) for _ in layers]  # R_l [D, E]
    with TraceWriter(directory, fingerprint, layers, dim, k, num_experts, flush_tokens=100) as writer:
        for phase, steps in (("prefill", list(prefill_steps)), ("decode", [1] * decode_steps)):
            for n in steps:
                z = rng.normal(size=(n, r))  # [N, r]
                for pos, layer in enumerate(layers):
                    a = z @ mix[pos] + noise * rng.normal(size=(n, dim))  # [N, D]
                    scores = a @ router[pos]  # [N, E]
                    e = np.argsort(-scores, axis=1)[:, :k]  # [N, K]
                    top = np.take_along_axis(scores, e, axis=1)
                    w = np.exp(top - top.max(axis=1, keepdims=True))
                    writer.add(phase, layer, a, w / w.sum(axis=1, keepdims=True), e)
    return Path(directory)
