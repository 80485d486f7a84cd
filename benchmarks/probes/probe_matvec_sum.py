"""Where the gather-matvec kernel adds K's parts: in the call (each output tile's last program) or by XLA after it.

`Tiles.sum_in_kernel` (`kernels.gather_matvec`) picks the arm: "in_kernel" (the default) or "xla" (one more kernel
a call, XLA's reduction of the parts). Part `kernel`: for each of decode's shapes (`probe_matvec_tiles.SHAPES`) and
arm, the product of random bf16 weights against XLA's float32 one, and whether `--repeats` calls give the same bits
(the in-kernel sum must not race); then the time of a call as the trace's kernels of `--calls` calls (every kernel:
the matvec, XLA's sum, the counters' zeroing) and as the wall time of one program of 32 dependent calls compiled
with command buffers (`generator.CHUNK_COMPILER_OPTIONS`), the way decode's chunk programs run.
Part `model`: whole-model decode of `--model` with seeded random weights (`Generator`, 32 steps a program), one
warm-up and `--repeats` timed generations per arm in `--arms` order, in one process (compiled programs are
dropped between arms). Run from the repository root:
`PYTHONPATH=. python benchmarks/probes/probe_matvec_sum.py --parts kernel model [--out FILE]`. Random weights.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.profiler import ProfileData

from _common import emit, probe_result, timed_generations, whole_model_parser
from probe_matvec_tiles import SHAPES
from pdscope_jax.generation import generator as gen
from pdscope_jax.kernels import gather_matvec as gm

CHAIN = 32  # dependent calls in one timed program


def use_arm(arm: str) -> None:
    """Make `tiles_for` (read while a program is traced) give the arm's cuts, and drop what was compiled."""
    in_kernel = arm == "in_kernel"
    gm.TILES, gm.NARROW = (t._replace(sum_in_kernel=in_kernel) for t in (gm.TILES, gm.NARROW))
    gen._compiled.clear()
    jax.clear_caches()


def device_us(run) -> float:
    """Microseconds of every kernel on the device while `run()` runs (from jax's profiler)."""
    total = 0.0
    with tempfile.TemporaryDirectory() as directory:
        with jax.profiler.trace(directory):
            run()
        (trace,) = Path(directory).rglob("*.xplane.pb")
        for plane in ProfileData.from_file(str(trace)).planes:
            if plane.name.startswith("/device:"):
                total += sum(e.duration_ns for line in plane.lines if line.name.startswith("Stream")
                             for e in line.events) / 1e3
    return total


def kernel_part(args, records: list[dict]) -> None:
    rng = np.random.default_rng(0)
    for shape, (a, k, n, stack) in SHAPES.items():
        w = jnp.asarray(rng.standard_normal((stack, k, n), np.float32) * 0.02, jnp.bfloat16)
        x = jnp.asarray(rng.standard_normal((a, k), np.float32), jnp.bfloat16)
        idx = jnp.asarray(rng.permutation(stack)[:a] if a <= stack else rng.integers(0, stack, a), jnp.int32)
        exact = jnp.einsum("ak,akn->an", x.astype(jnp.float32), w[idx].astype(jnp.float32),
                           precision=jax.lax.Precision.HIGHEST)

        def chain(x, w, idx):  # each call's input depends on the last one's output
            for _ in range(CHAIN):
                y = gm.gather_matvec(x, w, idx)
                x = (x.astype(jnp.float32) + 1e-30 * jnp.mean(y, axis=1, keepdims=True)).astype(x.dtype)
            return x

        for arm in args.arms_kernel:
            use_arm(arm)
            call = jax.jit(gm.gather_matvec)
            outs = [np.asarray(call(x, w, idx)) for _ in range(args.repeats_kernel)]
            same_bits = all(np.array_equal(outs[0], o) for o in outs[1:])
            err = float(np.max(np.abs(outs[0] - np.asarray(exact))) / np.max(np.abs(np.asarray(exact))))
            us = device_us(lambda: [jax.block_until_ready(call(x, w, idx)) for _ in range(args.calls)]) / args.calls
            chained = jax.jit(chain).lower(x, w, idx).compile(compiler_options=gen.CHUNK_COMPILER_OPTIONS)
            jax.block_until_ready(chained(x, w, idx))
            walls = []
            for _ in range(5):
                start = time.perf_counter()
                jax.block_until_ready(chained(x, w, idx))
                walls.append((time.perf_counter() - start) * 1e6 / CHAIN)
            emit(records, {"part": "kernel", "shape": shape, "rows": a, "k": k, "n": n, "arm": arm,
                           "splits": gm._splits(a, k // gm._block_k(jnp.bfloat16, None, k, gm.tiles_for(n)),
                                                n // gm.BLOCK_N, gm.TILES.programs),
                           "max_rel_err_vs_f32": err, "same_bits_over_repeats": same_bits,
                           "device_us_per_call": us, "chained_wall_us_per_call": statistics.median(walls)})


def model_part(args, records: list[dict]) -> None:
    import pdscope_jax

    runner = pdscope_jax.load(args.model, weights="random")
    ids = np.random.default_rng(0).integers(0, min(1000, runner.config.vocab_size), (1, args.prompt), dtype=np.int32)
    first = None
    for arm in args.arms:
        use_arm(arm)
        generator = gen.Generator(runner.model, decode_chunk=32)
        record, tokens = timed_generations(generator.generate, ids, args.tokens, args.repeats, first)
        first = first or tokens
        emit(records, {"part": "model", "arm": arm, **record})


def main(argv: list[str] | None = None) -> dict:
    parser = whole_model_parser(__doc__.splitlines()[0])
    parser.add_argument("--parts", nargs="+", default=["kernel"], choices=["kernel", "model"])
    parser.add_argument("--arms", nargs="+", default=["in_kernel", "xla", "in_kernel", "xla"],
                        choices=["in_kernel", "xla"], help="model part: arms in this order")
    parser.add_argument("--arms-kernel", nargs="+", default=["in_kernel", "xla"], choices=["in_kernel", "xla"])
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--repeats-kernel", type=int, default=20)
    args = parser.parse_args(argv)
    records: list[dict] = []
    if "kernel" in args.parts:
        kernel_part(args, records)
    if "model" in args.parts:
        model_part(args, records)
    devices = argparse.Namespace(accel=jax.devices()[0])
    return probe_result("gather_matvec: K's parts added in the kernel or by XLA (random bf16 weights)", devices,
                        records, args.out, model=args.model, weights="random (seeded, seed 0)", prompt=args.prompt,
                        tokens=args.tokens)


if __name__ == "__main__":
    main()
