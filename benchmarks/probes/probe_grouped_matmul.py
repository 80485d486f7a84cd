"""Prefill's routed experts as a grouped matmul: the project's paths against tokamax's `ragged_dot` kernels.

One DeepSeek-V2-Lite MoE layer (hidden 2,048, experts of width 1,408, top-6 of 64) at `--tokens` tokens routed
uniformly at random (seeded), its experts in a stack of `--slots` slots (64: the whole model's layer; 1,664: the
offload engine's pool of every expert, the layer's 64 at random slots, as `combine_experts` sees them). Variants:
  tiled        `models.experts.combine_experts` as the model runs it (bf16: the tiled path at these sizes; int4 /
               int8: the project's `QuantizedWeight`s, dequantized per tile);
  xla          sort by slot + `jax.lax.ragged_dot` (gate/up, swiglu, down) + the weighted sum, bf16;
  tokamax      the same with `tokamax.ragged_dot(implementation="mosaic")` (Pallas Mosaic GPU kernels; on a Hopper
               GPU the sm90 kernel); with `--quant int4 | int8` the right-hand sides are qwix `QArray`s quantized
               from the same bf16 weights (groups of 64 rows for int4, one scale a column for int8), which its
               quantized sm90 kernel multiplies without a dequantized copy.
Each variant: compiled, `--warmup` runs, then `--reps` runs waited for one by one; the record has the median ms,
the routed FLOPs / ms as TFLOP/s, and the largest difference from the first variant's output of the same precision,
relative to its largest value (int4 / int8: qwix's scales are not the project's, so that includes the two schemes').
A variant that fails (tokamax absent, a kernel that does not support the shapes) records its error and the run
goes on. Random weights. tokamax needs Python >= 3.12 and jax >= 0.11.1 (the GPU node; install its wheels with
`pip install --no-deps --target DIR` and put DIR on PYTHONPATH).
Run from the repository root: `PYTHONPATH=. python benchmarks/probes/probe_grouped_matmul.py [--out FILE]`.
"""

from __future__ import annotations

import argparse
import statistics
import time
import traceback
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from _common import emit, probe_result
from pdscope_jax.models.experts import combine_experts, swiglu
from pdscope_jax.quant.formats import quantize

F32 = jnp.float32
VARIANTS = ("tiled", "xla", "tokamax")


def routed_by_groups(x, weights, slots, gate_up, down, ragged):
    """sum_k weights[n, k] * FFN of x[n] through slot slots[n, k], the assignments sorted by slot and each slot's
    rows one group of `ragged(lhs, rhs, group_sizes)` (jax.lax.ragged_dot's signature) -> [N, D] float32."""
    n, k = slots.shape
    flat = slots.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    token_of = order // k
    sizes = jnp.bincount(flat, length=gate_up.shape[0]).astype(jnp.int32)
    h = ragged(x[token_of], gate_up, sizes)  # [N*K, 2F]
    y = ragged(swiglu(h.astype(F32)).astype(x.dtype), down, sizes).astype(F32)
    y = y * weights.reshape(-1)[order, None]
    return jnp.zeros((n, x.shape[1]), F32).at[token_of].add(y)


def _qarray(w, quant: str):
    import qwix

    if quant == "int4":
        return qwix.quantize(w, jnp.int4, channelwise_axes=(0, 2), tiled_axes={1: 64})
    return qwix.quantize(w, jnp.int8, channelwise_axes=(0, 2))


def variant_fn(name: str, quant: str | None, slot_of, gate_up, down, implementation: str = "mosaic"):
    """(fn(x, weights, ids) -> [N, D] float32, the weights it reads) of a variant."""
    if name == "tiled":
        w = (gate_up, down) if quant is None else (quantize(gate_up, quant), quantize(down, quant))
        return (lambda x, weights, ids, gu, dn: combine_experts(x, weights, ids, gu, dn, slot_of, out_dtype=F32)), w
    if name == "xla":
        if quant is not None:
            raise NotImplementedError("jax.lax.ragged_dot takes dense weights only")
        ragged = lambda lhs, rhs, sizes: jax.lax.ragged_dot(lhs, rhs, sizes, preferred_element_type=F32)  # noqa: E731
        w = (gate_up, down)
    else:
        import tokamax

        ragged = lambda lhs, rhs, sizes: tokamax.ragged_dot(  # noqa: E731
            lhs, rhs, sizes, preferred_element_type=F32, implementation=implementation)
        w = (gate_up, down) if quant is None else (_qarray(gate_up, quant), _qarray(down, quant))
    return (lambda x, weights, ids, gu, dn: routed_by_groups(x, weights, slot_of[ids], gu, dn, ragged)), w


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=1408)
    parser.add_argument("--num-experts", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=6)
    parser.add_argument("--tokens", type=int, nargs="+", default=[512, 4096])
    parser.add_argument("--slots", type=int, nargs="+", default=[64, 1664])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--quant", nargs="+", default=["none", "int4"], choices=["none", "int8", "int4"])
    parser.add_argument("--tokamax-implementation", default="mosaic", help="xla: its reference path (a CPU check)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    d, f, e, k = args.hidden, args.intermediate, args.num_experts, args.top_k
    rng = np.random.default_rng(0)
    records: list[dict] = []
    for slots in args.slots:
        keys = jax.random.split(jax.random.key(slots), 2)
        gate_up = jax.random.normal(keys[0], (slots, d, 2 * f), jnp.bfloat16) * 0.02  # drawn in bf16: 19 GB at 1,664
        down = jax.random.normal(keys[1], (slots, f, d), jnp.bfloat16) * 0.02
        slot_of = jnp.asarray(rng.permutation(slots)[:e], jnp.int32)
        for tokens in args.tokens:
            x = jnp.asarray(rng.standard_normal((tokens, d)), jnp.bfloat16)
            ids = jnp.asarray(np.argsort(rng.random((tokens, e)), axis=1)[:, :k], jnp.int32)
            weights = jax.nn.softmax(jnp.asarray(rng.standard_normal((tokens, k)), F32), axis=-1)
            flops = 2 * tokens * k * 3 * d * f
            for quant in args.quant:
                q, baseline = (None if quant == "none" else quant), None
                for name in args.variants:
                    record = {"slots": slots, "tokens": tokens, "quant": quant, "variant": name}
                    try:
                        fn, (gu, dn) = variant_fn(name, q, slot_of, gate_up, down, args.tokamax_implementation)
                        run = jax.jit(fn)
                        out = run(x, weights, ids, gu, dn).block_until_ready()
                        for _ in range(args.warmup):
                            run(x, weights, ids, gu, dn).block_until_ready()
                        times = []
                        for _ in range(args.reps):
                            t0 = time.perf_counter()
                            run(x, weights, ids, gu, dn).block_until_ready()
                            times.append((time.perf_counter() - t0) * 1e3)
                        ms = statistics.median(times)
                        if baseline is None:
                            baseline = out
                        diff = float(jnp.max(jnp.abs(out - baseline)) / jnp.max(jnp.abs(baseline)))
                        record.update(ms=ms, tflops=flops / ms / 1e9, rel_diff_to_first=diff)
                    except Exception as err:  # noqa: BLE001 (a variant that cannot run is recorded, not fatal)
                        record["error"] = f"{type(err).__name__}: {str(err)[:400]}"
                        if not isinstance(err, (ImportError, NotImplementedError)):
                            traceback.print_exc()
                    emit(records, record)
        del gate_up, down
    devices = argparse.Namespace(accel=jax.devices()[0])
    return probe_result("prefill's routed experts as a grouped matmul (random weights)", devices, records,
                        args.out, hidden=d, intermediate=f, num_experts=e, top_k=k)


if __name__ == "__main__":
    main()
