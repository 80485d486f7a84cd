"""The CUDA bridge (`kernels.host_experts`): experts computed by the host's CPU from inside a GPU program.

A chain of `--layers` layers in ONE jitted program, each: h = x in bf16; begin(h, ids, coef, picks) hands the
layer's `n` host experts (of `--picks`, the rest marked -1) to the host; the GPU multiplies h' by a resident
[D, D] bf16 matrix `--gpu-matmuls` times (stand-in for the layer's own GPU work); end(that work) -> the host's
sum; x += both. Each layer has its own `--experts` random bf16 experts of DeepSeek-V2-Lite's shape in host
memory (so the weights come from DRAM, not the cache), the ids drawn anew per repetition.
Records, per (n host experts, GPU matmuls): the median ms per layer over `--reps` programs waited for, beside
the same chain without the bridge (`bridge: false`: the GPU work alone), and the check of one layer's host
sum against XLA's on the GPU (max abs and relative difference). Random weights; `--formats` bf16, int8, int4
(quantized from the bf16 experts; the check's reference is the dequantized bf16 weights).
Run from the repository root: `PYTHONPATH=. python benchmarks/probes/probe_host_experts.py --out F.json`.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from _common import emit, probe_result
from pdscope_jax.kernels import cpu_ffn, host_experts
from pdscope_jax.models.layers import expert_ffn
from pdscope_jax.quant.formats import dense, quantize
from pdscope_jax.runtime import select_devices

F32 = jnp.float32


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--intermediate", type=int, default=1408)
    p.add_argument("--layers", type=int, default=26)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--picks", type=int, default=6)
    p.add_argument("--host-counts", type=int, nargs="+", default=[0, 1, 2, 4, 6])
    p.add_argument("--gpu-matmuls", type=int, nargs="+", default=[1, 16])
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--alloc", nargs="+", default=["numpy"], choices=["numpy", "torch", "registered"],
                   help="where the host experts lie: numpy arrays (NumPy asks for transparent huge pages), torch "
                        "pinned memory (the expert store's), numpy arrays page-locked with cudaHostRegister")
    p.add_argument("--formats", nargs="+", default=["bf16"], choices=["bf16", "int8", "int4"],
                   help="how the host experts are stored (quantized ones lie in numpy memory, scales float32)")
    p.add_argument("--out", type=Path, default=None)
    return p.parse_args()


def placed(arrays, alloc: str, keep: list):
    """`arrays` copied into memory of kind `alloc` (see --alloc); `keep` holds what must outlive the bridge."""
    if alloc == "numpy":
        return arrays
    import torch

    out = []
    for a in arrays:
        if alloc == "torch":
            buffer = torch.empty(a.nbytes, dtype=torch.uint8, pin_memory=True)
            view = buffer.numpy().view(a.dtype).reshape(a.shape)
            keep.append(buffer)
        else:
            view = np.empty_like(a)
            code = torch.cuda.cudart().cudaHostRegister(view.ctypes.data, view.nbytes, 0)
            if int(code) != 0:
                raise RuntimeError(f"cudaHostRegister: {code}")
            keep.append(view)
        view[...] = a
        out.append(view)
    return out


def addresses(arrays) -> tuple[int, ...]:
    return tuple(a.ctypes.data for a in arrays)


def quantized(gate_ups, downs, name: str, keep: list):
    """Per layer, `cpu_ffn.HostWeights` of its experts quantized as `name` (numpy integers and float32 scales, held
    in `keep`), and the dense bf16 weights they stand for (the check's reference), in gate_ups' and downs' shape."""
    weights, refs = [], ([], [])
    for gu_layer, dn_layer in zip(gate_ups, downs):
        parts = []
        for layer, ref in ((gu_layer, refs[0]), (dn_layer, refs[1])):
            qs = [quantize(jnp.asarray(w), name, jnp.bfloat16) for w in layer]
            ints, scales = [np.asarray(x.q) for x in qs], [np.asarray(x.scale, np.float32) for x in qs]
            keep += ints + scales
            ref.append([np.asarray(dense(x)) for x in qs])
            parts.append((ints, scales))
        (gq, gs), (dq, ds) = parts
        groups = (gu_layer[0].shape[0] // gs[0].shape[0], dn_layer[0].shape[0] // ds[0].shape[0])
        weights.append(cpu_ffn.HostWeights(addresses(gq), addresses(dq), qs[0].scheme.bits, addresses(gs),
                                           addresses(ds), groups))
    return weights, refs


def huge_pages_kb() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    return -1


def main() -> None:
    args = parse()
    devices = select_devices()
    accel = devices.accel
    d, f, layers, e = args.hidden, args.intermediate, args.layers, args.experts
    rng = np.random.default_rng(0)
    gate_ups = [[(rng.standard_normal((d, 2 * f), np.float32) * 0.03).astype(jnp.bfloat16) for _ in range(e)]
                for _ in range(layers)]
    downs = [[(rng.standard_normal((f, d), np.float32) * 0.03).astype(jnp.bfloat16) for _ in range(e)]
             for _ in range(layers)]
    records: list[dict] = []
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    emit(records, {"transparent_hugepage": thp.read_text().strip() if thp.exists() else None,
                   "anon_huge_pages_kb": huge_pages_kb()})
    for fmt in args.formats:
        for alloc in args.alloc if fmt == "bf16" else ["numpy"]:
            keep: list = []
            if fmt == "bf16":
                refs = tuple([placed(layer, alloc, keep) for layer in part] for part in (gate_ups, downs))
                weights = [cpu_ffn.HostWeights(addresses(gu), addresses(dn)) for gu, dn in zip(*refs)]
            else:
                weights, refs = quantized(gate_ups, downs, fmt, keep)
            emit(records, {"alloc": alloc, "format": fmt, "anon_huge_pages_kb": huge_pages_kb()})
            measure(args, records, devices, weights, refs, f"{fmt}/{alloc}")
    probe_result("host_experts_bridge", devices, records, args.out, hidden=d, intermediate=f, layers=layers,
                 experts=e, picks=args.picks)


def measure(args, records, devices, weights, refs, alloc: str) -> None:
    """The check and the timings of one way of storing the host experts: `weights` per layer, `refs` their dense
    bf16 (gate_ups, downs) per layer and expert; `alloc` labels the records."""
    accel = devices.accel
    d, f, layers, e = args.hidden, args.intermediate, args.layers, args.experts
    gate_ups, downs = refs
    rng = np.random.default_rng(0)
    bridge = host_experts.Bridge.create(weights, (d, f), accel, 1, args.picks)
    emit(records, {"alloc": alloc, "bridge_created": bridge is not None, "why_not": host_experts.why_not(),
                   "cpu_kernel_isa": cpu_ffn.isa(), "cpu_kernel_threads": cpu_ffn.threads()})
    if bridge is None:
        return
    # an expert's stored bytes: its weights at `bits` a value (scales, 1/64 of int4's and less, not counted)
    expert_bytes = (gate_ups[0][0].size + downs[0][0].size) * weights[0].bits // 8
    mix = jax.device_put((rng.standard_normal((d, d), np.float32) / np.sqrt(d)).astype(jnp.bfloat16), accel)

    def chain(x, ids, coef, use_bridge: bool, matmuls: int):
        ys = []
        for m in range(layers):
            h = x.astype(jnp.bfloat16)
            picks = jnp.maximum(ids[m], 0)
            if use_bridge:
                h, picks = host_experts.begin(bridge, m, h, ids[m], coef[m], picks)
            g = h
            for _ in range(matmuls):
                g = jnp.dot(g, mix, preferred_element_type=F32).astype(jnp.bfloat16)
            g = g.astype(F32) + 0 * picks[0]
            y = host_experts.end(bridge, g, 1, d) if use_bridge else jnp.zeros((1, d), F32)
            ys.append(y)
            x = x + 0.1 * (y + g)
        return x, jnp.stack(ys)

    def inputs(n_host: int, seed: int):
        r = np.random.default_rng(seed)
        ids = np.full((layers, args.picks), -1, np.int32)
        for m in range(layers):
            ids[m, :n_host] = r.choice(e, n_host, replace=False)
        coef = np.where(ids >= 0, r.uniform(0.05, 0.3, ids.shape), 0.0).astype(np.float32)[:, :, None]
        x = r.standard_normal((1, d)).astype(np.float32)
        return jax.device_put((x, ids, coef), accel)

    # correctness: every layer's host sum against XLA's on the GPU, for the inputs the program saw
    run = jax.jit(chain, static_argnums=(3, 4))
    x, ids, coef = inputs(min(4, args.picks), 1)
    _, ys = run(x, ids, coef, True, 1)
    xs = [x]  # the per-layer inputs, recomputed on the host side of the check
    ids_h, coef_h, ys_h = np.asarray(ids), np.asarray(coef), np.asarray(ys)
    errs, scale = [], []
    xcur = x
    for m in range(layers):
        h = xcur.astype(jnp.bfloat16)
        want = sum(float(coef_h[m, u, 0]) * expert_ffn(h, jnp.asarray(gate_ups[m][i]), jnp.asarray(downs[m][i])
                                                        ).astype(F32)
                   for u, i in enumerate(ids_h[m]) if i >= 0)
        errs.append(float(jnp.max(jnp.abs(want - ys_h[m]))))
        scale.append(float(jnp.max(jnp.abs(want))))
        g = h
        g = jnp.dot(g, mix, preferred_element_type=F32).astype(jnp.bfloat16).astype(F32)
        xcur = xcur + 0.1 * (jnp.asarray(ys_h[m]) + g)
    emit(records, {"alloc": alloc, "check": "host sum vs XLA on the GPU", "max_abs": max(errs), "max_ref": max(scale),
                   "relative": max(errs) / max(max(scale), 1e-30), "stats": bridge.stats()})
    del xs

    for matmuls in args.gpu_matmuls:
        base = None
        for use_bridge, counts in ((False, [0]), (True, args.host_counts)):
            for n_host in counts:
                times = []
                for rep in range(args.reps + 2):
                    x, ids, coef = inputs(n_host, 100 + rep)
                    jax.block_until_ready((x, ids, coef))
                    t0 = time.perf_counter()
                    jax.block_until_ready(run(x, ids, coef, use_bridge, matmuls))
                    if rep >= 2:
                        times.append(time.perf_counter() - t0)
                ms = statistics.median(times) * 1e3 / layers
                if not use_bridge:
                    base = ms
                nbytes = n_host * expert_bytes
                emit(records, {"alloc": alloc, "bridge": use_bridge, "host_experts": n_host, "gpu_matmuls": matmuls,
                               "ms_per_layer": round(ms, 4), "over_gpu_alone_ms": round(ms - base, 4),
                               "host_GBps": round(nbytes / (ms * 1e-3) / 1e9, 1) if n_host else None})
    emit(records, {"alloc": alloc, "stats": bridge.stats()})
    bridge.close()


if __name__ == "__main__":
    main()
