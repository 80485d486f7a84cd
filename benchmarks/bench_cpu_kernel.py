"""The CPU expert kernel (pdscope_jax.kernels.cpu_ffn) against XLA:CPU, in ms and GB/s of expert bytes.

For one MoE layer's CPU experts (DeepSeek-V2-Lite shapes by default: hidden 2048, moe_intermediate 1408, bf16
weights, 17.3 MB an expert) at --rows (1, 4, 16, 64) and --experts k (1, 6, 16), times:
  - `kernel`: `moe_ffn_cpu(..., impl="kernel")` in `jax.jit`, the experts as k per-expert CPU arrays;
  - `kernel_stacked`: the same with a layer stack [E, ...] and k expert ids;
  - `kernel_streamed`: `kernel` with the streamed few-row path on (`cpu_ffn.set_stream`; bf16, at most 4 rows);
  - `xla`: the XLA path in `jax.jit` on the CPU backend, rows zero-padded to --min-rows, each expert on every
    row weighted by coef (the engine's dense decode path).
`--quant int8,int4` repeats all of it on the same experts quantized (`quant.formats.quantize`, compute dtype
bf16): the kernel reads integers and scales, the XLA path dequantizes in the program; rows carry `format`.
Each repeat runs a different set of experts out of --pool-experts, so the weights come from memory, not the cache.
GB/s = stored bytes of the k experts (integers and scales when quantized) / median time after warm-up. `--profile`
adds the kernel's time by phase (`kernels.cpu_ffn.profile_read`) from a second, untimed pass. Also records the
pool's plain read bandwidth (`read_bandwidth`), the threads used, the CPU model, host and jax version, and writes
all of it as JSON to --out. Builds the kernel on first use (needs a C++ compiler; without one only `xla` runs).
Run from the repository root: `PYTHONPATH=. python3 benchmarks/bench_cpu_kernel.py --out /tmp/x.json`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import socket
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from pdscope_jax.kernels import cpu_ffn
from pdscope_jax.quant import formats


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def median_ms(call, arg_sets: list, warm: int) -> float:
    """Median wall time of call(*args) over arg_sets after `warm` untimed calls, in ms."""
    for args in arg_sets[:warm]:
        jax.block_until_ready(call(*args))
    times = []
    for args in arg_sets[warm:]:
        start = time.perf_counter()
        jax.block_until_ready(call(*args))
        times.append(time.perf_counter() - start)
    return float(np.median(times)) * 1e3


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=1408)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--experts", type=int, nargs="+", default=[1, 6, 16])
    parser.add_argument("--pool-experts", type=int, default=64, help="distinct experts the repeats cycle through")
    parser.add_argument("--impls", nargs="+", default=["kernel", "kernel_stacked", "xla"])
    parser.add_argument("--threads", type=int, default=0, help="kernel threads (0: the CPUs this process may use)")
    parser.add_argument("--min-rows", type=int, default=8, help="the XLA path pads rows to this (engine default)")
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--warm", type=int, default=2)
    parser.add_argument("--profile", action="store_true",
                        help="after timing, run the kernel's repeats again with its phase profile on and record "
                             "ms per call by phase (`profile_ms`)")
    parser.add_argument("--quant", default="", help="comma-separated schemes to measure beside bf16 (int8,int4)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    schemes = [name for name in args.quant.split(",") if name]
    for name in schemes:
        formats.scheme(name)  # an unknown name fails here, before any work

    d, f, e = args.hidden, args.intermediate, args.pool_experts
    cpu = jax.devices("cpu")[0]
    built = cpu_ffn.built()
    threads = cpu_ffn.set_threads(args.threads) if built else 0
    impls = [impl for impl in args.impls if built or impl == "xla"]
    report = {
        "command": shlex.join([sys.executable, *sys.argv]), "host": socket.gethostname(), "cpu": cpu_model(),
        "cpus_usable": len(os.sched_getaffinity(0)), "jax": jax.__version__, "python": platform.python_version(),
        "kernel_built": built, "kernel_isa": cpu_ffn.isa(), "kernel_threads": threads,
        "hidden": d, "intermediate": f, "formats": ["bf16", *schemes], "min_rows": args.min_rows, "reps": args.reps,
        "warm": args.warm,
        "read_gbps": round(cpu_ffn.read_bandwidth(1 << 30), 1) if built else None, "results": [],
    }
    print(json.dumps({k: v for k, v in report.items() if k != "results"}), flush=True)

    rng = np.random.default_rng(0)
    gate_up = np.empty((e, d, 2 * f), jnp.bfloat16)
    down = np.empty((e, f, d), jnp.bfloat16)
    for j in range(e):  # per expert: no float32 copy of the whole pool at once
        gate_up[j] = rng.standard_normal((d, 2 * f), np.float32) * 0.02
        down[j] = rng.standard_normal((f, d), np.float32) * 0.02
    stacks = {"bf16": (jax.device_put(gate_up, cpu), jax.device_put(down, cpu))}
    pools = {"bf16": [(jax.device_put(gate_up[j], cpu), jax.device_put(down[j], cpu)) for j in range(e)]}
    del gate_up, down
    for name in schemes:  # per expert, then stacked: no float32 copy of the whole pool at once
        pools[name] = [tuple(formats.quantize(w, name, jnp.bfloat16) for w in pair) for pair in pools["bf16"]]
        stacks[name] = tuple(formats.QuantizedWeight(jnp.stack([p[i].q for p in pools[name]]),
                                                     jnp.stack([p[i].scale for p in pools[name]]),
                                                     formats.scheme(name), jnp.bfloat16) for i in range(2))
    expert_bytes = {name: pools[name][0][0].nbytes + pools[name][0][1].nbytes for name in pools}

    def list_kernel(h, coef, gus, dns):
        return cpu_ffn.moe_ffn_cpu(h, coef, gus, dns, impl="kernel")

    def list_xla(h, coef, gus, dns):
        return cpu_ffn.moe_ffn_cpu(h, coef, gus, dns, impl="xla", min_rows=args.min_rows)

    def stacked_kernel(h, coef, ids, gu, dn):
        return cpu_ffn.moe_ffn_cpu(h, coef, gu, dn, ids, impl="kernel")

    programs = {"kernel": jax.jit(list_kernel), "xla": jax.jit(list_xla), "kernel_stacked": jax.jit(stacked_kernel)}
    programs["kernel_streamed"] = programs["kernel"]  # the same program; the kernel reads the setting per call
    for k in args.experts:
        for n in args.rows:
            h = jax.device_put(rng.standard_normal((n, d)).astype(jnp.bfloat16), cpu)
            coef = jax.device_put(rng.random((k, n)).astype(np.float32), cpu)
            id_sets = [np.array([(rep * k + j) % e for j in range(k)], np.int32)
                       for rep in range(args.warm + args.reps)]
            for fmt, impl in ((fmt, impl) for fmt in pools for impl in impls):
                if impl == "kernel_stacked":
                    arg_sets = [(h, coef, ids, *stacks[fmt]) for ids in id_sets]
                else:
                    arg_sets = [(h, coef, [pools[fmt][j][0] for j in ids], [pools[fmt][j][1] for j in ids])
                                for ids in id_sets]
                if built:
                    cpu_ffn.set_stream(impl == "kernel_streamed")
                ms = median_ms(programs[impl], arg_sets, args.warm)
                row = {"format": fmt, "impl": impl, "rows": n, "experts": k, "ms": round(ms, 3),
                       "gbps": round(k * expert_bytes[fmt] / ms / 1e6, 1)}
                if args.profile and impl != "xla":  # a second pass: the timed one runs without the clock reads
                    cpu_ffn.profile(True)
                    for arg_set in arg_sets[args.warm:]:
                        jax.block_until_ready(programs[impl](*arg_set))
                    cpu_ffn.profile(False)
                    row["profile_ms"] = {key: round(v, 4) for key, v in cpu_ffn.profile_read().items()}
                report["results"].append(row)
                print(json.dumps(row), flush=True)

    by = {(r["format"], r["impl"], r["rows"], r["experts"]): r for r in report["results"]}
    columns = [(fmt, impl) for fmt in pools for impl in impls]
    print(f"\n{'rows':>4} {'k':>3} " + " ".join(f"{fmt + ' ' + impl + ' ms':>24} {'GB/s':>6}" for fmt, impl in columns))
    for k in args.experts:
        for n in args.rows:
            cells = " ".join(f"{by[(*c, n, k)]['ms']:>24.3f} {by[(*c, n, k)]['gbps']:>6.1f}" for c in columns)
            print(f"{n:>4} {k:>3} {cells}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1))
        print(f"wrote {args.out}")
    return report


if __name__ == "__main__":
    main()
