"""Where the host experts' time goes inside the engine's one-program decode step (the CUDA bridge), per kernel setting.

Builds the offloaded model once (`--model` with seeded random weights, `--workload`, the bench's budget, device
decode), then for every kernel setting `THREADS/GROUPS/SPIN_US/STREAM` (`--settings`, e.g. `16/1/200/0`: the
pool's threads and groups per thread (0: the package's default), microseconds an idle pool thread spins before it
sleeps, the streamed few-row path) and every run label (`--runs`, the bench's labels: a bare policy runs the
package's defaults; `pdscope:copy=0` copies misses only into free slots, so the decode bank, left empty at decode
start, fills with them, and sends the rest to the host) runs the engine's warm-up, one untimed streamed generation
(its decode chunks compile there), and `--repeats` generations of `--tokens` new tokens after a `--prompt-len` prompt.
With `--side-effects 1 0` every setting runs twice: the bridge's calls declared side-effecting, then not; with
`--samplers select conditional`, once with the package's sampler, once with one holding conditionals.
Reports per (setting, run): decode tok/s (median), the host's ms in the decode step's jitted call alone
(`launch_ms_median`: arguments, launches and any wait inside the program; `dispatch_ms_median` also holds the wait
for the token two steps back, so it equals the step whenever the GPU is the bottleneck), the greedy tokens and
whether they equal the first run's, bridge faults, host experts per step, the bridge worker's ms per host expert,
programs compiled inside each timed repeat (`compiled_in_run`: 0 when warm-up compiled them all), and the kernel's
profile over the decode steps only (ms per call: wall time of the compute, the mean and the slowest group; the
slowest far above the mean means threads that started late or were preempted), the bridge's per-layer timeline (host
compute, and the GPU's part between two host parts), the CPU seconds of the process's busiest threads (by name) and
the cgroup's CPU throttling over the decode. Outside the engine, in the same process, per setting: the kernel alone
on the store's own experts (one row, k = 1, 2, 6 experts of random layers, no GPU work) in GB/s of expert bytes, and
the pool's read bandwidth. With `--trace DIR`, each run's decode of `--trace-tokens` more tokens is recorded by
jax's profiler (Perfetto trace per run: the GPU's kernels and idle gaps beside the launching thread). Run from the
repository root: `PYTHONPATH=. python benchmarks/probes/probe_host_experts_engine.py --out F.json`. Random weights.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import numpy as np


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="deepseek-v2-lite")
    p.add_argument("--runs", nargs="+", default=["pdscope:copy=0", "pdscope:cpu", "pdscope:nocpu"])
    p.add_argument("--settings", nargs="+", default=["0/0/200/0"],
                   help="THREADS/GROUPS/SPIN_US/STREAM; 0 threads or groups: the package's default")
    p.add_argument("--side-effects", nargs="+", type=int, default=[0],
                   help="1: the bridge's calls declared side-effecting (jax's Python dispatch path); 0: not")
    p.add_argument("--samplers", nargs="+", default=["select"], choices=["select", "conditional"],
                   help="the decode step's sampler: the package's branch-free one, or one with conditionals "
                        "(sampler_variants)")
    p.add_argument("--workload", default="uniform", choices=["uniform", "skewed"])
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--gpu-memory", default="24GB")
    p.add_argument("--trace", type=Path, default=None,
                   help="after each run's repeats, one more decode of --trace-tokens tokens under jax's profiler; "
                        "its Perfetto trace is written to TRACE/<run>.trace.json.gz")
    p.add_argument("--trace-tokens", type=int, default=6)
    p.add_argument("--out", type=Path, default=None)
    return p.parse_args(argv)


CPU_STAT = (Path("/sys/fs/cgroup/cpu.stat"), Path("/sys/fs/cgroup/cpu/cpu.stat"),
            Path("/sys/fs/cgroup/cpu,cpuacct/cpu.stat"))


def cpu_limits() -> dict:
    """This process's CPUs, and its cgroup's CPU quota (a quota throttles spinning threads) where readable."""
    out = {"affinity": len(os.sched_getaffinity(0)), "cpu_count": os.cpu_count()}
    for path in (Path("/sys/fs/cgroup/cpu.max"), Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us")):
        if path.exists():
            out[path.name] = path.read_text().strip()
    return out


def throttling() -> dict:
    """The cgroup's throttling counters ({} where none is readable)."""
    for path in CPU_STAT:
        if path.exists():
            pairs = (line.split() for line in path.read_text().splitlines())
            return {k: int(v) for k, v in pairs if k.startswith(("nr_throttled", "throttled", "nr_periods"))}
    return {}


def thread_cpu() -> dict[str, float]:
    """CPU seconds used so far by this process's threads, summed per thread name."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    for task in Path("/proc/self/task").iterdir():
        try:
            stat = (task / "stat").read_text()
        except OSError:  # the thread ended
            continue
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return out


def layer_timeline(runner, since_ns: int) -> dict | None:
    """The bridge's layers served since `since_ns` (time.monotonic_ns), summarised: per MoE position the median
    ms the host computed (go -> done) and the median ms from the previous layer's done to this layer's go (the
    GPU's part between two host parts: combining, the next layer's attention and routing, and both waits; for
    position 0, across the step boundary); the medians over all layers; experts per layer."""
    bridges = [b for b in runner.host_split.bridges.values() if b is not None]
    if not bridges:
        return None
    rows = bridges[0].timeline()
    rows = rows[rows[:, 2] >= since_ns]
    if len(rows) < 2:
        return None
    layer, experts, go, done = rows.T
    compute = (done - go) / 1e6
    gap = np.r_[np.nan, (go[1:] - done[:-1]) / 1e6]
    positions = sorted(set(layer.tolist()))
    per = {"compute_ms": [float(np.median(compute[layer == m])) for m in positions],
           "gap_before_ms": [float(np.nanmedian(gap[layer == m])) for m in positions],
           "experts": [float(np.mean(experts[layer == m])) for m in positions]}
    inner = gap[1:][layer[1:] != positions[0]]
    return {"layers": int(len(rows)), "compute_ms_median": float(np.median(compute)),
            "gap_ms_median": float(np.median(inner)), "step_boundary_ms_median": float(np.nanmedian(
                gap[layer == positions[0]])), "experts_per_layer": float(np.mean(experts)), "per_position": per}


def apply_setting(setting: str) -> dict:
    """Set the kernel's pool (threads, spin), groups per thread and streamed path; -> the setting as a dict."""
    from pdscope_jax.kernels import cpu_ffn

    threads, groups, spin_us, stream = (int(v) for v in setting.split("/"))
    os.environ["PDSCOPE_CPU_FFN_SPIN_US"] = str(spin_us)  # read when the pool is made
    return {"threads": cpu_ffn.set_threads(threads), "groups": cpu_ffn.set_groups(groups), "spin_us": spin_us,
            "stream": cpu_ffn.set_stream(bool(stream))}


def kernel_alone(store, cfg) -> dict:
    """GB/s of expert bytes of the kernel alone (no GPU work), one row, on the store's experts (those the host split
    times), per experts in a call; and the pool's read bandwidth."""
    from pdscope_jax.engine.host_split import kernel_seconds_per_expert
    from pdscope_jax.kernels import cpu_ffn

    figures = {}
    for k in (1, 2, 6):
        seconds = kernel_seconds_per_expert(store, cfg, k, repeats=30)
        figures[f"k{k}"] = {"ms": 1e3 * seconds * k, "gb_s": cfg.expert_bytes(2) / seconds / 1e9}
    figures["read_gb_s"] = cpu_ffn.read_bandwidth(1 << 30, 3)
    return figures


def trace_decode(runner, prompt, tokens: int, out: Path) -> None:
    """One generation of `tokens` tokens whose decode steps (prefill excluded) run under jax's profiler; the
    Perfetto trace goes to `out`."""
    from _common import perfetto_trace

    steps = runner.steps(prompt, tokens)
    next(steps)  # prefill and the first token, outside the trace

    def decode():
        for sampled in steps:
            np.asarray(sampled.token)

    perfetto_trace(decode, out)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    import jax
    import jax.numpy as jnp

    from _common import probe_result, random_loader
    from pdscope_jax import models
    from pdscope_jax.api import resolve
    from pdscope_jax.bench.runs import split_label
    from pdscope_jax.engine.decode import DeviceDecode
    from pdscope_jax.engine.runner import OffloadRunner
    from pdscope_jax.kernels import cpu_ffn, host_experts
    from pdscope_jax.runtime import RuntimeConfig
    from pdscope_jax.workloads import routing as workloads

    cfg, _ = resolve(args.model)
    dtype = jnp.bfloat16
    shapes = models.abstract_state(cfg, dtype)
    loader = random_loader(shapes, 0, workloads.design(cfg, args.workload, seed=0))
    rc = RuntimeConfig(gpu_memory=args.gpu_memory, policy="ondemand", max_seq_len=args.prompt_len + args.tokens + 1)
    runner = OffloadRunner(models.abstract_model(cfg, dtype), rc, loader)
    print(json.dumps({"budget": runner.budget.describe(), "slots": runner.pool.num_slots,
                      "host_alloc": runner.store.host_alloc, "cpu": cpu_limits()}), flush=True)
    prompt = np.random.default_rng(0).integers(0, cfg.vocab_size, (1, args.prompt_len)).astype(np.int32)
    records = []
    step_host: list[float] = []
    run_step = DeviceDecode.step

    def timed_step(self, n):  # host seconds inside one decode step's dispatch
        start = time.perf_counter()
        run_step(self, n)
        step_host.append(time.perf_counter() - start)

    DeviceDecode.step = timed_step
    step_launch: list[float] = []

    class TimedLaunch:  # host seconds in the decode step's jitted call alone (arguments, launches, in-program waits)
        def __init__(self, jitted):
            self.jitted, self._cache_size = jitted, jitted._cache_size

        def __call__(self, *args):
            start = time.perf_counter()
            out = self.jitted(*args)
            step_launch.append(time.perf_counter() - start)
            return out

    runner._decode_step = TimedLaunch(runner._decode_step)
    import sampler_variants

    for sampler, side_effect, setting in ((k, e, s) for k in args.samplers for e in args.side_effects
                                          for s in args.settings):
        sampler_variants.use(sampler)  # clears jax's caches: the decode step is traced again
        if host_experts.SIDE_EFFECT != bool(side_effect):
            host_experts.SIDE_EFFECT = bool(side_effect)
            jax.clear_caches()  # the decode step is traced again with the other declaration
        applied = apply_setting(setting)
        alone = kernel_alone(runner.store, cfg)
        print(json.dumps({"setting": setting, **applied, "kernel_alone": alone}), flush=True)
        for label in args.runs:
            policy, switches = split_label(label)
            defaults = {"decode_cpu_experts": RuntimeConfig.decode_cpu_experts, "decode_copy_share": None,
                        "decode_bridge_copies": True, "decode_copies_ahead": RuntimeConfig.decode_copies_ahead,
                        "decode_chunk": RuntimeConfig.decode_chunk}
            # a label's switches only: nothing carries over from the last
            runner.set_policy(policy, **{**defaults, **switches})
            runner.warmup(1, args.prompt_len, args.tokens)
            for _ in runner.steps(prompt, args.tokens):  # warmup compiles a whole run's chunks, not a streamed
                pass  # run's (chunks of decode.STREAM_CHUNK): they compile here, not in the first timed repeat
            tok_s, profiles, host = [], [], []
            for _ in range(args.repeats):
                runner.reset_stats()
                compiled_before = runner.compiled_programs["total"]
                before = {b: s["seconds"] for b, s in runner.host_split.stats()["bridges"].items()}
                steps = runner.steps(prompt, args.tokens)
                tokens = [int(np.asarray(next(steps).token)[0])]  # prefill and the first token
                throttled, threads_before, since = throttling(), thread_cpu(), time.monotonic_ns()
                cpu_ffn.profile(True)
                step_host.clear()
                step_launch.clear()
                start = time.perf_counter()
                for sampled in steps:
                    tokens.append(int(np.asarray(sampled.token)[0]))
                seconds = time.perf_counter() - start
                cpu_ffn.profile(False)
                throttled = {k: v - throttled[k] for k, v in throttling().items()}
                busiest = sorted(((v - threads_before.get(k, 0.0), k) for k, v in thread_cpu().items()), reverse=True)
                profiles.append(cpu_ffn.profile_read())
                decode = runner.phase_stats["decode"]
                busy = sum(s["seconds"] - before.get(b, 0.0) for b, s in runner.host_split.stats()["bridges"].items())
                tok_s.append((args.tokens - 1) / seconds)
                host.append({"host_experts": decode.cpu_experts, "gpu_experts": decode.gpu_experts,
                             "hit_rate": decode.hit_rate, "bridge_seconds": busy, "tokens": tokens,
                             "prediction_recall": decode.prediction_recall,
                             "prefetch_accuracy": decode.prefetch_accuracy,
                             "gb_moved_per_token": decode.bytes_moved / 1e9 / (args.tokens - 1),
                             "throttled": throttled, "decode_seconds": seconds,
                             "compiled_in_run": runner.compiled_programs["total"] - compiled_before,
                             "thread_cpu_seconds": {k: round(v, 3) for v, k in busiest[:8]},
                             "dispatch_ms_median": 1e3 * statistics.median(step_host) if step_host else None,
                             "launch_ms_median": 1e3 * statistics.median(step_launch) if step_launch else None,
                             "timeline": layer_timeline(runner, since)})
            if args.trace is not None:
                trace_decode(runner, prompt, args.trace_tokens, args.trace / f"{label.replace(':', '_')}.trace.json.gz")
            last = host[-1]
            record = {"setting": setting, **applied, "side_effect": bool(side_effect), "sampler": sampler,
                      "run": label,
                      "dispatch_ms_median": last["dispatch_ms_median"], "launch_ms_median": last["launch_ms_median"],
                      "decode_tok_s": statistics.median(tok_s),
                      "decode_tok_s_repeats": tok_s,
                      **{k: last[k] for k in ("prediction_recall", "prefetch_accuracy", "gb_moved_per_token")},
                      "host_experts_per_step": last["host_experts"] / (args.tokens - 1),
                      "ms_per_host_expert": (1e3 * last["bridge_seconds"] / last["host_experts"]
                                             if last["host_experts"] else None),
                      "hit_rate": last["hit_rate"], "kernel_profile_ms": profiles[-1], "throttled": last["throttled"],
                      "thread_cpu_seconds": last["thread_cpu_seconds"],
                      "timeline": {k: v for k, v in (last["timeline"] or {}).items() if k != "per_position"},
                      "repeats": host,
                      "kernel_alone": alone, "why_not": runner.host_split.why_not,
                      "bridge_faults": sum(s["faults"] for s in runner.host_split.stats()["bridges"].values()),
                      "tokens": last["tokens"],
                      "same_tokens_as_first_run": records[0]["tokens"] == last["tokens"] if records else True}
            print(json.dumps({k: v for k, v in record.items() if k not in ("repeats", "kernel_alone", "tokens")}),
                  flush=True)
            records.append(record)
    return probe_result("host experts inside the one-program decode step, per kernel setting (random weights)",
                        runner.devices, records, args.out, model=cfg.name, weights="random (seeded, seed 0)",
                        workload=args.workload, prompt_len=args.prompt_len, tokens=args.tokens,
                        budget={"gpu_memory": args.gpu_memory, "slots": runner.pool.num_slots}, cpu=cpu_limits())


if __name__ == "__main__":
    main()
