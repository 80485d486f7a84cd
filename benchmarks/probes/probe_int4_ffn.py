"""What a decode layer's int4 expert FFN costs on the GPU with the gather-matvec kernel, by how it is cut.

Why: a trace of Qwen3-30B-A3B's int4 decode step showed the routed experts' two kernel calls reading their weights
at about 0.5-0.6 TB/s, against 2.4-3.6 TB/s for DeepSeek-V2-Lite's bf16 ones. A suspect: the down call fusing the
activation, which makes each of its programs sum gate/up's K parts (16 of them) again. For --model's expert shape
(its picks of its int4 experts, a stack larger than the L2 cache), one jitted program chains --layers FFNs (each
layer's input the last one's output, distinct picks), and the median wall time over --reps runs gives microseconds a
layer and TB/s of the picks' stored bytes, per variant:
- `fused`: `gather_matvec.swiglu_ffn` as the engine runs it (the activation in the down call, over every part);
- `summed`: gate/up's parts summed first (one XLA reduction), then the down call fusing the activation of one part;
- `separate`: gate/up summed, the activation by XLA, then a plain down call.
Every variant's result is checked against `fused` (relative error < 1e-4; the sums' order differs).
Usage: PYTHONPATH=. python benchmarks/probes/probe_int4_ffn.py [--model qwen3] [--out F.json]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from _common import emit, probe_result
from pdscope_jax.bench.timing import median_seconds
from pdscope_jax.kernels import gather_matvec as gm
from pdscope_jax.kernels.expert_math import swiglu
from pdscope_jax.quant.formats import quantize
from pdscope_jax.runtime import select_devices

MODELS = {"qwen3": (2048, 768, 128, 8), "deepseek": (2048, 1408, 64, 6),  # D, F, experts, picks
          "tiny": (256, 128, 8, 2)}  # a check of the script on the CPU backend (with --interpret)


def ffn(variant: str, interpret: bool):
    """x [A, D] bf16, gate_up, down (int4), picks [A] -> [A, D] float32, cut as `variant` says."""
    def run(x, gate_up, down, picks):
        parts = gm.matvec_parts(x, gate_up, picks, interpret=interpret)  # [P, A, 2F]
        if variant == "fused":
            return gm.swiglu_matvec(parts, down, picks, interpret=interpret)
        summed = parts.sum(axis=0)
        if variant == "summed":
            return gm.swiglu_matvec(summed[None], down, picks, interpret=interpret)
        return gm.gather_matvec(swiglu(summed).astype(jnp.bfloat16), down, picks, interpret=interpret)
    return run


def chained(variant: str, layers: int, interpret: bool = False):
    one = ffn(variant, interpret)

    def run(x, gate_up, down, picks):
        outs = []
        for layer in range(layers):
            y = one(x, gate_up, down, picks[layer])
            outs.append(y)
            x = (y * 1e-2).astype(jnp.bfloat16)  # the next layer waits for this one
        return jnp.stack(outs)
    return jax.jit(run)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen3", choices=list(MODELS))
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--interpret", action="store_true", help="Pallas' interpreter (the CPU backend)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    devices = select_devices()
    d, f, experts, a = MODELS[args.model]
    rng = np.random.default_rng(0)

    def stack(k, n):
        return jax.device_put(quantize(jnp.asarray(rng.standard_normal((experts, k, n)) * 0.05, jnp.bfloat16), "int4"),
                              devices.accel)
    gate_up, down = stack(d, 2 * f), stack(f, d)
    x = jax.device_put(jnp.asarray(rng.standard_normal((a, d)), jnp.bfloat16), devices.accel)
    picks = jax.device_put(np.stack([rng.permutation(experts)[:a] for _ in range(args.layers)]).astype(np.int32),
                           devices.accel)
    nbytes = a * sum(leaf.nbytes for leaf in jax.tree.leaves((gate_up, down))) // experts
    records, want = [], None
    for variant in ("fused", "summed", "separate"):
        fn = chained(variant, args.layers, args.interpret)
        got = np.asarray(fn(x, gate_up, down, picks), np.float64)
        want = got if want is None else want
        err = float(np.abs(got - want).max() / (np.abs(want).max() + 1e-30))
        # the check's run above was the untimed one
        us = median_seconds(lambda: fn(x, gate_up, down, picks), args.reps, warmup=0) / args.layers * 1e6
        emit(records, {"variant": variant, "us_per_layer": round(us, 2), "tb_s": round(nbytes / us / 1e6, 3),
                       "rel_err_vs_fused": err})
        if err > 1e-4:
            raise SystemExit(f"{variant} differs from fused by {err:.2e}")
    return probe_result(f"int4 expert FFN cuts ({args.model}: D {d}, F {f}, {a} picks of {experts})", devices,
                        records, args.out, picks_bytes=nbytes, layers=args.layers)


if __name__ == "__main__":
    main()
