"""Whole-model decode with several decode steps per program (`Generator(decode_chunk=K)`) against one per program.

Loads `--model` with seeded random weights and no offloading, then per K in `--chunks` runs one warm-up `generate`
(compiles) and `--repeats` timed ones of `--tokens` new tokens after a `--prompt`-token prompt (greedy; generate
does not wait for each step). Records per K: decode tok/s (median and repeats), prefill tok/s, and whether the
greedy tokens equal the first K's (`same_tokens_as_first`). XLA_FLAGS is recorded: XLA's command buffers (CUDA
graphs) are a per-process setting for K = 1 (run it once per setting to compare); programs of K > 1 steps carry their
own on a GPU (`generator.CHUNK_COMPILER_OPTIONS`). `--trace DIR` records one more generate per K with jax's profiler.
Run from the repository root:
`PYTHONPATH=. python benchmarks/probes/probe_decode_chunks.py --chunks 1 8 16 [--out FILE]`. Random weights.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import jax
import numpy as np

import pdscope_jax
from _common import emit, perfetto_trace, probe_result, timed_generations, whole_model_parser
from pdscope_jax.generation.generator import Generator


def main(argv: list[str] | None = None) -> dict:
    parser = whole_model_parser(__doc__.splitlines()[0])
    parser.add_argument("--chunks", type=int, nargs="+", default=[1, 8, 16])
    parser.add_argument("--trace", type=Path, default=None,
                        help="after each K's repeats, one more generate under jax's profiler: its Perfetto trace "
                             "goes to TRACE/chunk_K.trace.json.gz")
    args = parser.parse_args(argv)

    runner = pdscope_jax.load(args.model, weights="random")
    ids = np.random.default_rng(0).integers(0, min(1000, runner.config.vocab_size), (1, args.prompt), dtype=np.int32)
    records, first = [], None
    for chunk in args.chunks:
        generator = Generator(runner.model, decode_chunk=chunk)
        record, tokens = timed_generations(generator.generate, ids, args.tokens, args.repeats, first)
        first = first or tokens
        emit(records, {"decode_chunk": chunk, **record})
        if args.trace is not None:
            perfetto_trace(lambda: generator.generate(ids, args.tokens), args.trace / f"chunk_{chunk}.trace.json.gz")
    devices = argparse.Namespace(accel=jax.devices()[0])
    return probe_result("whole-model decode: decode steps per program (random weights)", devices, records, args.out,
                        model=args.model, weights="random (seeded, seed 0)", prompt=args.prompt, tokens=args.tokens,
                        xla_flags=os.environ.get("XLA_FLAGS", ""))


if __name__ == "__main__":
    main()
