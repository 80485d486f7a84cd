"""trace_summary.summarize on a made-up Perfetto trace: an offloaded prefill's layers start rotary kernels too, and
given the count of decode steps only the decode steps are summarized."""

import gzip
import json

from tests.benchmarks.script_import import BENCHMARKS, import_script


def _trace(path, prefill_layers: int, decode_steps: int):
    """GPU compute events: prefill layers (a rotary kernel and a 100 us matmul each), then decode steps of a rotary
    kernel and two 10 us kernels, 50 us apart."""
    events = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
              {"ph": "M", "name": "thread_name", "pid": 1, "tid": 2, "args": {"name": "Compute stream"}}]
    t = 0.0
    for _ in range(prefill_layers):
        events += [{"ph": "X", "pid": 1, "tid": 2, "ts": t, "dur": 5, "name": "loop_cosine_fusion"},
                   {"ph": "X", "pid": 1, "tid": 2, "ts": t + 10, "dur": 100, "name": "gemm_fusion_dot"}]
        t += 200
    for _ in range(decode_steps):
        events += [{"ph": "X", "pid": 1, "tid": 2, "ts": t, "dur": 5, "name": "loop_cosine_fusion"},
                   {"ph": "X", "pid": 1, "tid": 2, "ts": t + 10, "dur": 10, "name": "gather_matvec"},
                   {"ph": "X", "pid": 1, "tid": 2, "ts": t + 25, "dur": 10, "name": "input_reduce_fusion_3"}]
        t += 50
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)


def test_decode_steps_exclude_prefills_layers(tmp_path):
    summarize = import_script(BENCHMARKS / "probes" / "trace_summary.py").summarize
    path = tmp_path / "t.trace.json.gz"
    _trace(path, prefill_layers=4, decode_steps=6)
    mixed, decode = summarize(path), summarize(path, decode_steps=6)
    assert mixed["steps"] == 9 and decode["steps"] == 5  # whole steps between starts
    assert decode["kernels_per_step"] == 3 and decode["step_ms"] == [0.05] * 5
    assert round(decode["busy_ms_per_step"], 6) == 0.025
    assert "gemm_fusion_dot" not in [k["name"] for k in decode["top_kernels"]]
    assert "gemm_fusion_dot" in [k["name"] for k in mixed["top_kernels"]]
