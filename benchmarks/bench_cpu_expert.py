"""Expert FFN on XLA:CPU against torch CPU, and what avoids XLA:CPU's bf16 one-row pathology.

Times one routed expert (DeepSeek-V2-Lite shape by default: hidden 2048, intermediate 1408, bf16) at 1, 16,
128 and 512 tokens on the JAX CPU backend, with the package's `expert_ffn` (gate and up fused):
  - `xla_bf16`: the rows as they are;
  - `xla_bf16_pad{8,16,32}`: rows zero-padded up to that bucket (what `CpuExperts` does with min_rows);
  - `xla_f32`: float32 weights (twice the host memory, shown for reference);
  - `xla_bf16_pinned_view`: rows padded to the engine's bucket, weights read through the expert store's CPU view
    of pinned memory (as the engine reads them) instead of ordinary host memory;
  - `engine_bf16`: the engine's real path, `CpuExperts.dispatch` (gather, padded FFN, weighted scatter-add);
    `engine_bf16_copy` the same over a store that keeps a CPU copy in ordinary memory (`cpu_view="copy"`);
  - `torch_bf16`, `torch_f32`: torch CPU with separate gate/up/down matmuls, when torch is installed.
Prints one JSON object per measurement, then a summary with the recommended minimum row bucket, and writes all
of it to --out (default benchmarks/results/cpu_expert_<host>.json). Runs on any machine; the figures that
matter come from the benchmark node. Run from the repository root: `PYTHONPATH=. python benchmarks/bench_cpu_expert.py`
(or after `pip install -e .`).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import socket
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from pdscope_jax.models.layers import expert_ffn
from pdscope_jax.engine.cpu_experts import CpuExperts
from pdscope_jax.store.expert_store import ExpertStore
from pdscope_jax.runtime import select_devices
from pdscope_jax.bench.timing import median_seconds


def median_ms(fn, reps: int, warm: int) -> float:
    return median_seconds(fn, reps, warm) * 1e3


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=1408)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 128, 512])
    parser.add_argument("--pads", type=int, nargs="+", default=[8, 16, 32])
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--warm", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)

    d, f = args.hidden, args.intermediate
    cpu = jax.devices("cpu")[0]
    rng = np.random.default_rng(0)
    gu32 = (rng.standard_normal((d, 2 * f)) * 0.02).astype(np.float32)  # [D, 2F]
    dn32 = (rng.standard_normal((f, d)) * 0.02).astype(np.float32)  # [F, D]
    weights = {name: (jax.device_put(gu32.astype(dt), cpu), jax.device_put(dn32.astype(dt), cpu))
               for name, dt in (("bf16", jnp.bfloat16), ("f32", np.float32))}
    ffn = jax.jit(expert_ffn)
    store = ExpertStore(select_devices())
    store.add_layer(0, gu32.astype(jnp.bfloat16)[None], dn32.astype(jnp.bfloat16)[None])
    engine = CpuExperts(store)
    copy_store = ExpertStore(select_devices(), cpu_view="copy")  # the same expert in ordinary host memory
    copy_store.add_layer(0, gu32.astype(jnp.bfloat16)[None], dn32.astype(jnp.bfloat16)[None])
    engine_copy = CpuExperts(copy_store)

    results = []

    def emit(**row):
        results.append(row)
        print(json.dumps(row), flush=True)

    for t in args.tokens:
        x32 = rng.standard_normal((t, d)).astype(np.float32)
        x_bf = jax.device_put(x32.astype(jnp.bfloat16), cpu)
        variants = {"xla_bf16": (x_bf, "bf16"), "xla_f32": (jax.device_put(x32, cpu), "f32")}
        for pad in args.pads:
            if pad > t:
                padded = np.zeros((pad, d), np.float32)
                padded[:t] = x32
                variants[f"xla_bf16_pad{pad}"] = (jax.device_put(padded.astype(jnp.bfloat16), cpu), "bf16")
        for name, (x, wname) in variants.items():
            gu, dn = weights[wname]
            emit(what="cpu_expert_ffn", variant=name, tokens=t, rows=int(x.shape[0]),
                 ms=median_ms(lambda: ffn(x, gu, dn).block_until_ready(), args.reps, args.warm))
        rows = max(engine.min_rows, t)
        x_rows = jax.device_put(np.resize(x32, (rows, d)).astype(jnp.bfloat16), cpu)
        pinned_gu, pinned_dn = store.cpu_weights(0, 0)
        emit(what="cpu_expert_ffn", variant="xla_bf16_pinned_view", tokens=t, rows=rows,
             ms=median_ms(lambda: ffn(x_rows, pinned_gu, pinned_dn).block_until_ready(), args.reps, args.warm))
        groups = [(0, np.arange(t), np.ones(t, np.float32))]
        for name, runner in (("engine_bf16", engine), ("engine_bf16_copy", engine_copy)):
            emit(what="cpu_expert_ffn", variant=name, tokens=t, rows=rows,
                 ms=median_ms(lambda: runner.dispatch(0, x_bf, groups).block_until_ready(), args.reps, args.warm))
    try:
        import torch

        torch.set_num_threads(os.cpu_count())
        for name, dt in (("torch_bf16", torch.bfloat16), ("torch_f32", torch.float32)):
            g, u = (torch.from_numpy(np.ascontiguousarray(w)).to(dt) for w in (gu32[:, :f], gu32[:, f:]))
            dn = torch.from_numpy(dn32).to(dt)
            for t in args.tokens:
                x = torch.randn(t, d, dtype=dt)
                emit(what="cpu_expert_ffn", variant=name, tokens=t, rows=t,
                     ms=median_ms(lambda: (torch.nn.functional.silu(x @ g) * (x @ u)) @ dn, args.reps, args.warm))
    except ImportError:
        emit(what="torch_missing")

    one_row = {r["variant"]: r["ms"] for r in results if r.get("tokens") == 1 and "ms" in r}
    pads = {p: one_row[f"xla_bf16_pad{p}"] for p in args.pads if f"xla_bf16_pad{p}" in one_row}
    best_pad = min(pads, key=pads.get) if pads else None
    summary = dict(
        what="summary", host=socket.gethostname(), jax=jax.__version__, python=platform.python_version(),
        cpus=os.cpu_count(), shape=dict(hidden=d, intermediate=f), weights="random",
        xla_flags=os.environ.get("XLA_FLAGS"),
        command=shlex.join([sys.argv[0], *(sys.argv[1:] if argv is None else argv)]),
        one_row_ms=one_row, recommended_min_rows=best_pad,
        note="RuntimeConfig.cpu_min_rows pads CPU expert rows to this bucket",
    )
    print(json.dumps(summary), flush=True)
    out = args.out or Path("benchmarks/results") / f"cpu_expert_{socket.gethostname()}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"summary": summary, "results": results}, indent=1))
    return summary


if __name__ == "__main__":
    main()
