"""Where a decode layer's host time goes in the engine, and what the engine's helper threads cost it.

Builds the offloaded model once (a preset with seeded random weights, `--workload`, the bench's budget), records
a hot table from one on-demand generation over another prompt, then for each policy and variant runs one
warm-up generation and `--repeats` generations of `--tokens` new tokens. It reports the median decode ms per
step and per MoE layer and the stage timeline (`offload.timeline`) of one more generation. The variants change
only how the engine's helper threads run:
  engine     as shipped;
  no_stamps  the waiter threads that stamp when each part is done are not used: those stamps all read "at
             once" (the step's time split is meaningless; its wall time is not);
  inline     no helper thread at all: staged copies are issued on the main thread too (and no stamps);
  switch_S   as shipped, under `sys.setswitchinterval(S)` (how long a thread waiting for the GIL waits before
             it asks for it; 0.005 s by default).
Run from the repository root: `PYTHONPATH=. python benchmarks/probes/probe_decode_host.py --out FILE`.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

VARIANTS = ("engine", "no_stamps", "inline")


class _Inline:
    """Runs what is submitted at once, on the caller's thread (an executor without threads)."""

    def submit(self, fn, *args):
        future = concurrent.futures.Future()
        future.set_result(fn(*args))
        return future


class _NoStamp:
    """Stands in for the engine's waiter pool: every part reads as done at submission, nothing waits."""

    def submit(self, fn, *args):
        future = concurrent.futures.Future()
        future.set_result(time.perf_counter())
        return future


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="deepseek-v2-lite")
    p.add_argument("--policies", nargs="+", default=["ondemand", "pdscope"])
    p.add_argument("--variants", nargs="+", default=[*VARIANTS, "switch_0.0005"])
    p.add_argument("--workload", default="skewed", choices=["uniform", "skewed"])
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--gpu-memory", default="24GB")
    p.add_argument("--expert-pool", default="8GB")
    p.add_argument("--cost-table", default=None)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--out", type=Path, default=None)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    from pdscope_jax.runtime import request_cpu_stand_in

    request_cpu_stand_in()
    import jax.numpy as jnp
    import numpy as np

    from pdscope_jax import models
    from pdscope_jax.workloads import routing as workloads
    from pdscope_jax.api import resolve
    from pdscope_jax.bench.runs import weights_loader as _loader
    from pdscope_jax.engine.runner import OffloadRunner
    from pdscope_jax.engine.timeline import Timeline
    from _common import probe_result
    from pdscope_jax.runtime import RuntimeConfig
    from pdscope_jax.sched.hot import write_layer_stats

    cfg, _ = resolve(args.model)
    dtype = jnp.dtype(args.dtype)
    shapes = models.abstract_state(cfg, dtype)
    loader = _loader(cfg, None, shapes, 0, workloads.design(cfg, args.workload, seed=0))
    rc = RuntimeConfig(gpu_memory=args.gpu_memory, expert_pool=args.expert_pool, policy="ondemand",
                       max_seq_len=args.prompt_len + args.tokens + 1, cost_table=args.cost_table,
                       device_decode=False)  # the host-driven decode is what this probe takes apart
    runner = OffloadRunner(models.abstract_model(cfg, dtype), rc, loader)
    rng = np.random.default_rng(0)
    prompt, other = (rng.integers(0, cfg.vocab_size, (1, args.prompt_len)).astype(np.int32) for _ in range(2))
    runner.generate(other, args.tokens)
    hot = write_layer_stats(Path(tempfile.mkdtemp()) / "hot.json", cfg.moe_layers, runner.activation_counts)
    moe_layers = len(cfg.moe_layers)
    waiter, stager, switch = runner._waiter, runner._stager, sys.getswitchinterval()
    records = []
    for policy in args.policies:
        runner.set_policy(policy, hot_table=str(hot))
        runner.warmup(1, args.prompt_len, args.tokens)
        for variant in args.variants:
            runner._waiter = _NoStamp() if variant in ("no_stamps", "inline") else waiter
            runner._stager = _Inline() if variant == "inline" else stager
            sys.setswitchinterval(float(variant.split("_", 1)[1]) if variant.startswith("switch_") else switch)
            runner.generate(prompt, args.tokens)
            steps = []
            for _ in range(args.repeats):
                out = runner.generate(prompt, args.tokens)
                steps.append(out.decode_seconds / (args.tokens - 1))
            runner.timeline = Timeline()
            runner.generate(prompt, args.tokens)
            timeline, runner.timeline = runner.timeline.summary(), None
            step_ms = 1e3 * statistics.median(steps)
            record = {"policy": policy, "variant": variant, "decode_ms_per_step": step_ms,
                      "decode_ms_per_moe_layer": step_ms / moe_layers, "decode_tok_s": 1e3 / step_ms,
                      "steps_ms": [1e3 * s for s in steps], "timeline_ms": timeline["decode"]}
            print(json.dumps({k: v for k, v in record.items() if k != "timeline_ms"}), flush=True)
            records.append(record)
    runner._waiter, runner._stager = waiter, stager
    sys.setswitchinterval(switch)
    return probe_result("decode host time per variant of the engine's helper threads (random weights)",
                        runner.devices, records, args.out, model=cfg.name, weights="random",
                        workload=args.workload, prompt_len=args.prompt_len, tokens=args.tokens,
                        budget={"gpu_memory": args.gpu_memory, "expert_pool": args.expert_pool})


if __name__ == "__main__":
    main()
