"""Where an offloaded decode step's GPU time goes: one policy's `generate` traced by jax's profiler.

Loads `--model` with seeded random weights once (as drawn, or rewritten by bench's `--workload`), at `--gpu-memory`
/ `--expert-pool` (`none`: no cap, as `bench` runs; `--quantize` for int8 / int4 experts), and for each `--policy`
label (bench's: a planner name with its engine suffixes, `pdscope:progcopy:nocpu`; several switch the loaded engine
in turn; a bare `plain` loads the whole model, no budget) runs the bench's warm-up (`OffloadRunner.warmup`: every
program routing may need compiled, the CPU calibration learned from the table, which each label starts from anew),
one warm-up `generate` of `--tokens` new tokens after a `--prompt`-token prompt, `--repeats` timed ones (the record
counts the programs they compiled: 0 when the warm-ups did their job), then one more under jax's profiler where
`--trace DIR` is given. Its Perfetto trace goes to
`DIR/` (`LABEL[_QUANT].trace.json.gz`, `:` and `=` as `_`) and its summary (`trace_summary.summarize`)
into the record, beside the decode tok/s of the timed runs, both phases' statistics (hit rate, bytes, host experts,
the CPU cost calibration) and whether its greedy tokens equal the first label's. The profiler slows the launching
thread: compare traces with each other, not with untraced tok/s. `--layers N` keeps the first N decoder layers
(with `--workload`).
Run from the repository root: `PYTHONPATH=. python benchmarks/probes/probe_offload_trace.py [--trace DIR] [--out F]`.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
from pathlib import Path

import jax
import numpy as np

import pdscope_jax
from pdscope_jax.bench.runs import engine_switches, plan_runs
from _common import emit, perfetto_trace, probe_result, timed_generations, whole_model_parser
from trace_summary import summarize


def main(argv: list[str] | None = None) -> dict:
    parser = whole_model_parser(__doc__.splitlines()[0])
    parser.add_argument("--policy", nargs="+", default=["pdscope"],
                        help="run labels (bench's policy names with suffixes), or 'plain' alone for the whole model")
    parser.add_argument("--quantize", default=None, choices=[None, "int8", "int4"])
    parser.add_argument("--gpu-memory", default="24GB")
    parser.add_argument("--expert-pool", default="8GB",
                        help="a cap on the slot pool, or 'none': what the budget leaves (bench's default)")
    parser.add_argument("--workload", default=None, choices=[None, "uniform", "skewed"],
                        help="bench's routing rewrite of the random weights (default: the weights as drawn, as "
                             "`pdscope_jax.load` gives them)")
    parser.add_argument("--max-seq-len", type=int, default=4096,
                        help="the engine's (with --workload; bench sizes it to its longest prompt plus new tokens)")
    parser.add_argument("--layers", type=int, default=None,
                        help="keep the model's first N decoder layers (with --workload): a smaller stand-in that "
                             "builds faster and runs the same per-layer step")
    parser.add_argument("--trace", type=Path, default=None, help="the traces' folder (none: no traced run)")
    parser.add_argument("--top", type=int, default=30, help="kernel kinds kept in the summary")
    args = parser.parse_args(argv)
    if args.expert_pool.lower() == "none":
        args.expert_pool = None

    runs = plan_runs(argparse.Namespace(ablation=False, policies=args.policy, hot_table=None, quality=None,
                                        mixed_threshold=None))
    if runs[0]["policy"] == "plain":
        if len(runs) > 1:
            parser.error("'plain' loads the whole model: give it alone")
        runner = pdscope_jax.load(args.model, weights="random", quantize=args.quantize)
    elif args.workload is not None:
        runner = argparse.Namespace(engine=_bench_engine(args, runs[0]["policy"]))
        runner.generate, runner.config = runner.engine.generate, runner.engine.config
    else:
        runner = pdscope_jax.load(args.model, weights="random", quantize=args.quantize, policy=runs[0]["policy"],
                                  gpu_memory=args.gpu_memory, expert_pool=args.expert_pool)
    ids = np.random.default_rng(0).integers(0, min(1000, runner.config.vocab_size), (1, args.prompt), dtype=np.int32)
    records, first = [], None
    for run in runs:
        label = run["label"]
        if run["policy"] != "plain":  # every switch set, so a run inherits none from the one before
            runner.engine.set_policy(run["policy"], **engine_switches(run, None))
            runner.engine.reset_calibration()  # every label starts from the cost table, as a new process does
            runner.engine.warmup(1, args.prompt, args.tokens)  # as the bench: no compile in the timed runs
        compiled = runner.engine.compiled_programs["total"] if hasattr(runner, "engine") else None
        record, got = timed_generations(runner.generate, ids, args.tokens, args.repeats, first)
        if compiled is not None:  # the warm-up generate and the timed runs
            record["compiled_while_timed"] = runner.engine.compiled_programs["total"] - compiled
        first = got if first is None else first  # every label's greedy tokens against the first label's
        name = re.sub(r"[:=]", "_", label) + (f"_{args.quantize}" if args.quantize else "")
        stats = runner.engine.stats if hasattr(runner, "engine") else {}  # over the warm-up and timed runs
        kept = ("prefill", "decode", "decode_host", "decode_trials", "slots", "decode_slots", "cpu_cost_scale")
        engine = {key: stats.get(key) for key in kept}
        if hasattr(runner, "engine"):  # whether the store has device views for decode_zero_copy (`:zerocopy`)
            engine["device_views"] = runner.engine.store.layer_device_views(runner.config.moe_layers[0]) is not None
        summary = {"trace": None}
        if args.trace is not None:
            path = args.trace / f"{name}.trace.json.gz"
            perfetto_trace(lambda: runner.generate(ids, args.tokens), path)
            # the first token comes from prefill: tokens - 1 decode steps, the last cut off (whole steps only)
            summary = summarize(path, args.top, decode_steps=args.tokens - 1) if path.exists() else summary
        record.pop("tokens")
        emit(records, {"label": label, "quantize": args.quantize, **record, "engine": engine,
                       "trace_summary": summary})
    devices = argparse.Namespace(accel=jax.devices()[0])
    return probe_result("an offloaded decode step traced (random weights)", devices, records, args.out,
                        model=args.model, weights="random (seeded, seed 0)", prompt=args.prompt, tokens=args.tokens,
                        gpu_memory=args.gpu_memory, expert_pool=args.expert_pool, workload=args.workload,
                        layers=args.layers,
                        xla_flags=os.environ.get("XLA_FLAGS", ""))


def _bench_engine(args, policy: str):
    """The offload engine `pdscope-jax bench` builds: seeded random weights (seed 0) rewritten by the workload, the
    experts quantized as they load."""
    import jax.numpy as jnp

    from pdscope_jax import models
    from pdscope_jax.api import resolve
    from pdscope_jax.bench.runs import quantized_weights, weights_loader
    from pdscope_jax.engine.runner import OffloadRunner
    from pdscope_jax.runtime import RuntimeConfig
    from pdscope_jax.workloads import routing

    cfg = resolve(args.model)[0]
    if args.layers is not None:
        cfg = dataclasses.replace(cfg, num_layers=args.layers)
    shapes = models.abstract_state(cfg, jnp.bfloat16)
    loader = weights_loader(cfg, None, shapes, 0, routing.design(cfg, args.workload, seed=0))
    cfg, _, loader = quantized_weights(cfg, jnp.bfloat16, shapes, loader, args.quantize)
    rc = RuntimeConfig(gpu_memory=args.gpu_memory, expert_pool=args.expert_pool, policy=policy,
                       max_seq_len=args.max_seq_len)
    return OffloadRunner(models.abstract_model(cfg, jnp.bfloat16), rc, loader)


if __name__ == "__main__":
    main()
