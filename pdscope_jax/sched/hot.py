"""Hot-expert tables from measured routing (PAPER.md offline step 4): per MoE layer, how often each expert was hit.

Contract: `activation_counts(path, phases=("prefill", "decode")) -> {decoder layer: [E] float64}` reads
- a `layer_stats.json` written by `pdscope-jax collect-traces` (`phaseper.collect.write_stats`), or the directory
  holding one: `phases[phase].expert_counts [M, E]` for the MoE layers listed in `layers`;
- a trace directory (`manifest.json`, `phaseper.traces`): the per-step `counts [S, E]` of every layer, summed;
and adds the requested phases. `write_layer_stats(path, layers, counts_by_phase)` writes counts in the
layer_stats.json layout (only the keys this module reads), so counts the engine recorded
(`OffloadRunner.activation_counts`) can serve as a hot table too. The planners turn counts into the table with
`plan.HotExperts(per_layer, counts)`; the engine preloads it. A file that holds none of the requested phases, or
no counts at all, raises `HotTableError` saying what it found. Files are written atomically and sealed with a
checksum (`integrity`); a sealed file whose content does not match raises `HotTableError` (files without a seal,
from older versions or written by hand, are read as they are).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from pdscope_jax.artifacts import integrity
from pdscope_jax.sched.costs import PHASES

REMEDY = ("make it again: `pdscope-jax collect-traces` writes layer_stats.json, `pdscope-jax bench --hot-table auto` "
          "records a hot table")


class HotTableError(ValueError):
    """A hot-table source that cannot be read as per-layer activation counts."""


def activation_counts(path: str | Path, phases: Sequence[str] = PHASES) -> dict[int, np.ndarray]:
    path = Path(path).expanduser()
    bad = [p for p in phases if p not in PHASES]
    if bad or not phases:
        raise HotTableError(f"phases must be a non-empty subset of {PHASES}, got {list(phases)}")
    if path.is_dir() and (path / "manifest.json").exists():
        return _from_traces(path, phases)
    if path.is_dir():
        path = path / "layer_stats.json"
    if not path.exists():
        raise HotTableError(f"{path}: no such file (want layer_stats.json or a trace directory)")
    stats = integrity.read_json(path, HotTableError, REMEDY)
    integrity.check_seal(stats, HotTableError, path, REMEDY, required=False)
    if not isinstance(stats, dict) or "layers" not in stats or "phases" not in stats:
        raise HotTableError(f"{path}: not a layer_stats.json (needs the keys 'layers' and 'phases')")
    layers = [int(layer) for layer in stats["layers"]]
    found = [p for p in phases if p in stats["phases"]]
    if not found:
        raise HotTableError(f"{path}: holds phases {sorted(stats['phases'])}, none of {list(phases)}")
    total = sum(np.asarray(stats["phases"][p]["expert_counts"], np.float64) for p in found)  # [M, E]
    if total.ndim != 2 or total.shape[0] != len(layers):
        raise HotTableError(f"{path}: expert_counts has shape {total.shape} for {len(layers)} layers")
    return {layer: total[m] for m, layer in enumerate(layers)}


def _from_traces(directory: Path, phases: Sequence[str]) -> dict[int, np.ndarray]:
    from pdscope_jax.phaseper.traces import load_traces

    traces = load_traces(directory)
    out = {layer: np.zeros(traces.num_experts) for layer in traces.layers}
    for phase in phases:
        for layer in traces.layers:
            out[layer] += traces.layer(phase, layer)["counts"].sum(axis=0)
    if not any(c.any() for c in out.values()):
        raise HotTableError(f"{directory}: the traces hold no routed tokens in phases {list(phases)}")
    return out


def write_layer_stats(path: str | Path, layers: Sequence[int],
                      counts_by_phase: Mapping[str, Mapping[int, Sequence[float]]]) -> Path:
    """Save {phase: {layer: [E] counts}} in the layer_stats.json layout that `activation_counts` reads."""
    path = Path(path)
    phases = {}
    for phase, by_layer in counts_by_phase.items():
        counts = [np.asarray(by_layer[layer], np.float64).tolist() for layer in layers]
        phases[phase] = {"expert_counts": counts}
    integrity.remove_stale(path)  # temporaries of a killed earlier save
    integrity.atomic_write_json(path, integrity.seal({"layers": list(layers), "phases": phases}))
    return path
