"""The GPU gather-matvec kernel's tiles (`kernels.gather_matvec.Tiles`) swept on the shapes whole-model decode runs.

For each shape of DeepSeek-V2-Lite's decode step (six routed picks of 64 experts' gate_up and down; one row of the
shared experts', the attention's q and o, the lm_head; Qwen3-30B-A3B's routed experts) and each candidate cut
(`--quantize int4`: weights quantized as the engine stores them, a tile one scale group, so block_k does not vary),
compiles the kernel, then traces `--calls` calls of every cut of a shape (random bf16 weights, weights larger than
the L2 cache where the model's are: a stack of copies cycled through) and reads each cut's kernel time from the
trace by the kernel's name (its wall time a call, each waited for, where the trace does not name it). The reduction
of K's parts, where a cut splits K, is a separate small kernel not counted. Records per shape and cut: microseconds
a call and GB/s of the weights read, best first; the default cut's (`tiles_for`) beside them.
Run from the repository root: `PYTHONPATH=. python benchmarks/probes/probe_matvec_tiles.py [--out FILE]`.
"""

from __future__ import annotations

import argparse
import collections
import itertools
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.profiler import ProfileData

from _common import emit, probe_result
from pdscope_jax.kernels import gather_matvec as gm
from pdscope_jax.quant.formats import quantize

SHAPES = {  # name: (rows, K, N, stacked weights)
    "experts_gate_up": (6, 2048, 2816, 64), "experts_down": (6, 1408, 2048, 64),
    "shared_gate_up": (1, 2048, 5632, 8), "shared_down": (1, 2816, 2048, 8),
    "q_proj": (1, 2048, 3072, 8), "o_proj": (1, 2048, 2048, 8), "lm_head": (1, 2048, 102400, 1),
    # Qwen3-30B-A3B's routed experts (eight picks of 128): run with --quantize int4, its decode's format
    "qwen3_gate_up": (8, 2048, 1536, 128), "qwen3_down": (8, 768, 2048, 128),
}


def candidates(int4: bool = False) -> list[gm.Tiles]:
    if int4:  # a tile is one scale group whatever block_k says: the other settings vary
        cuts = [gm.Tiles(block_n=n, programs=p) for n, p in itertools.product((64, 128, 256), (1056, 2112, 4224))]
        cuts += [gm.TILES._replace(num_warps=w, num_stages=s) for w, s in itertools.product((4, 8), (2, 3, 4))]
        return list(dict.fromkeys([gm.TILES, *cuts]))
    cuts = [gm.Tiles(block_n=n, block_k=k, programs=p) for n, k, p in
            itertools.product((64, 128, 256), (32, 64, 128), (528, 1056, 2112))]
    cuts += [gm.TILES._replace(num_warps=w, num_stages=s) for w, s in itertools.product((2, 4, 8), (2, 3, 4, 5))]
    return list(dict.fromkeys([gm.TILES, *cuts]))


def kernel_us(run, names: set[str]) -> dict[str, float]:
    """Total microseconds of the trace's kernels per name in `names`, while `run()` runs."""
    totals = collections.Counter()
    with tempfile.TemporaryDirectory() as directory:
        with jax.profiler.trace(directory):
            run()
        (trace,) = Path(directory).rglob("*.xplane.pb")
        data = ProfileData.from_file(str(trace))
    for plane in data.planes:
        if plane.name.startswith("/device:"):
            for line in plane.lines:
                for event in line.events:
                    # the longest name the kernel's starts with: one cut's name may begin another's
                    hit = max((name for name in names if event.name.startswith(name)), key=len, default=None)
                    if hit:
                        totals[hit] += event.duration_ns / 1e3
    return totals


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--quantize", default=None, choices=[None, "int4"], help="weights quantized (int4: the "
                        "decode's int4 expert kernel; the cut's block_k is then the scale group)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)

    rng = np.random.default_rng(0)
    records = []
    for shape in args.shapes:
        a, k, n, stack = SHAPES[shape]
        w = jnp.asarray(rng.standard_normal((stack, k, n), np.float32) * 0.02, jnp.bfloat16)
        if args.quantize:
            w = quantize(w, args.quantize)
            jax.block_until_ready(jax.tree.leaves(w))
        x = jnp.asarray(rng.standard_normal((a, k), np.float32), jnp.bfloat16)
        picks = [jnp.asarray(rng.permutation(stack)[:a] if a <= stack else rng.integers(0, stack, a), jnp.int32)
                 for _ in range(args.calls)]
        cuts = [t for t in candidates(args.quantize == "int4") if n % t.block_n == 0 and k % t.block_k == 0]
        ok = []
        for tiles in cuts:
            try:
                jax.block_until_ready(gm.gather_matvec(x, w, picks[0], tiles=tiles))
                ok.append(tiles)
            except Exception as err:  # noqa: BLE001 (a cut Triton cannot compile is reported, not fatal)
                emit(records, {"shape": shape, "tiles": tiles._asdict(), "error": str(err)[:200]})

        wall = collections.Counter()

        def run():
            for tiles in ok:
                start = time.perf_counter()
                for idx in picks:
                    jax.block_until_ready(gm.gather_matvec(x, w, idx, tiles=tiles))
                wall[tiles] = (time.perf_counter() - start) * 1e6 / len(picks)

        totals = kernel_us(run, {gm.kernel_name(t) for t in ok})
        nbytes = a * sum(leaf.nbytes for leaf in jax.tree.leaves(w)) // stack
        # by the trace's kernel time where the trace names the kernels, else by wall time (launch included)
        traced = any(totals.values())
        rows = sorted(({"tiles": t._asdict(), "wall_us": wall[t],
                        "us": totals[gm.kernel_name(t)] / args.calls if traced else wall[t]} for t in ok),
                      key=lambda r: r["us"])
        for r in rows:
            r["gb_s"] = nbytes / r["us"] / 1e3 if r["us"] else None
        default_cut = gm.tiles_for(n)
        if args.quantize:  # the int4 candidates keep TILES' block_k (a tile is a scale group whatever it says)
            default_cut = default_cut._replace(block_k=gm.TILES.block_k)
        default = next((r for r in rows if gm.Tiles(**r["tiles"]) == default_cut), None)
        emit(records, {"shape": shape, "rows": a, "k": k, "n": n, "weight_bytes": nbytes, "timed_by":
                       "trace" if traced else "wall", "default": default,
                       "best": rows[:5], "all": rows})
    devices = argparse.Namespace(accel=jax.devices()[0])
    what = "random bf16 weights" + (f", {args.quantize}" if args.quantize else "")
    return probe_result(f"gather_matvec tiles on decode's shapes ({what})", devices, records, args.out)


if __name__ == "__main__":
    main()
