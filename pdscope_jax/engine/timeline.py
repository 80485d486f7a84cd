"""Where a step's host time goes: timestamps of the engine's stages per MoE layer, and their medians.

Contract: while `OffloadRunner.timeline` is a `Timeline`, the engine calls `mark(phase, event, layer, at=None)` at
each stage of a MoE layer, in the order it does them on the host (`LAYER_EVENTS`), and, when the step settles,
with `at` = when each part that ran on another thread or device was done (`DONE_EVENTS`: perf_counter stamps
taken by helper threads). `summary()` -> {phase: {"a -> b": median ms, ..., "layer_start -> x_done":
median ms, "layer": median ms from one layer's layer_start to the next's, "layer_mean": their mean (a median
hides slow layers), "layers": count}}: the host intervals between consecutive stages present in a layer, the
done-stamps as offsets from the layer's start, and the layer's wall time. Recording costs a list append per
stage; the engine records nothing when it is None.
`StageClock()` times a one-off piece of work by stages (building the engine): `lap(name)` records the wall seconds
since the clock started or the last lap under `name`; `seconds` {name: s} keeps them in order.
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict

LAYER_EVENTS = ("layer_start", "route_dispatched", "scores_dispatched", "routed", "planned", "cpu_submitted",
                "loads_issued", "next_issued", "gpu_dispatched", "cpu_joined", "combined")
DONE_EVENTS = ("cpu_done", "load_done", "gpu_done", "transfer_done")


class Timeline:
    def __init__(self):
        self._layers: list[tuple[str, int, dict[str, float]]] = []  # (phase, layer, event -> time), in order
        self._open: dict[int, dict[str, float]] = {}  # layer -> its latest record (done-stamps land there)

    def mark(self, phase: str, event: str, layer: int, at: float) -> None:
        if event not in LAYER_EVENTS and event not in DONE_EVENTS:
            raise ValueError(f"unknown timeline event {event!r}")
        if event == LAYER_EVENTS[0]:
            self._open[layer] = {}
            self._layers.append((phase, layer, self._open[layer]))
        self._open[layer][event] = at

    def summary(self) -> dict[str, dict[str, float]]:
        intervals: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
        for index, (phase, _, times) in enumerate(self._layers):
            out = intervals[phase]
            seen = [e for e in LAYER_EVENTS if e in times]
            for a, b in zip(seen, seen[1:]):
                out[f"{a} -> {b}"].append(times[b] - times[a])
            start = times[LAYER_EVENTS[0]]
            for e in DONE_EVENTS:
                if e in times:
                    out[f"{LAYER_EVENTS[0]} -> {e}"].append(times[e] - start)
            if index + 1 < len(self._layers) and self._layers[index + 1][0] == phase:
                out["layer"].append(self._layers[index + 1][2][LAYER_EVENTS[0]] - start)
        return {phase: {**{name: 1e3 * statistics.median(values) for name, values in out.items()},
                        **({"layer_mean": 1e3 * statistics.fmean(out["layer"])} if out.get("layer") else {}),
                        "layers": sum(1 for p, _, _ in self._layers if p == phase)}
                for phase, out in intervals.items()}


class StageClock:
    def __init__(self):
        self.seconds: dict[str, float] = {}
        self._last = time.perf_counter()

    def lap(self, stage: str) -> None:
        now = time.perf_counter()
        self.seconds[stage] = self.seconds.get(stage, 0.0) + now - self._last
        self._last = now
