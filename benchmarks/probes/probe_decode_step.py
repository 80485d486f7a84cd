"""Where a device-decode step spends its time on the accelerator, beyond copying the missed experts.

Decode runs as one program per step (`pdscope_jax/engine/device_decode.py`). This probe builds a chain of
`--layers` stand-in MoE layers in one program, each: four [D, D] matmuls where attention would be, a random
router, top-k, then the engine's own `device_decode._routed_experts` on a slot pool of `--slots` slots (misses
copied from one pinned [E, D, 2F] / [E, F, D] stack shared by the layers, LRU residency). The pool starts full.
Variants (`--variants`):
  resident  every expert of every layer in the pool: no copies, the cost of everything else;
  engine    the engine as it is;
  fixed     `device_decode.pull_traced` replaced by a fixed count of copies and no conditional (timing only: its
            output is wrong whenever a layer misses more experts than it copies).
Each variant runs --warmup steps, then --reps steps with a fresh random input row each, timed one by one (waited
for). Reported per variant: median and minimum ms per step, compile seconds, misses per step (the table's
counters), the loops, conditionals and whole-pool copies in its HLO, and the copy rate the difference to
`resident` implies. XLA_FLAGS is recorded: run it under different flags to compare. With --profile-steps N, N
more steps run under `jax.profiler.trace` and the record gets the accelerator's kernels per step
(`kernel_profile`). Random weights.
Run from the repository root: `PYTHONPATH=. python benchmarks/probes/probe_decode_step.py [--out FILE]`.
Writes one JSON line per variant to stdout and, with --out, the result of `_common.probe_result` as JSON.
"""

from __future__ import annotations

import collections
import os
import re
import statistics
import tempfile
import time
from pathlib import Path

from _common import emit, expert_shape_parser, memory_shardings, probe_result

VARIANTS = ("resident", "engine", "fixed")


def main(argv: list[str] | None = None) -> dict:
    parser = expert_shape_parser(__doc__.splitlines()[0], reps=30)
    parser.add_argument("--num-experts", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=6)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--slots", type=int, default=213,
                        help="pool slots (default: 28 %% of 12 x 64, the share of DeepSeek-V2-Lite's experts that "
                             "the bench's 8 GB pool holds)")
    parser.add_argument("--fixed-copies", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    parser.add_argument("--profile-steps", type=int, default=0, help="steps traced per variant (0: no profile)")
    args = parser.parse_args(argv)
    from pdscope_jax.runtime import request_cpu_stand_in, select_devices

    request_cpu_stand_in()
    import jax
    import jax.numpy as jnp
    import numpy as np

    from pdscope_jax.engine import device_decode, pool_table

    devices = select_devices()
    accel = devices.accel
    pinned, _ = memory_shardings(accel)
    e, d, f, k, layers = args.num_experts, args.hidden, args.intermediate, args.top_k, args.layers
    rng = np.random.default_rng(0)
    normal = lambda *shape: (rng.standard_normal(shape, np.float32) * 0.02).astype(jnp.bfloat16)
    stack = (jax.device_put(normal(e, d, 2 * f), pinned), jax.device_put(normal(e, f, d), pinned))
    attention = jax.device_put(normal(layers, 4, d, d), accel)
    routers = jax.device_put(normal(layers, d, e), accel)
    weights = stack, attention, routers  # arguments, not constants folded into the program
    expert_bytes = (d * 2 * f + f * d) * 2

    def fresh_pool(slots):
        """A full pool: slot s holds expert s % E of MoE position s // E (its weights from the shared stack)."""
        owners = min(slots, layers * e)
        slot_of = np.full((layers, e), -1, np.int32)
        slot_of.reshape(-1)[:owners] = np.arange(owners)
        owner = np.where(np.arange(slots) < owners, np.arange(slots), -1).astype(np.int32)
        table = pool_table.PoolTable(slot_of, owner, np.where(owner >= 0, 0, -1).astype(np.int32),
                                     np.full((layers, e), -1, np.int32), np.int32(1),
                                     np.zeros(len(pool_table.COUNTS), np.int32), np.zeros((layers, e), np.int32))
        experts_of = np.arange(slots) % e
        pool = tuple(jax.device_put(np.asarray(a)[experts_of], accel) for a in stack)
        return pool, jax.device_put(table, accel)

    def fixed_pull(experts, order, n_miss, resident):
        c = min(args.fixed_copies, order.shape[0])
        out = []
        for a, kept in zip(experts, resident(jnp.arange(c, order.shape[0]))):
            got = [jax.device_put(jax.lax.dynamic_index_in_dim(a, order[i], keepdims=False), jax.memory.Space.Device)
                   for i in range(c)]
            out.append(jnp.concatenate([jnp.stack(got), kept]))
        return tuple(out)

    def step(x, pool_gu, pool_dn, table, stack, attention, routers):  # traced anew per variant (a new lambda)
        for m in range(layers):
            h = x
            for w in attention[m]:
                h = jnp.tanh(jnp.dot(h, w, preferred_element_type=jnp.float32)).astype(x.dtype)
            weights, ids = jax.lax.top_k(jnp.dot(h, routers[m], preferred_element_type=jnp.float32), k)
            y, ((pool_gu, pool_dn),), table, _ = device_decode._routed_experts(m, h, jax.nn.softmax(weights), ids,
                                                                            stack, ((pool_gu, pool_dn),), table)
            x = (x + y).astype(x.dtype)
        return x, pool_gu, pool_dn, table

    records = []
    resident_ms = None
    for variant in args.variants:
        slots = layers * e + 1 if variant == "resident" else args.slots
        saved = device_decode.pull_traced
        if variant == "fixed":
            device_decode.pull_traced = fixed_pull
        try:
            program = jax.jit(lambda *a: step(*a), donate_argnums=(1, 2, 3))
            (pool_gu, pool_dn), table = fresh_pool(slots)
            start = time.perf_counter()
            compiled = program.lower(normal(1, d), pool_gu, pool_dn, table, *weights).compile()
            compile_s = time.perf_counter() - start
        finally:
            device_decode.pull_traced = saved
        times, counts = [], []
        for i in range(args.warmup + args.reps):
            x = jax.device_put(normal(1, d) * 50, accel)
            before = np.asarray(table.counts)
            start = time.perf_counter()
            x, pool_gu, pool_dn, table = compiled(x, pool_gu, pool_dn, table, *weights)
            x.block_until_ready()
            if i >= args.warmup:
                times.append(time.perf_counter() - start)
                counts.append(np.asarray(table.counts) - before)
        activated, hits = (np.sum(counts, axis=0) / len(counts))[:2]
        hlo = compiled.as_text()
        record = {"variant": variant, "slots": slots, "layers": layers, "compile_s": round(compile_s, 2),
                  "ms_per_step": 1e3 * statistics.median(times), "ms_min": 1e3 * min(times),
                  "activated_per_step": float(activated), "misses_per_step": float(activated - hits),
                  "loops_in_hlo": hlo.count(" while("),
                  "conditionals_in_hlo": hlo.count(" conditional("),
                  "pool_copies_in_hlo": len(re.findall(  # instructions of the pool's shape that copy it
                      rf"%\S*copy\S* = bf16\[{slots},{d},{2 * f}\]|bf16\[{slots},{d},{2 * f}\]\S* copy\(", hlo))}
        if args.profile_steps:
            def run_steps():
                nonlocal pool_gu, pool_dn, table
                for _ in range(args.profile_steps):
                    x, pool_gu, pool_dn, table = compiled(jax.device_put(normal(1, d), accel), pool_gu, pool_dn,
                                                          table, *weights)
                    x.block_until_ready()
            record["kernel_profile"] = kernel_profile(run_steps, args.profile_steps)
        if variant == "resident":
            resident_ms = record["ms_per_step"]
        elif resident_ms is not None and record["misses_per_step"] > 0:
            extra_s = (record["ms_per_step"] - resident_ms) / 1e3
            record["implied_copy_gb_per_s"] = record["misses_per_step"] * expert_bytes / max(extra_s, 1e-9) / 1e9
        emit(records, record)
        del pool_gu, pool_dn, table
    return probe_result("device decode step: time beyond the copies (random weights)", devices, records, args.out,
                        hidden=d, intermediate=f, num_experts=e, top_k=k, expert_bytes=expert_bytes,
                        xla_flags=os.environ.get("XLA_FLAGS", ""))


def kernel_profile(run_steps, steps: int, top: int = 25) -> dict:
    """Trace `run_steps()` (which runs `steps` steps) and summarise the kernels the accelerator ran: per step, busy
    microseconds and kernel count; the `top` kinds by time (microseconds and launches per step) twice: by the HLO
    op an event names (a command buffer holds many kernels) and by the kernel's own name. A kind is a name without
    its instance number (`.N` or `_N`), so every layer's instance counts together. Events are those of the planes
    named '/device:...' (on a CPU stand-in, which has none, the events that name an HLO op)."""
    import jax
    from jax.profiler import ProfileData

    with tempfile.TemporaryDirectory() as directory:
        with jax.profiler.trace(directory):
            run_steps()
        (trace,) = Path(directory).rglob("*.xplane.pb")
        data = ProfileData.from_file(str(trace))
    device_planes = [plane for plane in data.planes if plane.name.startswith("/device:")]
    kind = lambda name: re.sub(r"[._]\d+$", "", name)  # noqa: E731
    times = {"by_hlo_op": collections.Counter(), "by_kernel": collections.Counter()}
    launches = {key: collections.Counter() for key in times}
    busy_ns = count = 0
    for plane in device_planes or data.planes:
        for line in plane.lines:
            for event in line.events:
                stats = dict(event.stats)
                if not device_planes and "hlo_op" not in stats:
                    continue
                for key, name in (("by_hlo_op", str(stats.get("hlo_op", event.name))), ("by_kernel", event.name)):
                    times[key][kind(name)] += event.duration_ns
                    launches[key][kind(name)] += 1
                busy_ns += event.duration_ns
                count += 1
    return {"planes": [plane.name for plane in device_planes] or "none named /device: (HLO-op events of every plane)",
            "busy_us_per_step": busy_ns / 1e3 / steps, "kernels_per_step": count / steps,
            **{key: [{"name": name, "us_per_step": ns / 1e3 / steps, "launches_per_step": launches[key][name] / steps}
                     for name, ns in times[key].most_common(top)] for key in times}}


if __name__ == "__main__":
    main()
