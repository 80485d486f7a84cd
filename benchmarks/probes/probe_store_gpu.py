"""Probe the expert-store design on the accelerator; prints one JSON object per finding.

Run from the repository root on the GPU node (several GB of host and GPU memory at the default sizes):
    PYTHONPATH=. python benchmarks/probes/probe_store_gpu.py [--layers 4] [--out probe_store.json]
On a CPU-only machine cpu:1 stands in for the GPU; small sizes (e.g. `--experts 8 --hidden 64 --intermediate 32
--matmul 256`) smoke-test the script, not the hardware.
What it checks, DeepSeek-V2-Lite expert shape by default (gate_up [2048, 2816], down [1408, 2048], bf16, random):
1. placement: `ExpertStore.add_layer` puts experts in the GPU's pinned_host memory (`--host-alloc jax`, or memory
   page-locked by the CUDA driver imported through dlpack with `--host-alloc driver`); host RSS growth per model
   byte (target 1.0: no second copy for the CPU backend), build time; with jax, whether the driver route works too;
2. zero-copy CPU view: does every CPU-backend view alias the pinned bytes (`host_bytes_per_model_byte`)? and
   does the view read the right values?
3. slot writes: bandwidth of `ExpertStore.write` (stage + commit) for 1, 8 and `--experts` experts, in place
   (pool address unchanged), and the device memory peak it adds (staged arrays);
4. overlap with GPU compute (a loop of 40 `--matmul`-sized matmuls) of staging a whole layer (one batched
   device_put: the engine's transfer) issued before the compute, after it, from a second thread, and of stage +
   commit into the pool before the compute; the commit's own (device-to-device) time;
5. CPU experts on the aliased views while a write runs (the engine's prefill pattern).
Writes: the findings ({what, ...}) as JSON lines to stdout and, with --out, as one JSON list.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import threading
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import psutil

from _common import emit
from pdscope_jax.bench.timing import median_seconds
from pdscope_jax.engine.cpu_experts import CpuExperts
from pdscope_jax.runtime import select_devices
from pdscope_jax.store.expert_store import ExpertStore
from pdscope_jax.store.host_addresses import host_view
from pdscope_jax.store.slot_pool import SlotPool


def median_ms(fn, reps: int = 5, warm: int = 2) -> float:
    return median_seconds(fn, reps, warm) * 1e3


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=1408)
    parser.add_argument("--matmul", type=int, default=8192, help="side of the GPU matmul the transfer hides behind")
    parser.add_argument("--cpu-view", default="alias", choices=["alias", "copy"])
    parser.add_argument("--host-alloc", default="jax", choices=["jax", "driver"])
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    found: list[dict] = []

    def finding(**row):
        emit(found, row)

    E, D, F = args.experts, args.hidden, args.intermediate  # noqa: N806 (the file's shape letters)
    dev = select_devices()
    finding(what="env", command=shlex.join(["python", "benchmarks/probes/probe_store_gpu.py",
                                            *(argv if argv is not None else sys.argv[1:])]),
            jax=jax.__version__, accel=str(dev.accel), cpu=str(dev.cpu),
            accel_memories=[str(m) for m in dev.accel.addressable_memories()])

    # 1-2. placement and CPU views
    proc = psutil.Process()
    rng = np.random.default_rng(0)
    gu = (rng.standard_normal((E, D, 2 * F), np.float32) * 0.02).astype(jnp.bfloat16)  # [E, D, 2F]
    dn = (rng.standard_normal((E, F, D), np.float32) * 0.02).astype(jnp.bfloat16)  # [E, F, D]
    rss0 = proc.memory_info().rss
    store = ExpertStore(dev, cpu_view=args.cpu_view, host_alloc=args.host_alloc)
    start = time.perf_counter()
    for layer in range(args.layers):
        store.add_layer(layer, gu, dn)
    build_s = time.perf_counter() - start
    rss_growth = proc.memory_info().rss - rss0
    finding(what="placement", host_alloc=args.host_alloc, layers=args.layers, model_bytes=store.host_bytes,
            build_s=build_s, rss_growth_bytes=rss_growth, rss_growth_per_model_byte=rss_growth / store.host_bytes,
            host_bytes_per_model_byte=store.host_bytes_per_model_byte, cpu_copy_bytes=store.cpu_copy_bytes,
            pinned_memory_kind=store.host_weights(0, 0)[0].sharding.memory_kind)
    probe_layer, probe_expert = min(1, args.layers - 1), E - 1
    pinned, _ = store.host_weights(probe_layer, probe_expert)
    view = host_view(pinned)
    on_cpu, _ = store.cpu_weights(probe_layer, probe_expert)
    want = np.asarray(gu[probe_expert])
    finding(what="cpu_view", view_available=view is not None,
            view_matches=bool(view is not None and np.array_equal(view, want)),
            cpu_array_aliases=on_cpu.unsafe_buffer_pointer() == pinned.unsafe_buffer_pointer(),
            cpu_array_matches=bool(np.array_equal(np.asarray(on_cpu), want)))

    if args.host_alloc == "jax":  # the other route to one host copy, on one layer, through the CUDA driver
        try:
            other = ExpertStore(dev, host_alloc="driver")
            other.add_layer(0, gu, dn)
            pinned_t, _ = other.host_weights(0, probe_expert)
            finding(what="placement_driver", ok=True, memory_kind=pinned_t.sharding.memory_kind,
                    device=str(next(iter(pinned_t.devices()))),
                    host_bytes_per_model_byte=other.host_bytes_per_model_byte,
                    values_match=bool(np.array_equal(np.asarray(other.cpu_weights(0, probe_expert)[0]), want)))
            del other, pinned_t
        except Exception as err:  # noqa: BLE001 (a probe reports any failure of this route and goes on)
            finding(what="placement_driver", ok=False, error=f"{type(err).__name__}: {err}"[:400])

    # 3. slot writes
    pool = SlotPool(2 * E, tuple(range(args.layers)), E, D, F, jnp.bfloat16, dev.accel)
    address = pool.gate_up.unsafe_buffer_pointer()
    stats0 = dev.accel.memory_stats() or {}
    for n in sorted({1, min(8, E), E}):
        experts = np.arange(n)
        slots = np.arange(n, dtype=np.int32)

        def write():
            store.write(pool, 0, experts, slots)
            pool.gate_up.block_until_ready()

        ms = median_ms(write)
        nbytes = n * 3 * D * F * 2
        finding(what="slot_write", experts=n, ms=ms, GBps=nbytes / ms / 1e6)
    stats1 = dev.accel.memory_stats() or {}
    finding(what="slot_write_in_place", same_address=pool.gate_up.unsafe_buffer_pointer() == address,
            pool_bytes=pool.gate_up.nbytes + pool.down.nbytes,
            peak_bytes_before=stats0.get("peak_bytes_in_use"), peak_bytes_after=stats1.get("peak_bytes_in_use"),
            bytes_in_use=stats1.get("bytes_in_use"))

    # 4. overlap with GPU compute: the engine stages the next layer (one batched device_put) before dispatching
    # compute, then commits it into the pool (device-to-device) when the layer starts
    a = jax.device_put(jnp.asarray(rng.standard_normal((args.matmul, args.matmul), np.float32), jnp.bfloat16),
                       dev.accel)
    matmuls = jax.jit(lambda a: jax.lax.fori_loop(0, 40, lambda i, x: (x @ a) * 1e-4, a))
    layer = min(2, args.layers - 1)
    experts, slots = np.arange(E), np.arange(E, 2 * E, dtype=np.int32)

    def stage():
        return store.stage(layer, experts)

    def write_layer():
        store.write(pool, layer, experts, slots)
        return pool.gate_up

    def stage_before():
        staged = stage()
        jax.block_until_ready((matmuls(a), staged.gate_ups, staged.downs))

    def stage_after():
        r = matmuls(a)
        staged = stage()
        jax.block_until_ready((r, staged.gate_ups, staged.downs))

    def stage_in_thread():
        t = threading.Thread(target=lambda: jax.block_until_ready(stage().gate_ups))
        t.start()
        matmuls(a).block_until_ready()
        t.join()

    def write_before():
        w = write_layer()  # stage + commit into the pool, both before the compute
        jax.block_until_ready((matmuls(a), w))

    compute_ms = median_ms(lambda: matmuls(a).block_until_ready())
    stage_ms = median_ms(lambda: jax.block_until_ready(stage().gate_ups))
    staged = stage()
    jax.block_until_ready(staged.gate_ups)

    def commit():
        store.commit(pool, staged, slots)
        pool.gate_up.block_until_ready()

    finding(what="overlap_base", compute_ms=compute_ms, stage_layer_ms=stage_ms,
            stage_GBps=staged.nbytes / stage_ms / 1e6, commit_layer_ms=median_ms(commit))
    for name, fn in (("stage_before_compute", stage_before), ("stage_after_compute", stage_after),
                     ("stage_in_thread", stage_in_thread), ("stage_and_commit_before_compute", write_before)):
        both = median_ms(fn)
        finding(what="overlap", variant=name, both_ms=both,
                hidden_fraction=max(0.0, min(1.0, (compute_ms + stage_ms - both) / stage_ms)))
    staged = None  # frees the staged layer before the next measurements
    write_ms = median_ms(lambda: write_layer().block_until_ready())

    # 5. CPU experts on aliased views during a write
    cpu_experts = CpuExperts(store)
    h = jax.device_put(jnp.asarray(rng.standard_normal((256, D), np.float32), jnp.bfloat16), dev.cpu)
    n_cpu = min(16, E)
    groups = [(e, np.arange(16 * e, 16 * e + 16), np.full(16, 0.1, np.float32)) for e in range(n_cpu)]
    last = args.layers - 1
    cpu_ms = median_ms(lambda: cpu_experts.dispatch(last, h, groups).block_until_ready(), reps=3)

    def cpu_and_write():
        w = write_layer()
        y = cpu_experts.dispatch(last, h, groups)
        jax.block_until_ready((w, y))

    finding(what="cpu_experts_during_write", cpu_experts=n_cpu, cpu_ms=cpu_ms, write_layer_ms=write_ms,
            both_ms=median_ms(cpu_and_write, reps=3))
    if args.out:
        args.out.write_text(json.dumps(found, indent=1))
    return found


if __name__ == "__main__":
    main()
