"""Pieces shared by the probe scripts of this folder (`benchmarks/probes/probe_*.py`).

A probe run as `python benchmarks/probes/probe_<name>.py` has this folder first on sys.path, hence
`from _common import ...`.
Contract:
- `expert_shape_parser(description, reps, **int_options)` -> an argparse parser with the expert shape (--hidden,
  --intermediate, DeepSeek-V2-Lite's by default), --experts (how many experts per measurement), --reps, --out,
  and one integer option per keyword (`cpu_rows=16` -> `--cpu-rows`, default 16);
- `random_experts(d, f, k)` -> (gate_ups, downs): k seeded random bf16 numpy arrays [D, 2F] and [F, D];
- `expert_setup(args)` -> `ExpertSetup` (a tuple) of the parsed shape: d, f, kmax = max(--experts), kmax random
  experts' gate_ups and downs, and one expert's bytes;
- `many_experts(x, gate_ups, downs)` -> the f32 sum of k experts' FFN over x (jit it; one program for k experts);
- `memory_shardings(accel)` -> (pinned host, device memory) single-device shardings of the accelerator;
- `random_loader(shapes, seed, workload)` -> the engine's `loader(paths, placement)` of seeded random weights,
  rewritten by a routing workload (`pdscope_jax.workloads.routing.design`) when one is given;
- `held(call)` -> (call's result, seconds the caller was held); `issue_and_done(fn, reps)` -> median (issue, done)
  seconds of `fn() -> (result, held seconds)`, the result waited for, after 2 untimed runs;
- `emit(records, record)` prints a record as one JSON line and appends it;
- `probe_result(what, devices, records, out, **extra)` -> the result dict (the command line, the commit,
  accelerator and jax version, then `extra`, e.g. the expert shape, then the records), also written as JSON to
  `out` when given.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from pdscope_jax.models.layers import expert_ffn
from pdscope_jax.artifacts.provenance import source_commit


def expert_shape_parser(description: str, reps: int, **int_options: int) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=1408)
    parser.add_argument("--experts", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--reps", type=int, default=reps)
    parser.add_argument("--out", type=Path, default=None)
    for name, default in int_options.items():
        parser.add_argument("--" + name.replace("_", "-"), type=int, default=default)
    return parser


def random_experts(d: int, f: int, k: int, seed: int = 0) -> tuple[list[np.ndarray], list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    gate_ups = [(rng.standard_normal((d, 2 * f)) * 0.02).astype(jnp.bfloat16) for _ in range(k)]
    downs = [(rng.standard_normal((f, d)) * 0.02).astype(jnp.bfloat16) for _ in range(k)]
    return gate_ups, downs


class ExpertSetup(NamedTuple):
    d: int
    f: int
    kmax: int
    gate_ups: list[np.ndarray]  # kmax x [D, 2F] bf16
    downs: list[np.ndarray]  # kmax x [F, D] bf16
    expert_bytes: int  # one expert's gate_up and down


def expert_setup(args: argparse.Namespace) -> ExpertSetup:
    d, f, kmax = args.hidden, args.intermediate, max(args.experts)
    gate_ups, downs = random_experts(d, f, kmax)
    return ExpertSetup(d, f, kmax, gate_ups, downs, gate_ups[0].nbytes + downs[0].nbytes)


def many_experts(x, gate_ups, downs):
    return sum(expert_ffn(x, gu, dn).astype(jnp.float32) for gu, dn in zip(gate_ups, downs))


def memory_shardings(accel) -> tuple[jax.sharding.Sharding, jax.sharding.Sharding]:
    return (jax.sharding.SingleDeviceSharding(accel, memory_kind="pinned_host"),
            jax.sharding.SingleDeviceSharding(accel, memory_kind="device"))


def random_loader(shapes: dict, seed: int = 0, workload=None):
    from pdscope_jax.weights.random_init import random_state

    def random(paths, placement):
        return random_state({p: shapes[p] for p in paths}, seed, placement)

    return workload.loader(random) if workload is not None else random


def held(call):
    start = time.perf_counter()
    out = call()
    return out, time.perf_counter() - start


def issue_and_done(fn, reps: int, warm: int = 2) -> tuple[float, float]:
    issue, done = [], []
    for rep in range(reps + warm):
        start = time.perf_counter()
        out, held_seconds = fn()
        jax.block_until_ready(out)
        end = time.perf_counter()
        if rep >= warm:
            issue.append(held_seconds)
            done.append(end - start)
        del out
    return statistics.median(issue), statistics.median(done)


def whole_model_parser(description: str) -> argparse.ArgumentParser:
    """The options of a whole-model decode probe: --model, --prompt, --tokens, --repeats, --out."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--model", default="deepseek-v2-lite")
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    return parser


def timed_generations(generate, ids, tokens: int, repeats: int, first: list | None) -> tuple[dict, list]:
    """One warm-up `generate(ids, tokens)` (compiles), then `repeats` timed ones: (a record of decode tok/s median
    and repeats, prefill tok/s median, the last run's greedy tokens and whether they equal `first`'s; the tokens)."""
    generate(ids, tokens)
    runs = [generate(ids, tokens) for _ in range(repeats)]
    got = runs[-1].tokens[0].tolist()
    return {"decode_tok_s": statistics.median(r.decode_tokens_per_s for r in runs),
            "decode_tok_s_repeats": [r.decode_tokens_per_s for r in runs],
            "prefill_tok_s": statistics.median(r.prefill_tokens_per_s for r in runs),
            "same_tokens_as_first": got == (first if first is not None else got), "tokens": got}, got


def emit(records: list[dict], record: dict) -> dict:
    print(json.dumps(record), flush=True)
    records.append(record)
    return record


def probe_result(what: str, devices, records: list[dict], out: Path | None, **extra) -> dict:
    result = {"what": what, "command": "python3 " + " ".join(shlex.quote(a) for a in sys.argv),
              "commit": source_commit(),
              "accelerator": str(devices.accel), "jax": jax.__version__, **extra, "records": records}
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1) + "\n")
    return result


def perfetto_trace(run, out: Path) -> None:
    """`run()` under jax's profiler; its Perfetto trace (the accelerator's kernels beside the host's threads) is moved
    to `out`, the profiler's other files dropped."""
    import glob
    import shutil
    import tempfile

    with tempfile.TemporaryDirectory() as where:
        jax.profiler.start_trace(where, create_perfetto_trace=True)
        try:
            run()
        finally:
            jax.profiler.stop_trace()
        found = glob.glob(f"{where}/**/perfetto_trace.json.gz", recursive=True)
        if found:
            out.parent.mkdir(parents=True, exist_ok=True)
            shutil.move(found[0], out)
