"""Offload benchmark: prefill and decode throughput of each policy under a GPU memory budget.

Contract: `main(argv) -> dict` builds the model once (a preset with seeded random weights, or a checkpoint
directory read lazily; routed experts one layer at a time into pinned host memory), then for each run (a policy,
or with `--ablation` the paper's ablation sequence; switched with `OffloadRunner.set_policy`, so the weights
are not rebuilt), batch size (`--batch 1 8 16 32`; batches above one prefill in chunks of `--prefill-chunk`) and
prompt length runs `--warmup` untimed warm-ups (`OffloadRunner.warmup`: one generation plus every CPU expert
program of that shape) and `--repeats` timed generations of random prompts, each generating `--new-tokens`
tokens. The first timed generation starts from the pool as `set_policy` leaves it (empty but for a hot table's
experts: "cold"), every later one from the pool the one before it left ("warm"); on the H200 a cold 4,096-token
DeepSeek-V2-Lite prefill streamed 28.7 GB where a warm one streamed 22.7 (calls 50-52). Each repeat says which
it was ("pool"), and `prefill_tok_s_cold` / `prefill_tok_s_warm` (median of the warm ones; None with one repeat)
keep them apart. It reports medians of prefill tok/s and decode tok/s over all repeats, the time split per phase
(CPU experts, GPU experts, transfer, exposed transfer, all summed over layers; a decode run as one accelerator
program per step, `offload.device_decode`, has none and shows "one program/step"), bytes moved, slot hit rate,
prefetch accuracy and the planner's own milliseconds per layer, in a rich table, and writes
`bench_<model>_<time>.json` (command line, jax version, device, "weights": "random" | "checkpoint", "workload",
the runtime config, the budget, every repeat's statistics) and a PNG plot into `--out`.
- Workloads (`pdscope_jax.workloads.routing`, random weights only): `--workload uniform` (the weights as generated) or
  `skewed` (routers rewritten before anything runs so that popularity and inter-layer affinity follow the
  trained reference MoE; the fitted targets go into the JSON). A checkpoint's routing is its own ("checkpoint").
- Policy "plain" (the upper bound): after the offload runs, the offload engine is dropped and the whole model
  runs on the default device (the GPU where there is one, as `pdscope_jax.load` runs it) through
  `generation.Generator`, ignoring the budget; every offload result then
  records whether its first repeat's tokens equal the plain model's (`tokens_match_plain`) and how many new
  tokens agree before the first difference (`tokens_before_divergence`; in bfloat16, reductions that add in
  another order can flip a near-tie between two tokens, after which the texts differ). Policy "gpu" is
  the engine with every expert resident, when the budget allows it.
- Hot table: `--hot-table PATH` (layer_stats.json or a trace directory, `sched.hot`) for the planners that have
  one; `--hot-table auto` first records activation counts from one untimed on-demand generation over other
  prompts (the longest length) and saves them as `<out>/hot_<model>_<time>.json`.
- A policy name with the suffix ":host" (e.g. `ondemand:host`) runs that policy with RuntimeConfig.device_decode
  off: the host plans every decode layer, as every policy did before device decode; both can run side by side.
- `--ablation` replaces `--policies` with: greedy (synchronous I/O, one GPU program per expert), +h (hot table),
  +i (asynchronous I/O: copies overlap compute), +p+a (PDScope's AdaptSched with next-layer scores, full-layer
  streaming in prefill), +g+c (one batched GPU program per layer in prefill, and decode as one program per step),
  then plain. The paper's "+c" (CPU cache prefetch of
  expert weights) has no JAX counterpart and is not modelled.
After every policy/batch/length point the JSON so far is written with `"complete": false` (a run stopped by a
time limit keeps its figures), and a point that raises is recorded under "errors" while the others still run.
`--cprofile N` profiles one generation of N tokens per run at the longest prompt with cProfile after the timed
runs (the host-side functions with the most own and cumulative time go into the JSON), then records one more
generation's stage timeline (`offload.timeline`: median ms between the stages of a MoE layer, per phase).
`--track-memory N` also runs N decode steps with the first policy and records accelerator memory after every
step (live array bytes, and the allocator's bytes in use where the device reports them), to show it stays flat.
It prints one JSON line with the summary last. Example on the GPU node:
    PYTHONPATH=. python benchmarks/bench.py --model deepseek-v2-lite --policies ondemand greedy fate pdscope \
        --prompt-lens 128 512 1024 2048 4096 --new-tokens 64 --gpu-memory 24GB --expert-pool 8GB
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import statistics
import sys
from pathlib import Path

PHASE_TIMES = ("cpu_seconds", "gpu_seconds", "transfer_seconds", "exposed_transfer_seconds")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    from pdscope_jax.sched import POLICIES as PLANNERS

    p = argparse.ArgumentParser(prog="pdscope-jax bench", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="deepseek-v2-lite",
                   help="preset name (random weights) or checkpoint directory (its weights)")
    p.add_argument("--policies", nargs="+", default=["static", "ondemand", "greedy", "fate", "pdscope", "plain"],
                   choices=[*PLANNERS, *(f"{name}{HOST_DECODE}" for name in PLANNERS), "plain"], metavar="POLICY",
                   help=f"planner names ({', '.join(PLANNERS)}), each also as NAME{HOST_DECODE} (decode planned by "
                        "the host layer by layer, never as one accelerator program per step), and 'plain' for the "
                        "whole model without offloading")
    p.add_argument("--ablation", action="store_true", help="run the ablation sequence instead of --policies")
    p.add_argument("--workload", default="uniform", choices=["uniform", "skewed"],
                   help="routing of random-weight models (pdscope_jax.workloads.routing)")
    p.add_argument("--hot-table", default=None, help="layer_stats.json, trace directory, or 'auto'")
    p.add_argument("--prompt-lens", nargs="+", type=int, default=[128, 512, 1024, 2048, 4096])
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--batch", nargs="+", type=int, default=[1])
    p.add_argument("--gpu-memory", default="24GB")
    p.add_argument("--expert-pool", default=None, help="cap on the expert slot pool, e.g. 8GB")
    p.add_argument("--prefill-chunk", type=int, default=256)
    p.add_argument("--hot-per-layer", type=int, default=None,
                   help="static policy's resident experts per layer (default: the pool split evenly)")
    p.add_argument("--cost-table", default=None, help="cost table JSON from `pdscope-jax profile`")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cpu-threads", type=int, default=None, help="pin the process to this many cores")
    p.add_argument("--xla-cpu-cores", type=int, default=None,
                   help="give XLA:CPU's compute threads this many cores; host threads keep every core "
                        "(runtime.start_backends)")
    p.add_argument("--cpu-view", default="alias", choices=["alias", "copy"],
                   help="CPU experts read pinned memory in place (alias) or from a second host copy")
    p.add_argument("--host-alloc", default="auto", choices=["auto", "jax", "torch"],
                   help="pin expert memory through jax (pinned_host) or torch (+dlpack; GPU only); auto: torch on a "
                        "GPU where torch has CUDA (offload.expert_store)")
    p.add_argument("--track-memory", type=int, default=0, metavar="N", help="also record memory over N decode steps")
    p.add_argument("--cprofile", type=int, default=0, metavar="N",
                   help="also profile (cProfile) one generation of N tokens per run, after the timed ones")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    return p.parse_args(argv)


HOST_DECODE = ":host"  # a policy name's suffix: RuntimeConfig.device_decode off
ABLATION = (  # (label, policy, hot table, async_io, batched_gpu)
    ("greedy", "greedy", False, False, False),
    ("+h", "greedy", True, False, False),
    ("+i", "greedy", True, True, False),
    ("+p+a", "pdscope", True, True, False),
    ("+g+c", "pdscope", True, True, True),
)


def _runs(args) -> list[dict]:
    """The runs in order: label, policy and engine switches (the hot table is filled in once it is known)."""
    if args.ablation:
        return [{"label": label, "policy": policy, "hot": hot, "async_io": aio, "batched_gpu": batched,
                 "device_decode": True} for label, policy, hot, aio, batched in ABLATION] + [
            {"label": "plain", "policy": "plain"}]
    return [{"label": label, "policy": label.removesuffix(HOST_DECODE), "hot": args.hot_table is not None,
             "async_io": True, "batched_gpu": True, "device_decode": not label.endswith(HOST_DECODE)}
            for label in args.policies]


def _engine(run: dict, hot_table) -> dict:
    """The engine switches of a run (`OffloadRunner.set_policy`'s keyword arguments)."""
    return {"hot_table": hot_table if run["hot"] else None, "async_io": run["async_io"],
            "batched_gpu": run["batched_gpu"], "device_decode": run["device_decode"]}


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.cpu_threads:  # XLA:CPU's thread flags do not bind; affinity set before JAX starts does
        os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[: args.cpu_threads])
    import jax

    from pdscope_jax.runtime import request_cpu_stand_in, start_backends

    request_cpu_stand_in()
    start_backends(args.xla_cpu_cores)
    import jax.numpy as jnp
    import numpy as np
    from rich.console import Console
    from rich.progress import Progress

    from pdscope_jax import models
    from pdscope_jax.workloads import routing as workloads
    from pdscope_jax.api import resolve
    from pdscope_jax.engine.runner import OffloadRunner
    from pdscope_jax.runtime import RuntimeConfig, select_devices
    from pdscope_jax.sched.hot import write_layer_stats

    console = Console(stderr=True, width=None if sys.stderr.isatty() else 170)
    cfg, checkpoint = resolve(args.model)
    if checkpoint is not None and args.workload != "uniform":
        raise SystemExit(f"--workload {args.workload} rewrites random weights; {checkpoint} routes as trained")
    dtype = jnp.dtype(args.dtype)
    max_new = max(args.new_tokens, args.track_memory + 1)
    runs = _runs(args)
    offload_runs = [r for r in runs if r["policy"] != "plain"]
    rc = RuntimeConfig(gpu_memory=args.gpu_memory, expert_pool=args.expert_pool, policy="ondemand",
                       cpu_threads=args.cpu_threads, prefill_chunk=args.prefill_chunk, max_batch=max(args.batch),
                       max_seq_len=max(args.prompt_lens) + max_new, cost_table=args.cost_table)
    shapes = models.abstract_state(cfg, dtype)
    workload = workloads.design(cfg, args.workload, seed=args.seed) if checkpoint is None else None
    loader = _loader(cfg, checkpoint, shapes, args.seed, workload)
    stamp = f"{datetime.datetime.now():%Y%m%d-%H%M%S}"
    rng = np.random.default_rng(args.seed)
    prompts = {(b, t): rng.integers(0, cfg.vocab_size, (b, t)).astype(np.int32)
               for b in args.batch for t in args.prompt_lens}
    args.out.mkdir(parents=True, exist_ok=True)

    results, errors, tokens, runner, hot_table = [], [], {}, None, args.hot_table
    if offload_runs:
        with console.status(f"building {cfg.name} ({'checkpoint' if checkpoint else 'random weights'})"):
            runner = OffloadRunner(models.abstract_model(cfg, dtype), rc, loader, cpu_view=args.cpu_view,
                                   host_alloc=args.host_alloc)
        console.print(f"budget: {runner.budget.describe()}; double buffering: {runner.pool.can_double_buffer}; "
                      f"host bytes per model byte: {runner.store.host_bytes_per_model_byte:.2f}")
        if hot_table == "auto" or (args.ablation and hot_table is None):
            hot_table = _record_hot_table(runner, cfg, args, rng, write_layer_stats, stamp, console)
    devices = select_devices()
    accel = devices.accel
    header = {
        "command": shlex.join([sys.argv[0], *(sys.argv[1:] if argv is None else argv)]),
        "jax": jax.__version__, "python": platform.python_version(),
        "device": f"{accel.platform}:{accel.id} {getattr(accel, 'device_kind', '')}".strip(),
        "cpu_device": str(devices.cpu), "weights": "checkpoint" if checkpoint else "random",
        "checkpoint": str(checkpoint) if checkpoint else None, "model": cfg.name, "dtype": args.dtype,
        "workload": "checkpoint" if checkpoint else args.workload,
        "workload_design": workload.summary() if workload else None,
        "ablation": args.ablation, "batch": args.batch, "new_tokens": args.new_tokens, "repeats": args.repeats,
        "warmup": args.warmup,
        "runtime": {k: v for k, v in vars(rc).items() if k not in ("policy", "policy_options")},
        "host_alloc": runner.store.host_alloc if runner else args.host_alloc, "cpu_view": args.cpu_view,
        "xla_cpu_cores": args.xla_cpu_cores,
    }
    stem = f"bench_{cfg.name}_{stamp}"
    json_path, png_path = args.out / f"{stem}.json", args.out / f"{stem}.png"

    def save_partial(runner, results, errors):
        """The results so far, so that a run stopped early (a time limit) still leaves its figures."""
        partial = {**header, "hot_table": hot_table, **_describe(runner), "results": results, "errors": errors,
                   "memory": None, "complete": False}
        json_path.write_text(json.dumps(partial, indent=1, default=_jsonable))

    total = len(runs) * len(args.batch) * len(args.prompt_lens) * (args.warmup + args.repeats)
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("benchmark", total=total)
        for run in offload_runs:
            engine = _engine(run, hot_table)
            try:
                runner.set_policy(run["policy"], _options(run["policy"], args), **engine)
            except Exception as err:  # noqa: BLE001 (a policy the budget cannot run is reported, not fatal)
                errors.append({"policy": run["label"], "error": f"{type(err).__name__}: {err}"})
                progress.advance(task, len(args.batch) * len(args.prompt_lens) * (args.warmup + args.repeats))
                continue
            for b in args.batch:
                for t in args.prompt_lens:
                    progress.update(task, description=f"{run['label']} batch {b} prompt {t}")
                    try:
                        for _ in range(args.warmup):
                            runner.warmup(b, t)  # decode programs do not depend on the step count
                            progress.advance(task)
                        compiled_after_warmup = runner.compiled_programs["total"]
                        repeats = []
                        for i in range(args.repeats):
                            runner.reset_stats()
                            out = runner.generate(prompts[b, t], args.new_tokens)
                            tokens.setdefault((run["label"], b, t), out.tokens)
                            repeats.append({"pool": "warm" if i else "cold", "prefill_tok_s": out.prefill_tokens_per_s,
                                            "decode_tok_s": out.decode_tokens_per_s, **runner.stats})
                            progress.advance(task)
                    except Exception as err:  # noqa: BLE001 (one failing shape is reported; the others still run)
                        errors.append({"policy": run["label"], "batch": b, "prompt_len": t,
                                       "error": f"{type(err).__name__}: {err}"[:2000]})
                        console.print_exception(max_frames=8)
                        continue
                    results.append(_summarise(run["policy"], t, repeats, compiled_after_warmup,
                                              variant=run["label"], batch=b, engine=engine))
                    save_partial(runner, results, errors)

        memory = None
        if args.track_memory and offload_runs:
            first = offload_runs[0]
            runner.set_policy(first["policy"], _options(first["policy"], args), **_engine(first, hot_table))
            runner.track_memory = True
            with console.status(f"tracking memory over {args.track_memory} decode steps"):
                runner.generate(prompts[args.batch[0], args.prompt_lens[0]], args.track_memory + 1)
            runner.track_memory = False
            memory = {"policy": first["label"], "steps": runner.memory_trace}
        profiles = (_profile_runs(runner, offload_runs, args, prompts, console, hot_table)
                    if args.cprofile else None)
        report_runner = _describe(runner)
        del runner  # the plain model needs the accelerator to itself
        if len(runs) > len(offload_runs):
            _run_plain(cfg, dtype, loader, shapes, args, prompts, results, tokens, progress, task)

    report = {**header, "hot_table": hot_table, **report_runner, "results": results, "errors": errors,
              "memory": memory, "cprofile": profiles, "complete": True}
    json_path.write_text(json.dumps(report, indent=1, default=_jsonable))
    _plot(report, png_path)
    console.print(_table(results))
    for error in errors:
        console.print(f"[red]{error['policy']}: {error['error']}")
    summary = {"json": str(json_path), "png": str(png_path), "model": cfg.name, "device": report["device"],
               "workload": report["workload"],
               "results": [{k: r.get(k) for k in ("variant", "policy", "batch", "prompt_len", "prefill_tok_s",
                                                  "decode_tok_s", "tokens_match_plain", "tokens_before_divergence")}
                           for r in results],
               "errors": errors}
    print(json.dumps(summary), flush=True)
    return report


def _loader(cfg, checkpoint, shapes, seed: int, workload):
    """`loader(paths, placement)` of the benchmarked weights: the checkpoint's, or seeded random ones rewritten
    by the workload."""
    if checkpoint is not None:
        from pdscope_jax import models
        from pdscope_jax.weights.checkpoint import checkpoint_loader, open_checkpoint

        return checkpoint_loader(open_checkpoint(checkpoint), models.checkpoint_sources(cfg), shapes)
    from pdscope_jax.weights.random_init import random_state

    def random(paths, placement):
        return random_state({p: shapes[p] for p in paths}, seed, placement)

    return workload.loader(random) if workload is not None else random


def _record_hot_table(runner, cfg, args, rng, write_layer_stats, stamp, console) -> str:
    """Activation counts of one on-demand generation over prompts not used for timing, at the first batch size and
    the longest prompt (the most routed tokens: a 128-token prompt gives DeepSeek-V2-Lite 12 picks per expert, too
    few to tell popularity from noise), saved as a hot table."""
    import numpy as np

    b, t = args.batch[0], max(args.prompt_lens)
    with console.status("recording activation counts for the hot table"):
        runner.set_policy("ondemand")
        runner.generate(rng.integers(0, cfg.vocab_size, (b, t)).astype(np.int32), args.new_tokens)
        path = write_layer_stats(args.out / f"hot_{cfg.name}_{stamp}.json", cfg.moe_layers,
                                 runner.activation_counts)
    return str(path)


def _profile_runs(runner, runs: list[dict], args, prompts, console, hot_table) -> dict:
    """Where the host's time goes: per run, the functions with the most own and cumulative time (cProfile) over
    one generation of `args.cprofile` tokens at the first batch size and the longest prompt (after its warm-up:
    the long prefill is the one worth a timeline)."""
    import cProfile
    import pstats

    from pdscope_jax.engine.timeline import Timeline

    out = {}
    for run in runs:
        engine = _engine(run, hot_table)
        runner.set_policy(run["policy"], _options(run["policy"], args), **engine)
        prompt = prompts[args.batch[0], args.prompt_lens[-1]]
        with console.status(f"profiling {run['label']}"):
            runner.generate(prompt, args.cprofile)
            profiler = cProfile.Profile()
            profiler.enable()
            result = runner.generate(prompt, args.cprofile)
            profiler.disable()
            runner.timeline = Timeline()  # once more without the profiler: stage timestamps per layer
            runner.generate(prompt, args.cprofile)
            timeline, runner.timeline = runner.timeline.summary(), None
        stats = pstats.Stats(profiler)
        rows = [{"function": f"{path.rsplit('/', 1)[-1]}:{line}({name})", "calls": calls, "own_s": own,
                 "cumulative_s": cum} for (path, line, name), (_, calls, own, cum, _) in stats.stats.items()]
        out[run["label"]] = {
            "prefill_seconds": result.prefill_seconds, "decode_seconds": result.decode_seconds,
            "new_tokens": args.cprofile, "prompt_len": args.prompt_lens[-1], "timeline_ms": timeline,
            "by_own_time": sorted(rows, key=lambda r: -r["own_s"])[:25],
            "by_cumulative_time": sorted(rows, key=lambda r: -r["cumulative_s"])[:40]}
    return out


def _describe(runner) -> dict:
    if runner is None:
        return {"budget": None, "slots": None, "double_buffering": None, "host_bytes_per_model_byte": None,
                "host_expert_bytes": None, "host_peak_rss_bytes": None}
    import resource

    return {"budget": dict(runner.budget.lines()), "slots": runner.pool.num_slots,
            "double_buffering": runner.pool.can_double_buffer,
            "host_bytes_per_model_byte": runner.store.host_bytes_per_model_byte,
            "host_expert_bytes": runner.store.host_bytes,
            "host_peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}  # Linux: KiB


def _run_plain(cfg, dtype, loader, shapes, args, prompts, results, tokens, progress, task) -> None:
    """The whole model on the accelerator (no budget): timings, and token parity of every offload result."""
    import jax
    import numpy as np

    from pdscope_jax import models
    from pdscope_jax.generation.generator import Generator

    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])  # where `pdscope_jax.load` runs a model whole
    generator = Generator(models.from_flat(cfg, dtype, loader(list(shapes), lambda path: device)))
    for b in args.batch:
        for t in args.prompt_lens:
            progress.update(task, description=f"plain batch {b} prompt {t}")
            for _ in range(args.warmup):
                generator.generate(prompts[b, t], args.new_tokens)
                progress.advance(task)
            repeats = []
            for _ in range(args.repeats):
                out = generator.generate(prompts[b, t], args.new_tokens)
                tokens.setdefault(("plain", b, t), out.tokens)
                repeats.append({"prefill_tok_s": out.prefill_tokens_per_s, "decode_tok_s": out.decode_tokens_per_s})
                progress.advance(task)
            results.append({"variant": "plain", "policy": "plain", "batch": b, "prompt_len": t,
                            "prefill_tok_s": statistics.median(r["prefill_tok_s"] for r in repeats),
                            "decode_tok_s": statistics.median(r["decode_tok_s"] for r in repeats),
                            "repeats": repeats})
    for r in results:
        plain = tokens.get(("plain", r["batch"], r["prompt_len"]))
        mine = tokens.get((r["variant"], r["batch"], r["prompt_len"]))
        if r["policy"] == "plain" or plain is None or mine is None:
            r["tokens_match_plain"] = r["tokens_before_divergence"] = None
            continue
        r["tokens_match_plain"] = bool(np.array_equal(plain, mine))
        r["tokens_before_divergence"] = _common_prefix(plain, mine)


def _common_prefix(a, b) -> int:
    """New tokens the two [B, T] outputs agree on before their first difference (in any sequence)."""
    import numpy as np

    differs = np.flatnonzero((np.asarray(a) != np.asarray(b)).any(axis=0))
    return int(differs[0]) if differs.size else int(np.asarray(a).shape[1])


def _options(policy: str, args) -> dict:
    """Planner options from the command line (the engine fills in the defaults)."""
    if policy == "static" and args.hot_per_layer is not None:
        return {"hot_per_layer": args.hot_per_layer}
    return {}


def _median(repeats: list[dict], phase: str, key: str):
    values = [r[phase][key] for r in repeats if r[phase][key] is not None]
    return statistics.median(values) if values else None


def _summarise(policy: str, prompt_len: int, repeats: list[dict], compiled_after_warmup: int, *, variant: str,
               batch: int, engine: dict) -> dict:
    out = {"variant": variant, "policy": policy, "batch": batch, "prompt_len": prompt_len, **engine,
           "prefill_tok_s": statistics.median(r["prefill_tok_s"] for r in repeats),
           "decode_tok_s": statistics.median(r["decode_tok_s"] for r in repeats),
           "prefill_tok_s_cold": repeats[0]["prefill_tok_s"],
           "prefill_tok_s_warm": statistics.median(r["prefill_tok_s"] for r in repeats[1:]) if repeats[1:] else None,
           "compiled_programs_after_warmup": compiled_after_warmup,
           "compiled_programs_after_runs": repeats[-1]["compiled_programs"]["total"]}
    for phase in ("prefill", "decode"):
        out[phase] = {key: _median(repeats, phase, key) for key in
                      (*PHASE_TIMES, "seconds", "generate_seconds", "bytes_moved", "hit_rate", "prefetch_accuracy",
                       "cpu_experts", "gpu_experts", "planner_ms_per_layer", "device_steps",
                       "handoff_seconds")}
    out["repeats"] = repeats
    return out


def _table(results: list[dict]):
    from rich.table import Table

    table = Table(title="offload benchmark (medians; times summed over layers, seconds)")
    for name in ("run", "batch", "prompt", "prefill tok/s", "decode tok/s", "prefill cpu/gpu/xfer/exposed",
                 "decode cpu/gpu/xfer/exposed", "GB moved (p/d)", "decode hit rate", "prefetch acc (p/d)",
                 "planner ms/layer (p/d)", "= plain (tokens)"):
        table.add_column(name, justify="right")
    fmt = lambda v, digits=2: "-" if v is None else f"{v:.{digits}f}"  # noqa: E731
    for r in results:
        match = {None: "-", True: "yes", False: f"no ({r.get('tokens_before_divergence')})"}[
            r.get("tokens_match_plain")]
        head = (r["variant"], str(r["batch"]), str(r["prompt_len"]), f"{r['prefill_tok_s']:.1f}",
                f"{r['decode_tok_s']:.2f}")
        if r["policy"] == "plain":
            table.add_row(*head, *["-"] * 6, match)
            continue
        p, d = r["prefill"], r["decode"]
        def split(s):  # a phase run as one accelerator program per step has no split
            return "one program/step" if s.get("device_steps") else "/".join(fmt(s[k], 3) for k in PHASE_TIMES)
        table.add_row(*head, split(p), split(d),
                      f"{(p['bytes_moved'] or 0) / 1e9:.2f}/{(d['bytes_moved'] or 0) / 1e9:.2f}", fmt(d["hit_rate"]),
                      f"{fmt(p['prefetch_accuracy'])}/{fmt(d['prefetch_accuracy'])}",
                      f"{fmt(p['planner_ms_per_layer'], 3)}/{fmt(d['planner_ms_per_layer'], 3)}", match)
    return table


def _plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    results = report["results"]
    several = len(report["batch"]) > 1
    lines = list(dict.fromkeys((r["variant"], r["batch"]) for r in results))
    panels = 4 if report["memory"] else 3
    fig, axes = plt.subplots(1, panels, figsize=(5 * panels, 4))
    for variant, batch in lines:
        rows = [r for r in results if (r["variant"], r["batch"]) == (variant, batch)]
        label = f"{variant} b{batch}" if several else variant
        axes[0].plot([r["prompt_len"] for r in rows], [r["prefill_tok_s"] for r in rows], marker="o", label=label)
        axes[1].plot([r["prompt_len"] for r in rows], [r["decode_tok_s"] for r in rows], marker="o", label=label)
    for ax, title in zip(axes[:2], ("prefill tok/s", "decode tok/s")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("prompt length")
        ax.set_title(title)
        ax.legend(fontsize=7)
    longest = max((r["prompt_len"] for r in results), default=0)
    bars = [r for r in results if r["prompt_len"] == longest and r["batch"] == report["batch"][0]
            and r["policy"] != "plain"]
    labels = [f"{r['variant']}\n{phase}" for r in bars for phase in ("prefill", "decode")]
    bottom = np.zeros(len(labels))
    for key in PHASE_TIMES:
        values = np.array([r[phase][key] or 0.0 for r in bars for phase in ("prefill", "decode")])
        axes[2].bar(labels, values, bottom=bottom if key != "exposed_transfer_seconds" else None,
                    label=key.replace("_seconds", ""), alpha=0.5 if key == "exposed_transfer_seconds" else 1.0)
        if key != "exposed_transfer_seconds":
            bottom += values
    axes[2].set_title(f"time split, prompt {longest} (s, summed over layers)")
    axes[2].tick_params(axis="x", labelsize=7)
    axes[2].legend(fontsize=7)
    if report["memory"]:
        steps = report["memory"]["steps"]
        axes[3].plot([s["live_array_bytes"] / 1e6 for s in steps], label="live arrays")
        if steps and steps[0]["bytes_in_use"] is not None:
            axes[3].plot([s["bytes_in_use"] / 1e6 for s in steps], label="allocator in use")
        axes[3].set_xlabel("decode step")
        axes[3].set_ylabel("MB on the accelerator")
        axes[3].set_title(f"memory, {report['memory']['policy']}")
        axes[3].legend()
    fig.suptitle(f"{report['model']} ({report['weights']}, {report['workload']} routing) on {report['device']}, "
                 f"batch {report['batch']}, budget {report['runtime']['gpu_memory'] / 1e9:.1f} GB")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _jsonable(value):
    import numpy as np

    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    return str(value)


if __name__ == "__main__":
    main()
