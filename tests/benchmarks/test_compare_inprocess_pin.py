"""benchmarks/compare_trees_inprocess.py --pin-cpu-scale and --new-tree: both calibration layouts held at S (the
planners see CPU times times S, nothing measured moves it) and a tree with neither refused. A whole run with the pin:
test_compare_inprocess.py."""

import dataclasses
from pathlib import Path
from types import SimpleNamespace

import pytest

from pdscope_jax.engine.calibration import CpuCalibration

REPO = Path(__file__).resolve().parents[2]
CPU_SECONDS = (1e-3, 3e-3)
WANT = tuple(v * 2.5 for v in CPU_SECONDS)  # the table's CPU times at the pin 2.5


@dataclasses.dataclass(frozen=True)
class _Table:  # the part of sched.CostTable the calibration uses
    cpu_expert_seconds: tuple[float, ...]

    def with_cpu_scale(self, factor):
        return _Table(tuple(v * factor for v in self.cpu_expert_seconds))


class _OldRunner:  # offload.engine.OffloadRunner's calibration, as in c2fbd38
    def __init__(self):
        self.costs = _Table(CPU_SECONDS)
        self._cpu_scale, self._scaled_costs = {}, {}

    def _planner_costs(self, phase, rows):
        scale = round(self._cpu_scale.get((phase, rows), 1.0), 1)
        return self.costs if scale <= 1.0 else self._scaled_costs.setdefault(scale, self.costs.with_cpu_scale(scale))

    def _calibrate_cpu(self, t, done):
        self._cpu_scale[(t.phase, t.step_rows)] = 7.0

    @property
    def stats(self):
        return {"cpu_cost_scale": {f"{p} {r}": s for (p, r), s in sorted(self._cpu_scale.items())}}


def test_both_layouts_are_held_at_the_pin_and_a_tree_with_neither_is_refused(load_script):
    script = load_script("compare_trees_inprocess")
    timing = SimpleNamespace(phase="decode", step_rows=1, cpu_start=0.0, cpu_predicted=1e-3)
    new = SimpleNamespace(_calibration=CpuCalibration(_Table(CPU_SECONDS)))
    old = _OldRunner()
    assert script.pin_cpu_scale(new, 2.5) == "engine.calibration.CpuCalibration"
    assert script.pin_cpu_scale(old, 2.5) == "offload.engine.OffloadRunner._cpu_scale"
    assert script.reported_scales(new) == script.reported_scales(old) == {}  # the pin's own check left no key
    new._calibration.observe(timing, 1.0)  # measured 1,000 times the table: ignored
    old._calibrate_cpu(timing, 1.0)
    for lookup in (new._calibration.costs_for, old._planner_costs):
        assert lookup("decode", 1).cpu_expert_seconds == WANT
        assert lookup("prefill", 128).cpu_expert_seconds == WANT
    new._calibration.clear()  # a policy switch: the pin stays
    assert new._calibration.costs_for("prefill", 512).cpu_expert_seconds == WANT
    assert script.reported_scales(new) == {"prefill 512": 2.5}
    assert script.reported_scales(old) == {"decode 1": 2.5, "prefill 128": 2.5}
    script.check_pinned({"old": script.reported_scales(old), "new": script.reported_scales(new)}, 2.5)
    with pytest.raises(SystemExit, match="reports no scale"):
        script.check_pinned({"old": {}, "new": {"prefill 16": 2.5}}, 2.5)
    with pytest.raises(SystemExit, match="reports"):
        script.check_pinned({"old": {"prefill 16": 2.4}}, 2.5)
    with pytest.raises(SystemExit, match="cannot be pinned"):
        script.pin_cpu_scale(SimpleNamespace(costs=_Table((1e-3,))), 2.0)


def test_pin_must_be_a_tenth_at_least_one(load_script, capsys):
    script = load_script("compare_trees_inprocess")
    for bad in ("0.5", "2.05"):
        with pytest.raises(SystemExit):
            script.main(["--old-tree", str(REPO), "--pin-cpu-scale", bad])
        assert "--pin-cpu-scale" in capsys.readouterr().err


def test_a_tree_that_would_not_fit_the_host_stops_the_run_before_loading(load_script, monkeypatch):
    script = load_script("compare_trees_inprocess")
    monkeypatch.setattr(script.psutil, "virtual_memory", lambda: SimpleNamespace(available=10 * 10**9))
    script.check_host_memory("old", None)  # the first tree: nothing measured to compare with
    script.check_host_memory("new", 9 * 10**9)
    with pytest.raises(SystemExit, match=r"control tree needs about 12\.0 GB .* 10\.0 GB is available"):
        script.check_host_memory("control", 12 * 10**9)
