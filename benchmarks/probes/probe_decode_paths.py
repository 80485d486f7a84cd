"""How fast the two decode paths for a missed expert can go on this machine: CPU compute and host-to-device copy.

Why: decode at batch 1 misses most routed experts; each miss is either computed on the CPU backend (reading its
weights from host memory) or copied to the accelerator. For k experts of one layer (DeepSeek-V2-Lite shape by
default, bf16, random weights, rows padded to --rows) it measures:
  - `cpu_chain`: k expert programs chained one after another on the CPU backend (one row bucket each);
  - `cpu_one_program`: one jitted program over the k experts' separate weights;
  - `cpu_threads`: k programs dispatched from k Python threads at once;
  - `torch_chain` / `torch_threads` for comparison (torch CPU, same shapes), when torch is installed;
  - `host_read_GBps`: a plain multi-threaded reduction over 2 GiB (torch), the host memory bandwidth ceiling;
  - `copy_issue` / `copy_done`: a batched `jax.device_put` of k experts' pinned arrays to the accelerator: how
    long the issuing thread is held, and when the copy is done (on the CPU backend both are memory copies).
Every figure is a median over --reps.
Run from the repository root: `PYTHONPATH=. python benchmarks/probes/probe_decode_paths.py [--out FILE]`.
Writes one JSON line per record to stdout ({kind, experts, ms, GBps of expert weights}) and, with --out, the
result of `_common.probe_result` (command, accelerator, jax, cpu count, expert shape, records) as JSON.
"""

from __future__ import annotations

import concurrent.futures
import os

import jax
import jax.numpy as jnp
import numpy as np

from _common import (emit, expert_setup, expert_shape_parser, held, issue_and_done, many_experts, memory_shardings,
                     probe_result)
from pdscope_jax.bench.timing import median_seconds
from pdscope_jax.models.layers import expert_ffn
from pdscope_jax.runtime import select_devices


def main(argv: list[str] | None = None) -> dict:
    args = expert_shape_parser(__doc__.splitlines()[0], reps=9, rows=8).parse_args(argv)
    d, f, kmax, gu_np, dn_np, expert_bytes = expert_setup(args)
    devices = select_devices()
    cpu = devices.cpu
    gus = [jax.device_put(a, cpu) for a in gu_np]
    dns = [jax.device_put(a, cpu) for a in dn_np]
    x = jax.device_put(np.zeros((args.rows, d), jnp.bfloat16), cpu)
    one = jax.jit(expert_ffn)
    many = jax.jit(many_experts)
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=kmax)
    records = []

    def record(kind, k, seconds):
        emit(records, {"kind": kind, "experts": k, "ms": 1e3 * seconds, "GBps": k * expert_bytes / seconds / 1e9})

    for k in args.experts:
        def chain():
            out = [one(x, gus[i], dns[i]) for i in range(k)]
            jax.block_until_ready(out)

        def program():
            many(x, tuple(gus[:k]), tuple(dns[:k])).block_until_ready()

        def threads():
            list(pool.map(lambda i: one(x, gus[i], dns[i]).block_until_ready(), range(k)))

        for kind, fn in (("cpu_chain", chain), ("cpu_one_program", program), ("cpu_threads", threads)):
            record(kind, k, median_seconds(fn, args.reps, 2))

    try:
        import torch
    except ImportError:
        torch = None
    if torch is not None:
        tg = [torch.from_numpy(a.view(np.uint16).copy()).view(torch.bfloat16) for a in gu_np]
        td = [torch.from_numpy(a.view(np.uint16).copy()).view(torch.bfloat16) for a in dn_np]
        tx = torch.zeros((args.rows, d), dtype=torch.bfloat16)

        def t_one(i):
            with torch.no_grad():
                h = tx @ tg[i]
                return (torch.nn.functional.silu(h[:, :f]) * h[:, f:]) @ td[i]

        for k in args.experts:
            record("torch_chain", k, median_seconds(lambda: [t_one(i) for i in range(k)], args.reps, 2))
            record("torch_threads", k, median_seconds(lambda: list(pool.map(t_one, range(k))), args.reps, 2))
        big = torch.ones(512 * 1024 * 1024, dtype=torch.float32)  # 2 GiB
        seconds = median_seconds(lambda: big.sum().item(), 5, 1)
        emit(records, {"kind": "host_read_GBps", "GBps": big.numel() * 4 / seconds / 1e9,
                       "threads": torch.get_num_threads()})

    pinned, on_device = memory_shardings(devices.accel)
    host = [jax.device_put(a, pinned) for a in gu_np + dn_np]
    jax.block_until_ready(host)
    for k in args.experts:
        srcs = host[:k] + host[kmax:kmax + k]
        issue, done = issue_and_done(lambda: held(lambda: jax.device_put(srcs, on_device)), args.reps)
        record("copy_issue", k, issue)
        record("copy_done", k, done)

    return probe_result("decode paths for missed experts: CPU compute vs host-to-device copy (random weights)",
                        devices, records, args.out, cpu_count=os.cpu_count(),
                        expert_shape={"hidden": d, "intermediate": f, "dtype": "bfloat16", "rows": args.rows,
                                      "expert_bytes": expert_bytes})


if __name__ == "__main__":
    main()
