"""In-situ calibration of the cost table's CPU times: what the planners see as a CPU expert's cost.

Contract: `CpuCalibration(costs)` keeps, per (phase, padded rows of the step), a running mean of each layer's
measured CPU expert time over what `costs` predicted, kept in [1, `CPU_SCALE_MAX`] (absent: 1).
`observe(timing, done)` folds in one layer (`stats.LayerTiming`, `done` = perf_counter when its CPU part was
done); `costs_for(phase, rows)` -> the table with CPU times scaled by that scale rounded to a tenth (the same
object for equal scales; `costs` itself at 1); `clear()` forgets what was learned (a new policy's load is not the
old one's); `as_stats()` -> {"phase rows": scale}.
Why: the table is measured on an idle machine, while a layer's CPU experts run beside copies and the host's own
work. Step sizes keep apart because one factor cannot model a fixed cost per layer: a small step's scale would
make a large step's CPU experts look far too dear.
"""

from __future__ import annotations

from pdscope_jax.engine.stats import LayerTiming
from pdscope_jax.sched import CostTable

CPU_CALIBRATION = 0.25  # weight of one layer's measured / predicted CPU time in its (phase, step size) running scale
CPU_SCALE_MAX = 64.0  # large enough for a long prompt's prefill on a busy host


class CpuCalibration:
    def __init__(self, costs: CostTable):
        self.costs = costs
        self.scale: dict[tuple[str, int], float] = {}  # (phase, padded rows) -> measured / table CPU seconds
        self._scaled: dict[float, CostTable] = {}  # rounded scale -> the table scaled by it

    def costs_for(self, phase: str, rows: int) -> CostTable:
        scale = round(self.scale.get((phase, rows), 1.0), 1)
        if scale <= 1.0:
            return self.costs
        if scale not in self._scaled:
            self._scaled[scale] = self.costs.with_cpu_scale(scale)
        return self._scaled[scale]

    def observe(self, t: LayerTiming, done: float) -> None:
        key = (t.phase, t.step_rows)
        observed = (done - t.cpu_start) / t.cpu_predicted
        scale = (1 - CPU_CALIBRATION) * self.scale.get(key, 1.0) + CPU_CALIBRATION * observed
        self.scale[key] = min(max(scale, 1.0), CPU_SCALE_MAX)

    def clear(self) -> None:
        self.scale.clear()

    def as_stats(self) -> dict[str, float]:
        return {f"{phase} {rows}": scale for (phase, rows), scale in sorted(self.scale.items())}
