"""Offload benchmark: prefill and decode throughput of each policy under a GPU memory budget.

Contract: `main(argv) -> dict` builds the model once with seeded random weights (generated on the accelerator,
routed experts one layer at a time and taken into pinned host memory), then for each policy (switched
with `OffloadRunner.set_policy`, so the weights are not rebuilt) and prompt length runs `--warmup` untimed
warm-ups (`OffloadRunner.warmup`: one generation plus every CPU expert program of that shape) and `--repeats`
timed generations of `--batch` random prompts, each generating `--new-tokens` tokens. It reports medians of
prefill tok/s and decode tok/s, the time split per phase (CPU experts, GPU experts, transfer, exposed transfer,
all summed over layers), bytes moved, slot hit rate and prefetch accuracy, in a rich table, and writes
`bench_<model>_<time>.json` (command line, jax version, device, "weights": "random", the runtime config, the
budget, every repeat's statistics) and a PNG plot into `--out`.
`--track-memory N` also runs N decode steps with the first policy and records accelerator memory after every
step (live array bytes, and the allocator's bytes in use where the device reports them), to show it stays flat.
It prints one JSON line with the summary last. Example on the GPU node:
    PYTHONPATH=. python scripts/bench.py --model deepseek-v2-lite --policies ondemand greedy fate pdscope \
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
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="deepseek-v2-lite", help="preset name (random weights)")
    p.add_argument("--policies", nargs="+", default=["static", "ondemand", "greedy", "fate", "pdscope"])
    p.add_argument("--prompt-lens", nargs="+", type=int, default=[128, 512, 1024, 2048, 4096])
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--batch", type=int, default=1)
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
    p.add_argument("--cpu-view", default="alias", choices=["alias", "copy"],
                   help="CPU experts read pinned memory in place (alias) or from a second host copy")
    p.add_argument("--host-alloc", default="jax", choices=["jax", "torch"],
                   help="pin expert memory through jax (pinned_host) or torch (+dlpack; GPU only)")
    p.add_argument("--track-memory", type=int, default=0, metavar="N", help="also record memory over N decode steps")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.cpu_threads:  # XLA:CPU's thread flags do not bind; affinity set before JAX starts does
        os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[: args.cpu_threads])
    import jax

    try:  # a CPU-only machine needs a second CPU device to stand in for the accelerator
        jax.config.update("jax_num_cpu_devices", max(2, jax.config.jax_num_cpu_devices))
    except RuntimeError:
        pass  # backends already started (e.g. under pytest, whose conftest set two devices)
    import jax.numpy as jnp
    import numpy as np
    from rich.console import Console
    from rich.progress import Progress

    from pdscope_jax import models
    from pdscope_jax.offload.engine import OffloadRunner
    from pdscope_jax.presets import preset
    from pdscope_jax.runtime import RuntimeConfig
    from pdscope_jax.weights.random_init import random_state

    console = Console(stderr=True, width=None if sys.stderr.isatty() else 170)
    cfg = preset(args.model)
    dtype = jnp.dtype(args.dtype)
    max_new = max(args.new_tokens, args.track_memory + 1)
    rc = RuntimeConfig(gpu_memory=args.gpu_memory, expert_pool=args.expert_pool, policy="ondemand",
                       cpu_threads=args.cpu_threads, prefill_chunk=args.prefill_chunk, max_batch=args.batch,
                       max_seq_len=max(args.prompt_lens) + max_new, cost_table=args.cost_table)
    shapes = models.abstract_state(cfg, dtype)
    with console.status(f"building {cfg.name} with random weights"):
        runner = OffloadRunner(models.abstract_model(cfg, dtype), rc,
                               lambda paths, placement: random_state({p: shapes[p] for p in paths}, args.seed,
                                                                     placement),
                               cpu_view=args.cpu_view, host_alloc=args.host_alloc)
    console.print(f"budget: {runner.budget.describe()}; double buffering: {runner.pool.can_double_buffer}; "
                  f"host bytes per model byte: {runner.store.host_bytes_per_model_byte:.2f}")
    rng = np.random.default_rng(args.seed)
    prompts = {t: rng.integers(0, cfg.vocab_size, (args.batch, t)).astype(np.int32) for t in args.prompt_lens}

    results, errors = [], []
    total = len(args.policies) * len(args.prompt_lens) * (args.warmup + args.repeats)
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("benchmark", total=total)
        for policy in args.policies:
            try:
                runner.set_policy(policy, _options(policy, args, runner, cfg))
            except Exception as err:  # noqa: BLE001 (a policy the budget cannot run is reported, not fatal)
                errors.append({"policy": policy, "error": f"{type(err).__name__}: {err}"})
                progress.advance(task, len(args.prompt_lens) * (args.warmup + args.repeats))
                continue
            for t in args.prompt_lens:
                progress.update(task, description=f"{policy} prompt {t}")
                for _ in range(args.warmup):
                    runner.warmup(args.batch, t, args.new_tokens)
                    progress.advance(task)
                compiled_after_warmup = runner.compiled_programs["total"]
                repeats = []
                for _ in range(args.repeats):
                    runner.reset_stats()
                    out = runner.generate(prompts[t], args.new_tokens)
                    repeats.append({"prefill_tok_s": out.prefill_tokens_per_s, "decode_tok_s": out.decode_tokens_per_s,
                                    **runner.stats})
                    progress.advance(task)
                results.append(_summarise(policy, t, repeats, compiled_after_warmup))

    memory = None
    if args.track_memory:
        runner.set_policy(args.policies[0], _options(args.policies[0], args, runner, cfg))
        runner.track_memory = True
        with console.status(f"tracking memory over {args.track_memory} decode steps"):
            runner.generate(prompts[args.prompt_lens[0]], args.track_memory + 1)
        runner.track_memory = False
        memory = {"policy": args.policies[0], "steps": runner.memory_trace}

    device = runner.devices.accel
    report = {
        "command": shlex.join([sys.argv[0], *(sys.argv[1:] if argv is None else argv)]),
        "jax": jax.__version__, "python": platform.python_version(),
        "device": f"{device.platform}:{device.id} {getattr(device, 'device_kind', '')}".strip(),
        "cpu_device": str(runner.devices.cpu), "weights": "random", "model": cfg.name, "dtype": args.dtype,
        "batch": args.batch, "new_tokens": args.new_tokens, "repeats": args.repeats, "warmup": args.warmup,
        "runtime": {k: v for k, v in vars(rc).items() if k not in ("policy", "policy_options")},
        "budget": dict(runner.budget.lines()), "slots": runner.pool.num_slots,
        "double_buffering": runner.pool.can_double_buffer,
        "host_bytes_per_model_byte": runner.store.host_bytes_per_model_byte, "host_alloc": args.host_alloc,
        "cpu_view": args.cpu_view, "results": results, "errors": errors, "memory": memory,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"bench_{cfg.name}_{datetime.datetime.now():%Y%m%d-%H%M%S}"
    json_path, png_path = args.out / f"{stem}.json", args.out / f"{stem}.png"
    json_path.write_text(json.dumps(report, indent=1, default=_jsonable))
    _plot(report, png_path)
    console.print(_table(results))
    for error in errors:
        console.print(f"[red]{error['policy']}: {error['error']}")
    summary = {"json": str(json_path), "png": str(png_path), "model": cfg.name, "device": report["device"],
               "results": [{k: r[k] for k in ("policy", "prompt_len", "prefill_tok_s", "decode_tok_s")}
                           for r in results], "errors": errors}
    print(json.dumps(summary), flush=True)
    return report


def _options(policy: str, args, runner, cfg) -> dict:
    if policy != "static":
        return {}
    if args.hot_per_layer is not None:
        return {"hot_per_layer": args.hot_per_layer}
    return {"hot_per_layer": min(cfg.num_experts, runner.pool.num_slots // len(cfg.moe_layers))}


def _median(repeats: list[dict], phase: str, key: str):
    values = [r[phase][key] for r in repeats if r[phase][key] is not None]
    return statistics.median(values) if values else None


def _summarise(policy: str, prompt_len: int, repeats: list[dict], compiled_after_warmup: int) -> dict:
    out = {"policy": policy, "prompt_len": prompt_len,
           "prefill_tok_s": statistics.median(r["prefill_tok_s"] for r in repeats),
           "decode_tok_s": statistics.median(r["decode_tok_s"] for r in repeats),
           "compiled_programs_after_warmup": compiled_after_warmup,
           "compiled_programs_after_runs": repeats[-1]["compiled_programs"]["total"]}
    for phase in ("prefill", "decode"):
        out[phase] = {key: _median(repeats, phase, key) for key in
                      (*PHASE_TIMES, "seconds", "bytes_moved", "hit_rate", "prefetch_accuracy", "cpu_experts",
                       "gpu_experts")}
    out["repeats"] = repeats
    return out


def _table(results: list[dict]):
    from rich.table import Table

    table = Table(title="offload benchmark (medians; times summed over layers, seconds)")
    for name in ("policy", "prompt", "prefill tok/s", "decode tok/s", "prefill cpu/gpu/xfer/exposed",
                 "decode cpu/gpu/xfer/exposed", "GB moved (p/d)", "decode hit rate", "prefetch acc (p/d)"):
        table.add_column(name, justify="right")
    for r in results:
        p, d = r["prefill"], r["decode"]
        split = lambda s: "/".join(f"{s[k]:.3f}" if s[k] is not None else "-" for k in PHASE_TIMES)  # noqa: E731
        fmt = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
        table.add_row(r["policy"], str(r["prompt_len"]), f"{r['prefill_tok_s']:.1f}", f"{r['decode_tok_s']:.2f}",
                      split(p), split(d), f"{(p['bytes_moved'] or 0) / 1e9:.2f}/{(d['bytes_moved'] or 0) / 1e9:.2f}",
                      fmt(d["hit_rate"]), f"{fmt(p['prefetch_accuracy'])}/{fmt(d['prefetch_accuracy'])}")
    return table


def _plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    results = report["results"]
    policies = list(dict.fromkeys(r["policy"] for r in results))
    panels = 4 if report["memory"] else 3
    fig, axes = plt.subplots(1, panels, figsize=(5 * panels, 4))
    for policy in policies:
        rows = [r for r in results if r["policy"] == policy]
        axes[0].plot([r["prompt_len"] for r in rows], [r["prefill_tok_s"] for r in rows], marker="o", label=policy)
        axes[1].plot([r["prompt_len"] for r in rows], [r["decode_tok_s"] for r in rows], marker="o", label=policy)
    for ax, title in zip(axes[:2], ("prefill tok/s", "decode tok/s")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("prompt length")
        ax.set_title(title)
        ax.legend()
    longest = max((r["prompt_len"] for r in results), default=0)
    bars = [r for r in results if r["prompt_len"] == longest]
    labels = [f"{r['policy']}\n{phase}" for r in bars for phase in ("prefill", "decode")]
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
    fig.suptitle(f"{report['model']} on {report['device']}, batch {report['batch']}, budget "
                 f"{report['runtime']['gpu_memory'] / 1e9:.1f} GB")
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
