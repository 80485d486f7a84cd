"""Ways of issuing a decode layer's expert copies, and what each holds the host for.

Why: at batch 1 every MoE layer issues its missed experts' copies, and the issuing thread is held while it does.
For k experts of one layer (DeepSeek-V2-Lite shape by default, bf16, random weights) it measures the time the
issuing thread is held (`issue`) and the time until the copy is done (`done`), for:
  - `put_pairs`: one batched `jax.device_put` of the 2k pinned arrays (gate_up and down apart; the engine's way);
  - `put_merged`: one batched `device_put` of k pinned arrays, one per expert ([D, 3F]: gate_up and down
    transposed side by side);
  - `jit_pull`: one jitted program whose 2k pinned operands it moves to device memory itself;
  - `jit_pull_commit`: the same program writing them into a donated slot pool (stage and commit in one call);
  - `put_then_commit`: the engine's two calls, the batched `device_put` then the jitted donated commit;
  - `thread_put`: the batched `device_put` handed to a helper thread (`issue` = the submit).
And `cpu_alone` / `cpu_beside_copy`: k experts computed on the CPU backend (8 rows, one program), alone and
while a batched copy of the other experts to the accelerator is in flight (`done` = the CPU part's time).
Also the dispatch floor of a trivial jitted call with 1 and with 32 device operands, and the round trip of a
small program whose three outputs the host fetches (`route_roundtrip`, as the engine's routing fetch does) and
of the same outputs packed into one array (`route_roundtrip_packed`). Every figure is a median over --reps.
Run from the repository root: `PYTHONPATH=. python benchmarks/probes/probe_copy_issue.py [--out FILE]`.
Writes one JSON line per record to stdout ({kind, experts, issue_ms, done_ms, GBps}) and, with --out, the
result of `_common.probe_result` (command, accelerator, jax, expert shape, records) as JSON.
"""

from __future__ import annotations

import concurrent.futures
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from _common import (emit, expert_setup, expert_shape_parser, held, issue_and_done, many_experts, memory_shardings,
                     probe_result)
from pdscope_jax.runtime import select_devices


def _pull(*pinned):
    return tuple(jax.device_put(a, jax.memory.Space.Device) for a in pinned)


def _pull_commit(pool_gu, pool_dn, gus, dns, slots):
    for i, (gu, dn) in enumerate(zip(gus, dns)):
        gu = jax.device_put(gu, jax.memory.Space.Device)
        dn = jax.device_put(dn, jax.memory.Space.Device)
        pool_gu = jax.lax.dynamic_update_slice(pool_gu, gu[None], (slots[i], 0, 0))
        pool_dn = jax.lax.dynamic_update_slice(pool_dn, dn[None], (slots[i], 0, 0))
    return pool_gu, pool_dn


def _commit(pool_gu, pool_dn, gus, dns, slots):
    for i, (gu, dn) in enumerate(zip(gus, dns)):
        pool_gu = jax.lax.dynamic_update_slice(pool_gu, gu[None], (slots[i], 0, 0))
        pool_dn = jax.lax.dynamic_update_slice(pool_dn, dn[None], (slots[i], 0, 0))
    return pool_gu, pool_dn


def _route_like(x):
    y = x * 2.0
    return y[:, :6], (y[:, :6] > 0).astype(jnp.int32), y


def _route_like_packed(x):
    w, ids, y = _route_like(x)
    return jnp.concatenate([w, ids.astype(y.dtype), y], axis=1)


def main(argv: list[str] | None = None) -> dict:
    args = expert_shape_parser(__doc__.splitlines()[0], reps=15, slots=16).parse_args(argv)
    d, f, kmax, gu_np, dn_np, expert_bytes = expert_setup(args)
    devices = select_devices()
    pinned, device = memory_shardings(devices.accel)
    gus = [jax.device_put(a, pinned) for a in gu_np]
    dns = [jax.device_put(a, pinned) for a in dn_np]
    merged = [jax.device_put(np.concatenate([g, n.T], axis=1), pinned) for g, n in zip(gu_np, dn_np)]
    jax.block_until_ready((gus, dns, merged))
    pool = {"gu": jax.device_put(jnp.zeros((args.slots, d, 2 * f), jnp.bfloat16), device),
            "dn": jax.device_put(jnp.zeros((args.slots, f, d), jnp.bfloat16), device)}
    pull = jax.jit(_pull)
    pull_commit = jax.jit(_pull_commit, donate_argnums=(0, 1))
    commit = jax.jit(_commit, donate_argnums=(0, 1))
    helper = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    records = []

    def record(kind, k, issue, done):
        emit(records, {"kind": kind, "experts": k, "issue_ms": 1e3 * issue, "done_ms": 1e3 * done,
                       "GBps": k * expert_bytes / done / 1e9 if k else None})

    for k in args.experts:
        slots = np.arange(k, dtype=np.int32)
        srcs = (gus[:k], dns[:k])

        def into_pool(call):
            start = time.perf_counter()
            pool["gu"], pool["dn"] = call()
            return (pool["gu"], pool["dn"]), time.perf_counter() - start

        def put_then_commit():
            on_device = jax.device_put(srcs, device)
            return commit(pool["gu"], pool["dn"], tuple(on_device[0]), tuple(on_device[1]), slots)

        def thread_put():
            start = time.perf_counter()
            future = helper.submit(jax.device_put, srcs, device)
            submitted = time.perf_counter() - start
            return future.result(), submitted

        ways = {
            "put_pairs": lambda: held(lambda: jax.device_put(srcs, device)),
            "put_merged": lambda: held(lambda: jax.device_put(merged[:k], device)),
            "jit_pull": lambda: held(lambda: pull(*gus[:k], *dns[:k])),
            "jit_pull_commit": lambda: into_pool(
                lambda: pull_commit(pool["gu"], pool["dn"], tuple(gus[:k]), tuple(dns[:k]), slots)),
            "put_then_commit": lambda: into_pool(put_then_commit),
            "thread_put": thread_put,
        }
        for kind, fn in ways.items():
            record(kind, k, *issue_and_done(fn, args.reps))

    cpu_many = jax.jit(many_experts)
    x_cpu = jax.device_put(np.zeros((8, d), jnp.bfloat16), devices.cpu)
    cpu_gus = [jax.device_put(a, devices.cpu) for a in gu_np]
    cpu_dns = [jax.device_put(a, devices.cpu) for a in dn_np]
    for k in [k for k in args.experts if k < kmax]:
        def cpu_part(beside: bool):
            copy = jax.device_put((gus[k:], dns[k:]), device) if beside else None
            start = time.perf_counter()
            cpu_many(x_cpu, tuple(cpu_gus[:k]), tuple(cpu_dns[:k])).block_until_ready()
            seconds = time.perf_counter() - start
            jax.block_until_ready(copy)
            return seconds

        for kind, beside in (("cpu_alone", False), ("cpu_beside_copy", True)):
            seconds = [cpu_part(beside) for _ in range(args.reps + 2)][2:]
            record(kind, k, 0.0, statistics.median(seconds))

    def host_call(kind, call):  # small calls: four times the repeats
        record(kind, 0, *issue_and_done(lambda: held(call), args.reps * 4))

    trivial = jax.jit(lambda *xs: xs[0] + 1)
    operands = [jax.device_put(np.zeros((8, 8), np.float32), device) for _ in range(32)]
    for n in (1, 32):
        host_call(f"dispatch_{n}_operands", lambda: trivial(*operands[:n]))
    route_like = jax.jit(_route_like)
    x = jax.device_put(np.ones((8, 64), np.float32), device)
    host_call("route_roundtrip", lambda: jax.device_get(route_like(x)))
    packed = jax.jit(_route_like_packed)
    host_call("route_roundtrip_packed", lambda: jax.device_get(packed(x)))

    return probe_result("ways of issuing a decode layer's expert copies: host held vs done (random weights)",
                        devices, records, args.out,
                        expert_shape={"hidden": d, "intermediate": f, "dtype": "bfloat16",
                                      "expert_bytes": expert_bytes})


if __name__ == "__main__":
    main()
