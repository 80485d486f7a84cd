"""Host memory shared by the CPU expert kernel and host-to-GPU copies: what each reaches alone and together.

Hybrid decode serves a token's misses from host memory two ways at once: the CPU kernel reads some experts and
the copy engine reads others for the GPU. Their sum is bounded by what the host's memory gives both. This probe
measures, over windows of `--seconds`: the kernel (`kernels.cpu_ffn`, `--per-call` experts of one row a call,
cycling through `--experts` random bf16 experts of DeepSeek-V2-Lite's shape in host memory, so weights come from
DRAM) alone; the copies (`jax.device_put` of `--copy-experts` pinned-host experts to the accelerator, waited for,
repeated) alone; the kernel's raw read (`cpu_ffn.read_bandwidth`); then the kernel and the copies running at the
same time on two threads. Records: GB/s of each part per window and their sum. Random weights.
Run from the repository root: `PYTHONPATH=. python benchmarks/probes/probe_host_bandwidth.py --out F.json`.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from pathlib import Path

import jax
import numpy as np

from _common import emit, memory_shardings, probe_result, random_experts
from pdscope_jax.kernels import cpu_ffn
from pdscope_jax.runtime import select_devices


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--intermediate", type=int, default=1408)
    p.add_argument("--experts", type=int, default=96, help="experts the kernel cycles through")
    p.add_argument("--copy-experts", type=int, default=32, help="experts one round of copies moves")
    p.add_argument("--per-call", type=int, nargs="+", default=[2, 6])
    p.add_argument("--seconds", type=float, default=2.0)
    p.add_argument("--windows", type=int, default=3)
    p.add_argument("--out", type=Path, default=None)
    return p.parse_args()


def kernel_rate(gate_ups, downs, dims, per_call: int, seconds: float, expert_bytes: int) -> float:
    """GB/s of expert bytes the kernel reads over `seconds` (calls of `per_call` experts, 20 at a time)."""
    weights = cpu_ffn.HostWeights(tuple(a.ctypes.data for a in gate_ups), tuple(a.ctypes.data for a in downs))
    times, start = [], time.perf_counter()
    while time.perf_counter() - start < seconds:
        times.append(cpu_ffn.seconds_per_expert(weights, dims, per_call, 1, 20))
    return expert_bytes / statistics.median(times) / 1e9


def copy_rate(pinned, device_sharding, seconds: float) -> float:
    """GB/s of the copies over `seconds`: every pinned expert to the accelerator, waited for, again and again."""
    moved, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        jax.block_until_ready(jax.device_put(pinned, device_sharding))
        moved += sum(a.nbytes for a in jax.tree.leaves(pinned))
    return moved / (time.perf_counter() - start) / 1e9


def together(kernel, copies) -> tuple[float, float]:
    """Both parts on two threads started together -> (kernel GB/s, copies GB/s)."""
    results, gate = {}, threading.Barrier(2)

    def run(name, fn):
        gate.wait()
        results[name] = fn()

    threads = [threading.Thread(target=run, args=("copies", copies))]
    threads[0].start()
    run("kernel", kernel)
    threads[0].join()
    return results["kernel"], results["copies"]


def main() -> None:
    args = parse()
    devices = select_devices()
    if cpu_ffn.library() is None:
        raise SystemExit("the CPU kernel is not built here: nothing to measure")
    d, f = args.hidden, args.intermediate
    gate_ups, downs = random_experts(d, f, args.experts)
    expert_bytes = gate_ups[0].nbytes + downs[0].nbytes
    pinned_sharding, device_sharding = memory_shardings(devices.accel)
    pinned = jax.device_put(list(zip(gate_ups[:args.copy_experts], downs[:args.copy_experts])), pinned_sharding)
    jax.block_until_ready(jax.device_put(pinned, device_sharding))  # compile and touch once
    records: list[dict] = []
    for window in range(args.windows):
        emit(records, {"window": window, "part": "read alone", "gbps": round(cpu_ffn.read_bandwidth(), 1)})
        emit(records, {"window": window, "part": "copies alone",
                       "gbps": round(copy_rate(pinned, device_sharding, args.seconds), 1)})
        for per_call in args.per_call:
            def kernel(per_call=per_call):
                return kernel_rate(gate_ups, downs, (d, f), per_call, args.seconds, expert_bytes)
            alone = kernel()
            both_kernel, both_copies = together(kernel, lambda: copy_rate(pinned, device_sharding, args.seconds))
            emit(records, {"window": window, "part": "kernel", "per_call": per_call, "alone_gbps": round(alone, 1),
                           "with_copies_gbps": round(both_kernel, 1), "copies_gbps": round(both_copies, 1),
                           "sum_gbps": round(both_kernel + both_copies, 1)})
    probe_result("host memory shared by the CPU kernel and host-to-GPU copies", devices, records, args.out,
                 weights="random", threads=cpu_ffn.threads(), isa=cpu_ffn.isa(), expert_bytes=expert_bytes)


if __name__ == "__main__":
    main()
