"""The activation memory of the largest prefill step, from XLA's own buffer assignment rather than a formula.

Contract: `measure_activations(cfg, rc, abstract, kv_cache, expert_dtype, cache_dtype) -> Measured | None`
(`kv_cache`: the engine's KV cache, abstract; None where the backend reports no memory analysis): compiles, from shapes
alone (nothing is placed or run), the programs one layer of the largest step runs (`engine.programs`: the first
dense layer, `moe_route_scored` (a superset of `moe_route`), `gpu_experts` over a one-layer stand-in of the slot
pool, `take_rows`, `moe_combine` with both routed parts, a logits window) on the default backend.
A program's peak is its temporaries plus its outputs plus its step-local inputs (what earlier programs of the
step made; weights, KV cache and pool are accounted elsewhere). `Measured.bytes` is the largest peak times
`MARGIN`: the engine runs these programs one after another on one stream, whose allocator reuses a finished
program's temporaries for the next. Results are kept per (config, shapes, backend) for the process, since tests
build many engines of one model, and, where JAX's persistent compilation cache is on, in its folder
(`activations/`, one JSON file per key; the key also holds jax's version, the device kind, XLA_FLAGS and
`artifacts.provenance.source_digest()`), so a warm start neither traces nor loads these programs again.
The largest step is `store.budget.largest_step`, padded as prefill pads it (`runtime.prefill_rows`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path

import jax
import jaxlib
import numpy as np
from flax import nnx

from pdscope_jax.artifacts import provenance
from pdscope_jax.artifacts.integrity import atomic_write_json
from pdscope_jax.engine.programs import LOGIT_ROWS, build_programs, program_pieces
from pdscope_jax.engine.route import DENSE_MAX_ROWS
from pdscope_jax.quant.formats import QuantizedWeight, scheme, shapes as quant_shapes
from pdscope_jax.runtime import RuntimeConfig, prefill_rows
from pdscope_jax.store.budget import largest_step

MARGIN = 1.25  # for the allocator's fragmentation and the small arrays the engine keeps between programs
_RESULTS: dict = {}  # key -> Measured, for the process


@dataclasses.dataclass(frozen=True)
class Measured:
    bytes: int  # what the budget reserves for activations
    peaks: tuple[tuple[str, int], ...]  # (program, temporaries + outputs + step-local inputs), as compiled


def measure_activations(cfg, rc: RuntimeConfig, abstract, kv_cache, expert_dtype, cache_dtype) -> Measured | None:
    b, tq = largest_step(rc)
    n_pad = prefill_rows(b * tq, rc, b)
    key = (cfg, b, tq, n_pad, tuple(a.shape for a in jax.tree.leaves(kv_cache)), np.dtype(expert_dtype).name,
           np.dtype(cache_dtype).name, jax.default_backend())
    if key not in _RESULTS:
        path = _stored_at(key)
        found, measured = _read(path)
        if not found:
            measured = _compile_and_read(key, abstract, kv_cache)
            _write(path, measured)
        _RESULTS[key] = measured
    return _RESULTS[key]


def _stored_at(key) -> Path | None:
    """The file of `key`'s figure in the persistent compilation cache's folder; None where that cache is off."""
    folder = jax.config.jax_compilation_cache_dir
    if not folder:
        return None
    device = jax.devices()[0]
    whole = repr((key, MARGIN, jax.__version__, jaxlib.__version__, device.platform, device.device_kind,
                  os.environ.get("XLA_FLAGS", ""), provenance.source_digest()))
    return Path(folder) / "activations" / (hashlib.sha256(whole.encode()).hexdigest()[:40] + ".json")


_NONE = "none"  # stored for a backend that reports no memory analysis


def _read(path: Path | None) -> tuple[bool, Measured | None]:
    """(whether a usable figure is stored at `path`, the figure: a Measured, or None for `_NONE`)."""
    if path is None or not path.is_file():
        return False, None
    try:
        data = json.loads(path.read_text())
        if data == _NONE:
            return True, None
        return True, Measured(int(data["bytes"]), tuple((str(name), int(peak)) for name, peak in data["peaks"]))
    except (OSError, ValueError, KeyError, TypeError):  # unreadable or written by other code: measure again
        return False, None


def _write(path: Path | None, measured: Measured | None) -> None:
    """Store `measured` at `path` whole or not at all (`artifacts.integrity.atomic_write_json`); a cache that cannot
    be written only costs the next start a measurement."""
    if path is None:
        return
    data = _NONE if measured is None else {"bytes": measured.bytes, "peaks": [list(p) for p in measured.peaks]}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(path, data)
    except OSError:
        pass


def _compile_and_read(key, abstract, cache) -> Measured | None:
    cfg, b, tq, n_pad, _cache_shapes, expert_dtype, cache_dtype, _backend = key
    programs = build_programs()
    s = jax.ShapeDtypeStruct
    d, f, e, k = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts, cfg.num_experts_per_tok
    x, positions = s((b, tq, d), cache_dtype), s((b, tq), np.int32)
    placed_graph, placed_state, layers = program_pieces(abstract)
    layers = [(graph, _without_experts(state)) if layer.is_moe else (graph, state)
              for (graph, state), layer in zip(layers, abstract.layers)]
    h, w = s((n_pad, d), cache_dtype), s((n_pad, k), np.float32)
    ids, rows = s((n_pad, k), np.int32), s((n_pad, d), np.float32)
    peaks: dict[str, int] = {}

    def peak(name, jitted, *args, local=()):
        analysis = jitted.lower(*args).compile().memory_analysis()
        if analysis is None:  # a backend that does not report it
            return
        used = analysis.temp_size_in_bytes + analysis.output_size_in_bytes + sum(_nbytes(a) for a in local)
        peaks[name] = max(peaks.get(name, 0), int(used))

    dense = [i for i, layer in enumerate(abstract.layers) if not layer.is_moe]
    if dense:
        graph, state = layers[dense[0]]
        peak("dense_layer", programs["dense_layer"], graph, state, x, positions, cache[dense[0]], local=(x,))
    moe = cfg.moe_layers
    graph, state = layers[moe[0]]
    with_h = n_pad <= DENSE_MAX_ROWS
    if len(moe) > 1:
        next_graph, next_state = layers[moe[1]]
        peak("moe_route_scored", programs["moe_route_scored"], graph, state, x, positions, cache[moe[0]], n_pad,
             with_h, next_graph, next_state, s((n_pad,), np.float32), local=(x,))
    else:
        peak("moe_route", programs["moe_route"], graph, state, x, positions, cache[moe[0]], n_pad, with_h, local=(x,))
    pool = _pool_shapes(cfg, e, d, f, expert_dtype)
    peak("gpu_experts", programs["gpu_experts"], h, w, ids, *pool, s((e,), np.int32), local=(x, h, w, ids))
    peak("take_rows", programs["take_rows"], h, s((n_pad,), np.int32), local=(x, h))
    shared = s((b * tq, d), cache_dtype)  # the shared experts' output: the step's rows, unpadded
    peak("moe_combine", programs["moe_combine"], x, shared, rows, rows, local=(x, shared, rows, rows))
    peak("logits", programs["logits"], placed_graph, placed_state, s((b, min(LOGIT_ROWS, tq), d), cache_dtype),
         0, min(LOGIT_ROWS, tq))
    if not peaks:  # the backend reports no memory analysis: the caller keeps the upper estimate
        return None
    return Measured(int(MARGIN * max(peaks.values())), tuple(sorted(peaks.items())))


def _without_experts(state):
    """An MoE layer's state as the engine places it (`engine.build.place_non_experts`): routed-expert stacks empty."""
    flat = nnx.to_flat_state(state)
    for path, var in flat:
        if tuple(map(str, path[:2])) == ("mlp", "experts"):
            var.set_value(jax.ShapeDtypeStruct((0,), var.get_value().dtype))
    return nnx.from_flat_state(flat)


def _pool_shapes(cfg, slots, d, f, dtype):
    if cfg.expert_quant is None:
        return jax.ShapeDtypeStruct((slots, d, 2 * f), dtype), jax.ShapeDtypeStruct((slots, f, d), dtype)
    return tuple(QuantizedWeight(*quant_shapes((slots,), rows, cols, cfg.expert_quant), scheme(cfg.expert_quant),
                                 dtype) for rows, cols in ((d, 2 * f), (f, d)))


def _nbytes(a) -> int:
    return int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize
