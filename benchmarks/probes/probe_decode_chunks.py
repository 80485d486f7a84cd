"""Whole-model decode with several decode steps per program (`Generator(decode_chunk=K)`) against one per program.

Loads `--model` with seeded random weights and no offloading, then per K in `--chunks` runs one warm-up `generate`
(compiles) and `--repeats` timed ones of `--tokens` new tokens after a `--prompt`-token prompt (greedy; generate
does not wait for each step). Records per K: decode tok/s (median and repeats), prefill tok/s, and whether the
greedy tokens equal the first K's. XLA_FLAGS is recorded: XLA's command buffers (CUDA graphs) are a per-process
setting for K = 1 (run it once per setting to compare); programs of K > 1 steps carry their own on a GPU
(`generator.CHUNK_COMPILER_OPTIONS`).
Run from the repository root:
`PYTHONPATH=. python benchmarks/probes/probe_decode_chunks.py --chunks 1 8 16 [--out FILE]`. Random weights.
"""

from __future__ import annotations

import argparse
import os
import statistics
from pathlib import Path

import jax
import numpy as np

import pdscope_jax
from _common import emit, probe_result
from pdscope_jax.generation.generator import Generator


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="deepseek-v2-lite")
    parser.add_argument("--chunks", type=int, nargs="+", default=[1, 8, 16])
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)

    runner = pdscope_jax.load(args.model, weights="random")
    ids = np.random.default_rng(0).integers(0, min(1000, runner.config.vocab_size), (1, args.prompt), dtype=np.int32)
    records, first = [], None
    for chunk in args.chunks:
        generator = Generator(runner.model, decode_chunk=chunk)
        generator.generate(ids, args.tokens)  # compiles
        runs = [generator.generate(ids, args.tokens) for _ in range(args.repeats)]
        tokens = runs[-1].tokens[0].tolist()
        first = tokens if first is None else first
        emit(records, {"decode_chunk": chunk, "decode_tok_s": statistics.median(r.decode_tokens_per_s for r in runs),
                       "decode_tok_s_repeats": [r.decode_tokens_per_s for r in runs],
                       "prefill_tok_s": statistics.median(r.prefill_tokens_per_s for r in runs),
                       "same_tokens_as_first_chunk": tokens == first, "tokens": tokens})
    devices = argparse.Namespace(accel=jax.devices()[0])
    return probe_result("whole-model decode: decode steps per program (random weights)", devices, records, args.out,
                        model=args.model, weights="random (seeded, seed 0)", prompt=args.prompt, tokens=args.tokens,
                        xla_flags=os.environ.get("XLA_FLAGS", ""))


if __name__ == "__main__":
    main()
