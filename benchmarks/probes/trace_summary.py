"""Where a traced decode's GPU time goes: a summary of the Perfetto traces `probe_host_experts_engine.py --trace`
writes (jax's profiler: the GPU's kernels and copies, the host's threads).

Per trace: decode steps (a step starts at its first rotary-embedding kernel, `loop_cosine_fusion`; given the
count of decode steps, only the last that many starts count: an offloaded prefill's layers start some too), the
GPU's kernels a step, the span and busy ms a step of its compute stream, idle ms a step split by gap length
(short gaps, 5-40 us, are the GPU waiting for the next launch: the launching thread is behind; long ones, over
0.2 ms, are waits on the host: the bridge's copies and host experts, or the step boundary), the longest gaps with
the kernels around them, and the kernels (and kinds of kernel: numbered fusions as one) taking most time. The
profiler slows the launching thread: compare traces with each other, not with untraced tok/s.
Usage: `python benchmarks/probes/trace_summary.py A.trace.json.gz [B.trace.json.gz ...] [--out F.json] [--top N]`.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import re
from pathlib import Path

import numpy as np

STEP_START = "loop_cosine_fusion"
SHORT = (5.0, 40.0)  # us: a launch gap
LONG = 200.0  # us: a wait


def summarize(path: Path, top: int = 8, decode_steps: int | None = None) -> dict:
    data = json.load(gzip.open(path))
    events = data["traceEvents"] if isinstance(data, dict) else data
    processes = {e["pid"]: e["args"]["name"] for e in events
                 if e.get("ph") == "M" and e.get("name") == "process_name"}
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
               if e.get("ph") == "M" and e.get("name") == "thread_name"}
    compute = sorted((e for e in events if e.get("ph") == "X" and processes.get(e["pid"], "").startswith("/device:GPU")
                      and "Compute" in threads.get((e["pid"], e["tid"]), "")), key=lambda e: e["ts"])
    starts = [e["ts"] for e in compute if e["name"].startswith(STEP_START)]
    if decode_steps is not None:
        starts = starts[-decode_steps:]
    if len(starts) < 2:
        return {"trace": path.name, "steps": 0}
    first = next(i for i, e in enumerate(compute) if e["ts"] >= starts[0])
    last = max(i for i, e in enumerate(compute) if e["ts"] < starts[-1])
    kernels = compute[first:last + 1]  # whole steps only
    steps = len(starts) - 1
    gaps, end = [], kernels[0]["ts"] + kernels[0]["dur"]
    for before, after in zip(kernels, kernels[1:]):
        end = max(end, before["ts"] + before["dur"])
        gaps.append((after["ts"] - end, before["name"], after["name"]))
    lengths = np.array([g for g, *_ in gaps])
    totals: dict[str, list] = collections.defaultdict(lambda: [0, 0.0])
    for e in kernels:
        totals[e["name"]][0] += 1
        totals[e["name"]][1] += e["dur"]
    kinds: dict[str, list] = collections.defaultdict(lambda: [0, 0.0])
    for name, (n, us) in totals.items():  # fusions numbered apart (`loop_add_fusion_12`) as one kind
        kind = kinds[re.sub(r"([._]\d+)+$", "", name)]
        kind[0] += n
        kind[1] += us
    per_step = 1e-3 / steps  # us in all -> ms a step
    return {"trace": path.name, "steps": steps, "kernels_per_step": len(kernels) / steps,
            "step_ms": [round((b - a) / 1e3, 3) for a, b in zip(starts, starts[1:])],
            "busy_ms_per_step": sum(e["dur"] for e in kernels) * per_step,
            "launch_gap_ms_per_step": float(lengths[(lengths >= SHORT[0]) & (lengths < SHORT[1])].sum()) * per_step,
            "wait_ms_per_step": float(lengths[lengths >= LONG].sum()) * per_step,
            "idle_ms_per_step": float(lengths[lengths > 0].sum()) * per_step,
            "longest_gaps": [{"ms": round(g / 1e3, 3), "after": a, "before": b}
                             for g, a, b in sorted(gaps, reverse=True)[:top]],
            "top_kernels": [{"name": name, "calls_per_step": n / steps, "ms_per_step": us * per_step}
                            for name, (n, us) in sorted(totals.items(), key=lambda kv: -kv[1][1])[:top]],
            "top_kernel_kinds": [{"kind": name, "calls_per_step": n / steps, "ms_per_step": us * per_step}
                                 for name, (n, us) in sorted(kinds.items(), key=lambda kv: -kv[1][1])[:top]]}


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("traces", nargs="+", type=Path)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--top", type=int, default=8, help="gaps, kernels and kernel kinds kept")
    args = p.parse_args(argv)
    out = [summarize(path, args.top) for path in args.traces]
    for s in out:
        print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in s.items()
                          if k not in ("longest_gaps", "top_kernels", "top_kernel_kinds")}))
    if args.out is not None:
        args.out.write_text(json.dumps(out, indent=1) + "\n")
    return out


if __name__ == "__main__":
    main()
