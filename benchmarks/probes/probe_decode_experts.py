"""Formulations of a decode step's routed experts on the accelerator: which reads the weights once.

One row (or `--rows`) routed to `--top-k` of `--num-experts` experts of DeepSeek-V2-Lite's shape, per layer, in a
chain of `--layers` layers in ONE program (each layer its own stacks, the row carried through, as in a decode
step), bf16 weights. Variants (`--variants`):
  gather     models.experts.combine_experts as the model runs it (on a CUDA GPU the gather_matvec kernel unless
             PDSCOPE_GPU_KERNELS=0, else a gathered copy of each pick's weights);
  slices     one dynamic slice of the stack per pick, each pick its own dots, summed in k order;
  gather_t   the gather path over stacks stored transposed (gate_up [E, 2F, D], down [E, D, F]: the contracted
             dimension minor, so a one-row product is a row reduction);
  slices_t   per-pick slices over the transposed stacks;
  ragged     jax.lax.ragged_dot over the whole stack (groups of the sorted picks);
  dense      calibration: the shared expert's dense matmuls [D, 2F'] / [F', D] (no routing), both layouts.
With --quant int8 / int4, `gather` runs again over the stacks quantized (quant.formats): the kernel's fused
dequantization, or XLA's dequantize-then-multiply with PDSCOPE_GPU_KERNELS=0; bytes count the quantized weights.
`--activation fused between` runs each `gather` with the kernel's SwiGLU inside the down call for every precision,
then between the calls for every one (`kernels.gather_matvec.FUSED_ACTIVATION`); by default as shipped.
Each variant: --warmup program runs, then --reps runs with fresh routing each, timed one by one (waited for); the
record has the median ms per layer, the bytes a layer must read (its picks' weights once) and the implied GB/s,
and the max abs difference of the output to `gather`'s (the same weights, so formulations must agree).
Random weights. Run from the repository root: `PYTHONPATH=. python benchmarks/probes/probe_decode_experts.py`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from _common import emit, probe_result
from pdscope_jax.kernels import gather_matvec
from pdscope_jax.models.experts import combine_experts, expert_ffn
from pdscope_jax.quant.formats import quantize

F32 = jnp.float32
VARIANTS = ("gather", "slices", "gather_t", "slices_t", "ragged", "dense")
ACTIVATION = {"shipped": gather_matvec.FUSED_ACTIVATION, "fused": frozenset({"dense", "int8", "int4"}),
              "between": frozenset()}


def ffn_t(x, gate_up_t, down_t):
    """expert_ffn over transposed weights: x [N, D], gate_up_t [2F, D], down_t [D, F] -> [N, D] in x's dtype."""
    h = jnp.einsum("nd,fd->nf", x.astype(gate_up_t.dtype), gate_up_t, preferred_element_type=F32)
    gate, up = jnp.split(h, 2, axis=-1)
    act = (jax.nn.silu(gate) * up).astype(down_t.dtype)
    return jnp.einsum("nf,df->nd", act, down_t, preferred_element_type=F32).astype(x.dtype)


def layer_fn(variant: str):
    def gather(x, w, ids, gu, dn):
        return combine_experts(x, w, ids, gu, dn, jnp.arange(gu.shape[0], dtype=jnp.int32), out_dtype=F32)

    def slices(x, w, ids, gu, dn, ffn=expert_ffn):
        n, k = ids.shape
        total = jnp.zeros(x.shape, F32)
        for r in range(n):
            for j in range(k):
                e = ids[r, j]
                y = ffn(x[r:r + 1], jax.lax.dynamic_index_in_dim(gu, e, keepdims=False),
                        jax.lax.dynamic_index_in_dim(dn, e, keepdims=False))
                total = total.at[r].add(y[0].astype(F32) * w[r, j])
        return total

    def gather_t(x, w, ids, gu, dn):
        y = jax.vmap(lambda xn, g, d: jax.vmap(lambda gi, di: ffn_t(xn[None], gi, di)[0])(g, d))(x, gu[ids], dn[ids])
        return jnp.sum(y.astype(F32) * w[..., None], axis=1)

    def ragged(x, w, ids, gu, dn):
        n, k = ids.shape
        flat = ids.reshape(-1)
        order = jnp.argsort(flat, stable=True)
        sizes = jnp.bincount(flat, length=gu.shape[0]).astype(jnp.int32)
        xs = x[order // k].astype(gu.dtype)
        h = jax.lax.ragged_dot(xs, gu, sizes, preferred_element_type=F32)
        gate, up = jnp.split(h, 2, axis=-1)
        y = jax.lax.ragged_dot((jax.nn.silu(gate) * up).astype(dn.dtype), dn, sizes, preferred_element_type=F32)
        y = y.astype(x.dtype).astype(F32) * w.reshape(-1)[order, None]
        return jnp.zeros(x.shape, F32).at[order // k].add(y)

    return {"gather": gather, "slices": slices, "gather_t": gather_t,
            "slices_t": lambda *a: slices(*a, ffn=ffn_t), "ragged": ragged}[variant]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=1408)
    parser.add_argument("--shared-intermediate", type=int, default=2816)
    parser.add_argument("--num-experts", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=6)
    parser.add_argument("--rows", type=int, nargs="+", default=[1])
    parser.add_argument("--layers", type=int, default=26)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--quant", nargs="*", default=[], choices=["int8", "int4"])
    parser.add_argument("--activation", nargs="+", default=["shipped"], choices=list(ACTIVATION))
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    d, f, e, k, layers = args.hidden, args.intermediate, args.num_experts, args.top_k, args.layers
    accel = jax.devices()[0]
    key = jax.random.key(0)
    make = jax.jit(lambda key, shape: (jax.random.normal(key, shape, F32) * 0.02).astype(jnp.bfloat16),
                   static_argnums=1)
    gus = [make(jax.random.fold_in(key, 2 * i), (e, d, 2 * f)) for i in range(layers)]
    dns = [make(jax.random.fold_in(key, 2 * i + 1), (e, f, d)) for i in range(layers)]
    expert_bytes = (d * 2 * f + f * d) * 2
    records = []
    reference = {}
    rng = np.random.default_rng(0)
    for rows in args.rows:
        routings = []
        for _ in range(args.warmup + args.reps):
            ids = np.stack([np.stack([rng.choice(e, k, replace=False) for _ in range(rows)]) for _ in range(layers)])
            w = rng.random((layers, rows, k), np.float32)
            routings.append((jax.device_put(ids.astype(np.int32), accel),
                             jax.device_put(w / w.sum(-1, keepdims=True), accel)))
        x0 = jax.device_put(rng.standard_normal((rows, d), np.float32).astype(jnp.bfloat16), accel)
        dense = [None] if "gather" in args.variants else []
        runs = [("gather", q, a) for a in args.activation for q in dense + args.quant]  # bf16 gather: the reference
        runs += [(v, None, "shipped") for v in args.variants if v not in ("dense", "gather")]
        for variant, quant, activation in runs:
            gather_matvec.FUSED_ACTIVATION = ACTIVATION[activation]  # read as `chain` below is traced
            transposed = variant.endswith("_t")
            if transposed:
                gts = [jnp.swapaxes(g, 1, 2) for g in gus]
                dts = [jnp.swapaxes(dn, 1, 2) for dn in dns]
                jax.block_until_ready((gts, dts))
            stacks = (gts, dts) if transposed else (gus, dns)
            if quant is not None:
                stacks = ([quantize(g, quant) for g in gus], [quantize(dn, quant) for dn in dns])
                jax.block_until_ready(stacks)
            fn = layer_fn(variant)

            @jax.jit
            def chain(x, ids, w, gu_list, dn_list):
                outs = []
                for i in range(layers):
                    y = fn(x, w[i], ids[i], gu_list[i], dn_list[i])
                    outs.append(y)
                    x = (x.astype(F32) + y).astype(x.dtype)
                return x, outs[0]

            start = time.perf_counter()
            jax.block_until_ready(chain(x0, *routings[0], *stacks))
            compile_s = time.perf_counter() - start
            times = []
            for rep, (ids, w) in enumerate(routings):
                start = time.perf_counter()
                out, first = jax.block_until_ready(chain(x0, ids, w, *stacks))
                if rep >= args.warmup:
                    times.append(time.perf_counter() - start)
            first = np.asarray(first)
            if variant == "gather" and quant is None and rows not in reference:
                reference[rows] = first
            diff = float(np.max(np.abs(first - reference[rows]))) if rows in reference else None
            ms = statistics.median(times) * 1e3 / layers
            read = rows * k * (expert_bytes if quant is None else  # upper bound: picks may repeat at rows > 1
                                (stacks[0][0].nbytes + stacks[1][0].nbytes) // e)
            emit(records, {"variant": variant, "quant": quant, "rows": rows, "top_k": k, "ms_per_layer": ms,
                           "activation": activation if variant == "gather" else None,
                           "min_ms_per_layer": min(times) * 1e3 / layers, "compile_s": compile_s,
                           "bytes_per_layer": read, "gbps": read / (ms / 1e3) / 1e9, "max_abs_diff_vs_gather": diff})
            if transposed:
                del gts, dts
    if "dense" in args.variants:
        fs = args.shared_intermediate
        wg = [make(jax.random.fold_in(key, 1000 + i), (d, 2 * fs)) for i in range(layers)]
        wd = [make(jax.random.fold_in(key, 2000 + i), (fs, d)) for i in range(layers)]
        for transposed in (False, True):
            ws = ([jnp.swapaxes(a, 0, 1) for a in wg], [jnp.swapaxes(a, 0, 1) for a in wd]) if transposed else (wg, wd)
            ffn = ffn_t if transposed else expert_ffn

            @jax.jit
            def dense_chain(x, g_list, d_list):
                for g, dn in zip(g_list, d_list):
                    x = (x.astype(F32) + ffn(x, g, dn).astype(F32)).astype(x.dtype)
                return x

            x1 = jax.device_put(np.ones((1, d), np.float32).astype(jnp.bfloat16) * 0.01, accel)
            jax.block_until_ready(dense_chain(x1, *ws))
            times = []
            for _ in range(args.reps):
                start = time.perf_counter()
                jax.block_until_ready(dense_chain(x1, *ws))
                times.append(time.perf_counter() - start)
            ms = statistics.median(times) * 1e3 / layers
            read = (d * 2 * fs + fs * d) * 2
            emit(records, {"variant": "dense_t" if transposed else "dense", "rows": 1, "ms_per_layer": ms,
                           "bytes_per_layer": read, "gbps": read / (ms / 1e3) / 1e9})
    devices = argparse.Namespace(accel=accel)
    return probe_result("decode routed experts: formulations that read each pick's weights once (random weights)",
                        devices, records, args.out, hidden=d, intermediate=f, num_experts=e, layers=layers,
                        gpu_kernels=os.environ.get("PDSCOPE_GPU_KERNELS", "1"))


if __name__ == "__main__":
    main()
