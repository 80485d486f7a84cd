"""Policies side by side (`pdscope-jax bench`): prefill and decode throughput under a GPU memory budget.

Contract: `compare(args, command) -> dict` takes the options of `pdscope-jax bench` (attributes named as its flags)
and the command line to record. It builds the model once (a preset with seeded random weights rewritten by
`args.workload` at `args.predictability`, or a checkpoint directory read lazily; `workloads.routing`: equal shares
or the reference MoE's popularity and affinity, the next layer's predictability calibrated; the designed Fate-style
recall@k is printed and recorded), then for each run (`bench.runs.plan_runs`: a policy, a policy with host-planned
decode, or the ablation sequence; switched with `OffloadRunner.set_policy`, so the weights are not rebuilt), batch
size and prompt length times `args.repeats` generations of random prompts after `args.warmup` warm-ups
(`bench.runs.time_point`). The plain run (`sched.PLAIN`) drops the offload engine and runs the whole model on the
default device, ignoring the budget; every offload row then records `tokens_match_plain` and
`tokens_before_divergence`. With `--hot-table auto` (or an ablation without a table) activation counts from one
untimed generation are saved as `<out>/hot_<model>_<time>.json` first. Outputs, in `args.out`:
`bench_<model>_<time>.json` (command, commit, jax version, devices, "weights": "random" | "checkpoint", "workload",
quantize and quality, runtime config, budget, every result row with its repeats, "errors", optional "memory" and
"cprofile", "complete") and a PNG (`bench.report.plot`); a rich table on stderr; one JSON summary line last on
stdout. After every point the JSON so far is written with `"complete": false`, and a point that raises is recorded
under "errors" while the others still run; a policy the budget cannot hold is an error too. `args.track_memory N`
records accelerator memory over N decode steps of the first run; `args.cprofile N` profiles one generation of N
tokens per run (`bench.runs.profile_runs`). Returns the report dict.
"""

from __future__ import annotations

import datetime
import platform

from pdscope_jax.bench import report as out
from pdscope_jax.bench import runs as bench_runs
from pdscope_jax.artifacts.provenance import source_commit
from pdscope_jax.sched import PLAIN


def compare(args, command: str) -> dict:
    import jax

    from pdscope_jax.runtime import request_cpu_stand_in, start_backends

    request_cpu_stand_in(args.accelerators)
    start_backends(args.xla_cpu_cores)
    import jax.numpy as jnp
    import numpy as np
    from rich.progress import Progress

    from pdscope_jax import models
    from pdscope_jax.api import resolve
    from pdscope_jax.kernels import cpu_ffn, gather_matvec
    from pdscope_jax.runtime import RuntimeConfig, select_devices
    from pdscope_jax.workloads import routing as workloads

    console = _console()
    cfg, checkpoint = resolve(args.model)
    if checkpoint is not None and args.workload != "uniform":
        raise SystemExit(f"--workload {args.workload} rewrites random weights; {checkpoint} routes as trained")
    dtype = jnp.dtype(args.dtype)
    max_new = max(args.new_tokens, args.track_memory + 1)
    runs = bench_runs.plan_runs(args)
    offload_runs = [r for r in runs if r["policy"] != PLAIN]
    rc = RuntimeConfig(gpu_memory=args.gpu_memory, expert_pool=args.expert_pool, policy="ondemand",
                       cpu_threads=args.cpu_threads, prefill_chunk=args.prefill_chunk, max_batch=max(args.batch),
                       max_seq_len=max(args.prompt_lens) + max_new, cost_table=args.cost_table,
                       cpu_kernel=not args.no_cpu_kernel, quality=bench_runs.build_quality(args, offload_runs),
                       # a hot table given as a file also places the accelerators' shares (engine.shards.owners)
                       hot_table=None if args.hot_table == "auto" else args.hot_table)
    shapes = models.abstract_state(cfg, dtype)
    predictability = getattr(args, "predictability", "reference")
    workload = (workloads.design(cfg, args.workload, seed=args.seed, predictability=predictability)
                if checkpoint is None else None)
    design = workload.summary() if workload is not None else {}
    if design.get("fate_recall_mean") is not None:
        console.print(f"workload {design['workload']}, predictability {design['predictability']}: next-layer gate "
                      f"recall@k {design['fate_recall_mean']:.3f} (target {design['target_fate_recall_mean']})")
    loader = bench_runs.weights_loader(cfg, checkpoint, shapes, args.seed, workload)
    # the same weights, their experts quantized as they load (the plain run too)
    cfg, shapes, loader = bench_runs.quantized_weights(cfg, dtype, shapes, loader, args.quantize)
    stamp = f"{datetime.datetime.now():%Y%m%d-%H%M%S}"
    rng = np.random.default_rng(args.seed)
    prompts = {(b, t): rng.integers(0, cfg.vocab_size, (b, t)).astype(np.int32)
               for b in args.batch for t in args.prompt_lens}
    args.out.mkdir(parents=True, exist_ok=True)

    runner, hot_table = None, args.hot_table
    if offload_runs:
        runner = _build_runner(cfg, dtype, rc, loader, args, console, checkpoint)
        if hot_table == "auto" or (args.ablation and hot_table is None):
            with console.status("recording activation counts for the hot table"):
                hot_table = bench_runs.record_hot_table(runner, cfg, args, rng,
                                                        args.out / f"hot_{cfg.name}_{stamp}.json")
    devices = select_devices()
    accel = devices.accel
    header = {
        "command": command, "commit": source_commit(), "jax": jax.__version__, "python": platform.python_version(),
        "device": f"{accel.platform}:{accel.id} {getattr(accel, 'device_kind', '')}".strip(),
        "cpu_device": str(devices.cpu), "weights": "checkpoint" if checkpoint else "random",
        "checkpoint": str(checkpoint) if checkpoint else None, "model": cfg.name, "dtype": args.dtype,
        "quantize": args.quantize, "quality": args.quality, "accelerators": args.accelerators,
        "workload": "checkpoint" if checkpoint else args.workload,
        "workload_design": design or None,
        "ablation": args.ablation, "batch": args.batch, "new_tokens": args.new_tokens, "repeats": args.repeats,
        "warmup": args.warmup,
        "runtime": {k: v for k, v in vars(rc).items() if k not in ("policy", "policy_options")},
        "host_alloc": runner.store.host_alloc if runner else args.host_alloc, "cpu_view": args.cpu_view,
        "xla_cpu_cores": args.xla_cpu_cores, "hot_table": hot_table,
        # whether the engine may run CPU experts through the kernel (it does at few rows with bf16 weights)
        "cpu_kernel": {"enabled": bool(runner is not None and runner.cpu_experts.kernel), "isa": cpu_ffn.isa(),
                       "threads": cpu_ffn.threads()},
        # whether GPU programs may use the Pallas kernels (PDSCOPE_GPU_KERNELS; they run on CUDA GPUs only)
        "gpu_kernels": gather_matvec.ENABLED,
    }
    stem = f"bench_{cfg.name}_{stamp}"
    json_path, png_path = args.out / f"{stem}.json", args.out / f"{stem}.png"
    results, errors, tokens = [], [], {}
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("benchmark", total=len(runs) * _per_run(args))
        meter = _Meter(progress, task)
        memory, profiles = _measure_offload(runner, offload_runs, args, prompts, header, results, errors, tokens,
                                            json_path, console, meter)
        described = bench_runs.describe_runner(runner)
        del runner  # the plain model needs the accelerator to itself
        if len(runs) > len(offload_runs):
            results.extend(bench_runs.run_plain(cfg, dtype, loader, shapes, args, prompts, tokens, meter.advance,
                                                meter.describe))
            bench_runs.mark_parity(results, tokens)

    report = {**header, **described, "results": results, "errors": errors, "memory": memory, "cprofile": profiles,
              "complete": True}
    out.write_json(report, json_path)
    out.plot(report, png_path)
    console.print(out.table(results, on_gpu=report["device"].startswith("gpu")))
    for error in errors:
        console.print(f"[red]{error['policy']}: {error['error']}")
    print(out.summary_line(report, json_path, png_path), flush=True)
    return report


def _per_run(args) -> int:
    """Progress steps of one run: a warm-up or a repeat at every batch size and prompt length."""
    return len(args.batch) * len(args.prompt_lens) * (args.warmup + args.repeats)


class _Meter:
    """The progress bar's task: `advance(n)` after generations, `describe(text)` names the point."""

    def __init__(self, progress, task):
        self.progress, self.task = progress, task

    def advance(self, steps: int = 1) -> None:
        self.progress.advance(self.task, steps)

    def describe(self, text: str) -> None:
        self.progress.update(self.task, description=text)


def _console():
    import sys

    from rich.console import Console

    return Console(stderr=True, width=None if sys.stderr.isatty() else 170)


def _build_runner(cfg, dtype, rc, loader, args, console, checkpoint):
    from pdscope_jax import models
    from pdscope_jax.engine.runner import OffloadRunner

    with console.status(f"building {cfg.name} ({'checkpoint' if checkpoint else 'random weights'})"):
        runner = OffloadRunner(models.abstract_model(cfg, dtype), rc, loader, cpu_view=args.cpu_view,
                               host_alloc=args.host_alloc, accelerators=args.accelerators)
    each = f" (on each of {runner.accelerators} accelerators)" if runner.accelerators > 1 else ""
    console.print(f"budget{each}: {runner.budget.describe()}; double buffering: {runner.pool.can_double_buffer}; "
                  f"host bytes per model byte: {runner.store.host_bytes_per_model_byte:.2f}")
    stages = ", ".join(f"{stage} {seconds:.1f} s" for stage, seconds in runner.startup_seconds.items())
    console.print(f"built in {sum(runner.startup_seconds.values()):.1f} s: {stages}")
    return runner


def _measure_offload(runner, offload_runs, args, prompts, header, results, errors, tokens, json_path, console,
                     meter) -> tuple[dict | None, dict | None]:
    """Every offload run at every point (appending to `results`, `errors` and `tokens`, saving the partial JSON
    after each point), then the memory trace and the host profile; returns (memory, cprofile)."""
    hot_table = header["hot_table"]
    for run in offload_runs:
        try:
            engine = bench_runs.set_run(runner, run, args, hot_table)
        except Exception as err:  # noqa: BLE001 (a policy the budget cannot run is reported, not fatal)
            errors.append({"policy": run["label"], "error": f"{type(err).__name__}: {err}"})
            meter.advance(_per_run(args))
            continue
        for b in args.batch:
            for t in args.prompt_lens:
                meter.describe(f"{run['label']} batch {b} prompt {t}")
                try:
                    row = bench_runs.time_point(runner, run, engine, prompts[b, t], args, tokens, meter.advance)
                except Exception as err:  # noqa: BLE001 (one failing shape is reported; the others still run)
                    errors.append({"policy": run["label"], "batch": b, "prompt_len": t,
                                   "error": f"{type(err).__name__}: {err}"[:2000]})
                    console.print_exception(max_frames=8)
                    continue
                results.append(row)
                # a line per point as it ends, so that a run cut short by a time limit still shows how far it got
                console.print(f"{run['label']} batch {b} prompt {t}: prefill {row['prefill_tok_s']:,.0f} tok/s, "
                              f"decode {row['decode_tok_s']:,.1f} tok/s (warm-up {row['warmup_seconds']:.0f} s, "
                              f"point {row['point_seconds']:.0f} s){out.peak_note(row, runner.budget.total)}")
                # the results so far, so that a run stopped early (a time limit) still leaves its figures
                out.write_json({**header, **bench_runs.describe_runner(runner), "results": results,
                                "errors": errors, "memory": None, "complete": False}, json_path)
    memory = None
    if args.track_memory and offload_runs:
        first = offload_runs[0]
        bench_runs.set_run(runner, first, args, hot_table)
        runner.track_memory = True
        with console.status(f"tracking memory over {args.track_memory} decode steps"):
            runner.generate(prompts[args.batch[0], args.prompt_lens[0]], args.track_memory + 1)
        runner.track_memory = False
        memory = {"policy": first["label"], "steps": runner.memory_trace}
    profiles = (bench_runs.profile_runs(runner, offload_runs, args, prompts, console.status, hot_table)
                if args.cprofile else None)
    return memory, profiles
