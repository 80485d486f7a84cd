"""Cold against warm start of `pdscope-jax generate`: the persistent compilation cache measured.

Each case runs `pdscope-jax generate` in fresh processes that share one new, empty compilation cache directory and
one new, empty C++ kernel cache (`PDSCOPE_KERNEL_CACHE`), as after an install: the first process compiles and builds
everything (cold), the next `--warm` ones read them (warm). Per process it records the wall time from launch to
exit, the seconds XLA spent compiling, and the compilation cache's hits and misses (jax's monitoring events), the
seconds of loading (by the engine's build stages) and of generating as generate prints them; per case the cache's
size on disk and cold / median warm. Cases:
- `tiny`: tiny-deepseek-v2-lite, whole, float32 (any machine); `tiny-offloaded`: the same under `pdscope`
  with a slot pool of one expert (of 24);
- `deepseek-offloaded`: DeepSeek-V2-Lite with random weights under `pdscope`, 24 GB GPU budget, 8 GB expert pool
  (a GPU machine: about 30 GB of pinned host memory).
Writes JSON (command, commit, machine, per case the processes) to `--out`.

    python3 benchmarks/start_times.py --cases tiny tiny-offloaded --out docs/fragments/faststart_start_times.json
    python3 benchmarks/start_times.py --cases tiny deepseek-offloaded --out benchmarks/results/start_times_h200.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _shared import REPO, commit, machine

COMMON = ["--ids", "1,2,3,4,5,6,7,8", "--new-tokens", "16"]
CASES = {
    "tiny": ["tiny-deepseek-v2-lite", "--dtype", "float32", *COMMON],
    "tiny-offloaded": ["tiny-deepseek-v2-lite", "--dtype", "float32", "--policy", "pdscope", "--gpu-memory", "1GB",
                       "--expert-pool", "40KB", *COMMON],
    "deepseek-offloaded": ["deepseek-v2-lite", "--weights", "random", "--policy", "pdscope", "--gpu-memory", "24GB",
                           "--expert-pool", "8GB", "--max-seq-len", "512", *COMMON],
}
# Runs in each process: the CLI's generate, with jax's compilation events counted.
CHILD = """
import json, sys
from jax import monitoring
counts, seconds = {}, {}
monitoring.register_event_listener(lambda name, **kw: counts.__setitem__(name, counts.get(name, 0) + 1))
monitoring.register_event_duration_secs_listener(
    lambda name, secs, **kw: seconds.__setitem__(name, seconds.get(name, 0.0) + secs))
from pdscope_jax.cli.main import end_process, main
status = main(["generate", *sys.argv[1:]])
print("@@" + json.dumps({"status": status, "counts": counts, "seconds": seconds}))
end_process(status)  # as the console script ends
"""


def run_process(argv: list[str], env: dict) -> dict:
    """One `generate` process: wall seconds, compile seconds, cache hits / misses, its printed lines."""
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", CHILD, *argv], env=env, capture_output=True, text=True)
    wall = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"generate {' '.join(argv)} failed ({done.returncode}):\n{done.stderr[-4000:]}")
    lines = done.stdout.strip().splitlines()
    report = json.loads(lines[-1][2:])
    counts, seconds = report["counts"], report["seconds"]
    return {"wall_s": round(wall, 3),
            "compile_s": round(seconds.get("/jax/core/compile/backend_compile_duration", 0.0), 3),
            "cache_hits": counts.get("/jax/compilation_cache/cache_hits", 0),
            "cache_misses": counts.get("/jax/compilation_cache/cache_misses", 0),
            **load_stages(lines[:-1]), "output": lines[:-1]}


def load_stages(lines: list[str]) -> dict:
    """generate's last line, "load 80.6 s (budget 2.1 s, ...), generate 3.1 s (compilation included)", as
    {"load_s", "load_stages_s": {stage: s}, "generate_s"}; {} when it is not there."""
    found = re.fullmatch(r"load ([\d.]+) s(?: \((.*)\))?, generate ([\d.]+) s .*", lines[-1] if lines else "")
    if not found:
        return {}
    parts = filter(None, (found[2] or "").split(", "))
    stages = dict(re.fullmatch(r"(.+) ([\d.]+) s", part).groups() for part in parts)
    return {"load_s": float(found[1]), "load_stages_s": {k: float(v) for k, v in stages.items()},
            "generate_s": float(found[3])}


def run_case(name: str, warm: int) -> dict:
    cache = Path(tempfile.mkdtemp(prefix=f"pdscope_cc_{name}_"))
    kernels = Path(tempfile.mkdtemp(prefix=f"pdscope_kernels_{name}_"))  # a first start builds the C++ kernels too
    env = {**os.environ, "PDSCOPE_JAX_COMPILE_CACHE": str(cache), "PDSCOPE_KERNEL_CACHE": str(kernels),
           "PYTHONPATH": str(REPO)}
    env.pop("JAX_COMPILATION_CACHE_DIR", None)  # the fresh directory above, not one configured elsewhere
    try:
        processes = [run_process(CASES[name], env) for _ in range(1 + warm)]
        cache_bytes = sum(p.stat().st_size for p in cache.rglob("*") if p.is_file())
    finally:
        shutil.rmtree(cache, ignore_errors=True)
        shutil.rmtree(kernels, ignore_errors=True)
    cold, warm_runs = processes[0], processes[1:]
    warm_wall = statistics.median(p["wall_s"] for p in warm_runs)
    return {"case": name, "argv": ["pdscope-jax", "generate", *CASES[name]], "cold": cold, "warm": warm_runs,
            "cold_s": cold["wall_s"], "warm_median_s": warm_wall,
            "cold_over_warm": round(cold["wall_s"] / warm_wall, 2),
            "same_output": all(p["output"][0] == cold["output"][0] for p in warm_runs), "cache_bytes": cache_bytes}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", default=["tiny"], choices=sorted(CASES))
    parser.add_argument("--warm", type=int, default=2, help="warm processes after the cold one")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    if args.warm < 1:
        parser.error("--warm must be >= 1")
    results = {"what": "cold vs warm start of `pdscope-jax generate` (persistent compilation and kernel caches, "
                       "both new and empty for the cold process)",
               "command": "python3 benchmarks/start_times.py " + " ".join(argv if argv is not None else sys.argv[1:]),
               "commit": commit(), "machine": machine(), "cases": []}
    for name in args.cases:
        case = run_case(name, args.warm)
        results["cases"].append(case)
        print(f"{name}: cold {case['cold_s']:.1f} s ({case['cold']['cache_misses']} programs compiled), warm "
              f"{case['warm_median_s']:.1f} s ({case['warm'][0]['cache_hits']} read from the cache, "
              f"{case['warm'][0]['cache_misses']} compiled): {case['cold_over_warm']}x", flush=True)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1) + "\n")  # after every case: a cut-short run keeps some
    return 0


if __name__ == "__main__":
    sys.exit(main())
