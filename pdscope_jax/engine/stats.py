"""What the offload engine counts: per-phase statistics, and the timing of one MoE layer until its step settles.

Contract: `PhaseStats` accumulates one phase's figures (wall time, CPU / GPU expert compute, transfer and
exposed transfer seconds summed over layers, bytes moved, hits, prefetch use, planner time, the next-layer
prediction's hits, copies and GPU experts by precision) and derives hit rate, prefetch accuracy, prediction
recall, tokens/s and planner ms per layer (`to_dict` for JSON). `prediction_hits(scores, activated)` scores one
prediction; `count_copies` adds copies. A `LayerTiming` is made when a layer's work has been dispatched; at
the end of the step, once the helper threads have stamped when each part was done, `settle_into(stats, done)`
adds it. Nothing here touches a device.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
from typing import Any

import numpy as np


@dataclasses.dataclass
class PhaseStats:
    steps: int = 0
    tokens: int = 0
    seconds: float = 0.0  # wall time of the steps
    generate_seconds: float = 0.0  # wall time of the phase as `generate` times it: the steps, the cache's creation
    # and the first token's sampling (prefill), the decode loop; what tokens/s figures are divided by
    cpu_seconds: float = 0.0  # CPU expert compute, dispatch to done, summed over layers
    gpu_seconds: float = 0.0  # GPU expert compute, dispatch to done
    transfer_seconds: float = 0.0  # on-demand loads (issue to done) + prefetch/stream (issue to done)
    exposed_transfer_seconds: float = 0.0  # transfer time nothing else was running to hide
    bytes_moved: int = 0
    experts_loaded_now: int = 0
    experts_prefetched: int = 0  # prefetched or streamed
    experts_placed: int = 0  # device decode that copies nothing: experts copied into the decode bank as it opened
    experts_loaded_low: int = 0  # of the loaded, prefetched and streamed experts: those copied from the int4 copy
    bytes_moved_low: int = 0  # ... their bytes (part of bytes_moved)
    gpu_experts_low: int = 0  # GPU expert computations from a slot holding an int4 copy (part of gpu_experts)
    activated: int = 0  # (layer, expert) activations seen by the planner
    hits: int = 0  # ... of them resident (or in flight) when routed
    prefetch_used: int = 0  # prefetched experts activated when their layer routed
    gpu_experts: int = 0
    cpu_experts: int = 0
    planner_seconds: float = 0.0  # time inside the planner's `plan`, summed over layers
    planner_calls: int = 0  # layers planned
    handoff_seconds: float = 0.0  # decode on the accelerator: waiting, before its first step, for the work that
    # prefill left queued on the accelerator (in `generate_seconds`, not in `seconds`)
    device_steps: int = 0  # steps run as one accelerator program (engine.device_decode): in `seconds`, hits,
    # bytes and gpu_experts, but in none of the CPU / GPU / transfer time splits, which such a step does not measure
    predicted_hits: int = 0  # next-layer experts both predicted and activated (`prediction_hits`), summed over the
    # (step, layer) pairs whose planner had next-layer scores; device decode steps add theirs where they copy ahead
    predicted_total: int = 0  # ... and the experts those next layers activated
    accelerator_moves: int = 0  # several accelerators: experts `sched.across.balance` moved between CPU and GPU

    @property
    def planner_ms_per_layer(self) -> float | None:
        return 1e3 * self.planner_seconds / self.planner_calls if self.planner_calls else None

    @property
    def hit_rate(self) -> float | None:
        return self.hits / self.activated if self.activated else None

    @property
    def prefetch_accuracy(self) -> float | None:
        return self.prefetch_used / self.experts_prefetched if self.experts_prefetched else None

    @property
    def prediction_recall(self) -> float | None:
        """Pooled recall@k of the next-layer scores the planner saw (`prediction_hits`); None where no planner
        had scores in this phase (no predictor, or device decode without copies ahead)."""
        return self.predicted_hits / self.predicted_total if self.predicted_total else None

    @property
    def tokens_per_s(self) -> float | None:
        return self.tokens / self.seconds if self.seconds else None

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out.update(hit_rate=self.hit_rate, prefetch_accuracy=self.prefetch_accuracy, tokens_per_s=self.tokens_per_s,
                   planner_ms_per_layer=self.planner_ms_per_layer, prediction_recall=self.prediction_recall)
        return out


def count_copies(stats: PhaseStats, store, layer: int, experts: np.ndarray, low: np.ndarray, nbytes: int) -> None:
    """Add copies of `experts` of `layer` (from the int4 copy where `low` [n]), `nbytes` in all, to `stats`;
    `store` (an `ExpertStore`) tells the int4 copies' bytes."""
    stats.bytes_moved += nbytes
    if low.any():
        stats.experts_loaded_low += int(low.sum())
        stats.bytes_moved_low += store.expert_nbytes(layer, experts[low], low[low])


def prediction_hits(scores: np.ndarray, activated: np.ndarray) -> tuple[int, int]:
    """(hits, k) of one step's next-layer prediction: `scores` [E] the predicted activation scores of a MoE layer
    (made at the layer before), `activated` the ids of the distinct experts that layer then activated on the
    step's real tokens, k = their number, hits = |top-k(scores) ∩ activated| (ties in scores by lower id).

    Recall@k is hits / k. For one token per step (decode at batch 1) k is the model's top-k and this is
    `phaseper.train.recall_at_k` of that token (`benchmarks/eval_predictors.py`'s metric); with more tokens it is
    the recall of the step's set of activated experts from the scores the planner saw (averaged over the step's
    tokens), which rises towards 1 as a step activates most experts."""
    k = int(activated.size)
    if k == 0:
        return 0, 0
    top = np.argsort(-np.asarray(scores, np.float64), kind="stable")[:k]
    return int(np.isin(top, activated).sum()), k


@dataclasses.dataclass
class LayerTiming:
    """One layer's statistics waiting for the end of its step: its expert counts, when its parts started and
    ended, and in `ready` helper-thread futures of the parts still running when it was made ("gpu", "load",
    "transfer", "cpu" -> perf_counter when done)."""

    layer: int
    phase: str
    gpu_experts: int
    cpu_experts: int
    start: float  # perf_counter when the layer's on-demand loads were issued
    dispatched: float  # ... when its GPU experts were dispatched
    cpu_start: float  # ... when its CPU experts were dispatched to the CPU backend
    cpu_end: float | None  # ... when they were done (None: none ran)
    loads_end: float | None  # ... when the loads were done, where they were waited for (synchronous I/O)
    ready: dict[str, concurrent.futures.Future]
    cpu_predicted: float = 0.0  # the cost table's seconds for its CPU experts (the engine calibrates against it)
    step_rows: int = 0  # padded rows of its step (the calibration keeps one scale per phase and step size)

    def settle_into(self, stats: PhaseStats, done: dict[str, float]) -> None:
        """Add this layer to `stats`, `done` holding its `ready` futures' results. Loads are exposed where the
        CPU experts were not running; next-layer transfers where they outlast this layer's compute."""
        load_end = done.get("load", self.loads_end if self.loads_end is not None else self.start)
        cpu_end = self.cpu_end if self.cpu_end is not None else self.cpu_start
        gpu_start = max(self.dispatched, load_end)  # the GPU experts wait for the loads
        gpu_end = done.get("gpu", gpu_start)
        stats.gpu_seconds += max(0.0, gpu_end - gpu_start)
        stats.cpu_seconds += cpu_end - self.cpu_start
        stats.gpu_experts += self.gpu_experts
        stats.cpu_experts += self.cpu_experts
        stats.transfer_seconds += load_end - self.start
        covered = max(0.0, min(load_end, cpu_end) - max(self.start, self.cpu_start))  # loads under CPU compute
        exposed = load_end - self.start - covered
        if "transfer" in done:
            stats.transfer_seconds += done["transfer"] - self.dispatched
            exposed += max(0.0, done["transfer"] - max(gpu_end, cpu_end))
        stats.exposed_transfer_seconds += exposed
