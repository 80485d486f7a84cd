"""The stage timeline: intervals between a layer's stages, done-stamps from the layer's start, layer wall time."""

import pytest

from pdscope_jax.engine.timeline import Timeline


def test_summary_takes_medians_of_intervals_per_phase():
    timeline = Timeline()
    for step, base in enumerate((0.0, 1.0, 2.0)):
        for layer, offset in ((1, 0.0), (2, 0.4)):
            t = base + offset
            timeline.mark("decode", "layer_start", layer, t)
            timeline.mark("decode", "routed", layer, t + 0.1 + 0.01 * step)  # 100, 110, 120 ms: median 110
            timeline.mark("decode", "planned", layer, t + 0.15 + 0.01 * step)
            timeline.mark("decode", "combined", layer, t + 0.3)
        timeline.mark("decode", "gpu_done", 1, base + 0.35)  # settled at the step's end
    timeline.mark("prefill", "layer_start", 1, 5.0)
    timeline.mark("prefill", "routed", 1, 5.5)
    summary = timeline.summary()
    decode = summary["decode"]
    assert decode["layer_start -> routed"] == pytest.approx(110.0)
    assert decode["routed -> planned"] == pytest.approx(50.0)
    assert decode["planned -> combined"] == pytest.approx(140.0)
    assert decode["layer_start -> gpu_done"] == pytest.approx(350.0)
    assert decode["layer"] == pytest.approx(400.0)  # 400, 600, 400, 600, 400 ms between layer starts
    assert decode["layer_mean"] == pytest.approx(480.0)
    assert decode["layers"] == 6
    assert summary["prefill"] == {"layer_start -> routed": pytest.approx(500.0), "layers": 1}


def test_unknown_event_is_refused():
    with pytest.raises(ValueError, match="unknown timeline event 'nap'"):
        Timeline().mark("decode", "nap", 1, 0.0)
