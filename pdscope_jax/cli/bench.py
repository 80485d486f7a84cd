"""`pdscope-jax bench`: the command line of the policy comparison (`bench.compare.compare`).

Contract: `main(argv) -> dict` parses the options, pins the process to `--cpu-threads` cores before JAX starts
(XLA:CPU's thread flags do not bind; affinity set before JAX starts does), records the command line and returns
the report of `bench.compare.compare`. `parse_args(argv)` is the parsing alone: `--policies` takes the registry's
policy names (`sched.POLICIES`), each also as `NAME:host` (decode planned by the host layer by layer), and
`sched.PLAIN` (the whole model without offloading); the default is `sched.COMPARED` then `PLAIN`.
`check_args(args)` checks every option before JAX starts a backend or anything is built (model known, policies
known, lengths and counts positive, sizes readable, cost and hot tables readable, output folder writable) and
raises one `errors.InputError` naming every problem. `--ablation` runs the ablation sequence (`bench.runs.ABLATION`:
greedy, +h hot table, +i asynchronous I/O, +p+a AdaptSched with next-layer scores, +g+c one batched GPU program
per layer and decode as one program per step) instead. Example on the GPU node:
    python -m pdscope_jax bench --model deepseek-v2-lite --policies ondemand greedy fate pdscope \\
        --prompt-lens 128 512 1024 2048 4096 --new-tokens 64 --gpu-memory 24GB --expert-pool 8GB
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path

from pdscope_jax.bench.runs import (BANK_PIECES, CHUNK, COPY_SHARE, HOST_DECODE, NO_BANK, NO_CPU, PROGRAM_COPIES,
                                    QUALITY, SUFFIXES, WITH_CPU, ZERO_COPY, split_label)
from pdscope_jax.cli.options import add_quality, add_quantize
from pdscope_jax.sched import COMPARED, PLAIN, POLICIES


def _predictability(text: str):
    """--predictability's value: a setting name, or a float target recall@k."""
    from pdscope_jax.workloads.predictability import check_setting

    try:
        return check_setting(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="pdscope-jax bench", formatter_class=argparse.RawDescriptionHelpFormatter,
                                description="Offload benchmark: prefill and decode throughput of each policy under "
                                            "a GPU memory budget.\n\npolicies:\n" + _policy_lines())
    p.add_argument("--model", default="deepseek-v2-lite",
                   help="preset name (random weights) or checkpoint directory (its weights)")
    p.add_argument("--policies", nargs="+", default=[*COMPARED, PLAIN], metavar="POLICY",
                   help=f"policy names (below), each also as NAME{HOST_DECODE} (decode planned by the host layer "
                        f"by layer, never as one accelerator program per step), NAME{NO_BANK} (device decode in "
                        f"the slot pool alone, without the decode bank), NAME{BANK_PIECES} (the decode bank as "
                        f"arrays of a layer's experts each), NAME{WITH_CPU} (device decode has the "
                        f"host's CPU compute part of the misses through the CUDA bridge, the default), NAME{NO_CPU} "
                        f"(it copies every miss), NAME{COPY_SHARE}F (the share of misses copied), "
                        f"NAME{PROGRAM_COPIES} (the decode program copies its misses itself, not the bridge's "
                        f"worker), NAME{ZERO_COPY} (it reads the misses in place from pinned host memory), "
                        f"NAME{CHUNK}N (N decode steps a program), NAME{QUALITY}Q (its --quality), and '{PLAIN}' "
                        "for the whole model without offloading")
    p.add_argument("--ablation", action="store_true", help="run the ablation sequence instead of --policies")
    p.add_argument("--workload", default="uniform", choices=["uniform", "skewed"],
                   help="routing of random-weight models (pdscope_jax.workloads.routing): uniform (equal expert "
                        "shares, independent layers) or skewed (the reference MoE's popularity and affinity)")
    p.add_argument("--predictability", default="reference", type=_predictability,
                   help="what the next layer's gate on this layer's state knows of the next layer's routing: "
                        "'reference' (the reference MoE's Fate-style recall@k per layer pair), 'oracle' (exact) "
                        "or a target recall@k in [0, 1] (docs/WORKLOADS.md)")
    p.add_argument("--hot-table", default=None, help="layer_stats.json, trace directory, or 'auto'")
    p.add_argument("--prompt-lens", nargs="+", type=int, default=[128, 512, 1024, 2048, 4096])
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--batch", nargs="+", type=int, default=[1])
    p.add_argument("--gpu-memory", default="24GB")
    p.add_argument("--expert-pool", default=None, help="cap on the expert slot pool, e.g. 8GB")
    p.add_argument("--accelerators", type=int, default=1, metavar="N",
                   help="run the offloaded policies over N accelerators, each with a pool of --expert-pool and E/N "
                        "experts of every layer (plain runs on one)")
    p.add_argument("--prefill-chunk", type=int, default=256)
    p.add_argument("--hot-per-layer", type=int, default=None,
                   help="resident experts per layer of the policies with a fixed hot set (static; default: the "
                        "pool split evenly)")
    p.add_argument("--cost-table", default=None, help="cost table JSON from `pdscope-jax profile`")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    add_quantize(p)
    add_quality(p)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cpu-threads", type=int, default=None, help="pin the process to this many cores")
    p.add_argument("--xla-cpu-cores", type=int, default=None,
                   help="give XLA:CPU's compute threads this many cores; host threads keep every core "
                        "(runtime.start_backends)")
    p.add_argument("--cpu-view", default="alias", choices=["alias", "copy"],
                   help="CPU experts read pinned memory in place (alias) or from a second host copy")
    p.add_argument("--no-cpu-kernel", action="store_true",
                   help="CPU experts through XLA:CPU only (default: the CPU expert kernel at few rows, where built)")
    p.add_argument("--host-alloc", default="auto", choices=["auto", "jax", "driver"],
                   help="pin expert memory through jax (pinned_host) or the CUDA driver (+dlpack; GPU only); auto: the "
                        "driver on a GPU (store.expert_store)")
    p.add_argument("--track-memory", type=int, default=0, metavar="N", help="also record memory over N decode steps")
    p.add_argument("--cprofile", type=int, default=0, metavar="N",
                   help="also profile (cProfile) one generation of N tokens per run, after the timed ones")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    return p.parse_args(argv)


def _policy_lines() -> str:
    return "\n".join(f"  {name}: {policy.description}" for name, policy in POLICIES.items())


def check_args(args) -> None:
    """Every problem of the options at once (one InputError); reads configs and tables, never weights."""
    from pdscope_jax.cli import checks
    from pdscope_jax.errors import raise_problems

    problems: list[str] = []
    resolved = checks.check_model(problems, "--model", args.model)
    if resolved is not None and resolved[1] is not None and args.workload != "uniform":
        problems.append(f"--workload {args.workload} rewrites random weights, but --model {args.model} is a "
                        "checkpoint that routes as trained: drop --workload or use a preset name")
    if not args.ablation:
        for name in args.policies:
            try:
                policy = PLAIN if name == PLAIN else split_label(name)[0]
            except ValueError as error:
                problems.append(f"--policies: {error}")
                continue
            if policy not in POLICIES and name != PLAIN:
                problems.append(f"--policies: unknown {name!r}; known: {', '.join(POLICIES)}, each with any of the "
                                f"suffixes {', '.join(SUFFIXES)}, {COPY_SHARE}F, {CHUNK}N, {QUALITY}Q, and {PLAIN}")
    checks.check_ints(problems, "--prompt-lens", args.prompt_lens)
    checks.check_ints(problems, "--batch", args.batch)
    for flag, value, low in (("--new-tokens", args.new_tokens, 1), ("--prefill-chunk", args.prefill_chunk, 1),
                             ("--hot-per-layer", args.hot_per_layer, 1), ("--repeats", args.repeats, 1),
                             ("--warmup", args.warmup, 0), ("--track-memory", args.track_memory, 0),
                             ("--cprofile", args.cprofile, 0), ("--accelerators", args.accelerators, 1)):
        checks.check_int(problems, flag, value, low)
    cores = len(os.sched_getaffinity(0))
    checks.check_int(problems, "--cpu-threads", args.cpu_threads, 1, cores)
    checks.check_int(problems, "--xla-cpu-cores", args.xla_cpu_cores, 1, cores)
    checks.check_seed(problems, "--seed", args.seed)
    _check_qualities(problems, args)
    checks.check_size(problems, "--gpu-memory", args.gpu_memory)
    checks.check_size(problems, "--expert-pool", args.expert_pool)
    if args.cost_table is not None:
        from pdscope_jax.sched.costs import CostTableError, load_cost_table

        try:
            load_cost_table(args.cost_table)
        except CostTableError as err:
            problems.append(f"--cost-table: {err}")
    if args.hot_table not in (None, "auto"):
        from pdscope_jax.phaseper.traces import TraceError
        from pdscope_jax.sched.hot import HotTableError, activation_counts

        try:
            activation_counts(args.hot_table)
        except (HotTableError, TraceError) as err:
            problems.append(f"--hot-table: {err}")
    if resolved is not None and isinstance(args.accelerators, int) and args.accelerators >= 1:
        from pdscope_jax.parallel import ExpertParallelError, split_size

        try:
            split_size(resolved[0].num_experts, args.accelerators)
        except ExpertParallelError as err:
            problems.append(f"--accelerators: {err}")
    checks.check_writable_dir(problems, "--out", args.out)
    raise_problems(problems, "bad arguments")


def _check_qualities(problems: list[str], args) -> None:
    """--quality, each run's :quality=Q and --mixed-threshold against --quantize (`sched.precision`)."""
    from pdscope_jax.bench.runs import plan_runs
    from pdscope_jax.sched.precision import quality_problems, threshold_problems

    try:
        qualities = {r.get("quality") for r in plan_runs(args)}
    except ValueError:  # a bad label, reported with --policies
        qualities = {args.quality}
    for quality in sorted(q for q in qualities if q is not None):
        problems += [f"--quality / {QUALITY}{quality}: {p}" for p in quality_problems(quality, args.quantize)]
    if args.mixed_threshold is not None:
        problems += [f"--{p.replace('_', '-')}" for p in threshold_problems(args.mixed_threshold)]


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    check_args(args)
    if args.cpu_threads:
        os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[: args.cpu_threads])
    from pdscope_jax.bench.compare import compare

    return compare(args, shlex.join([sys.argv[0], *(sys.argv[1:] if argv is None else argv)]))


if __name__ == "__main__":
    main()
