"""Whole-model decode throughput with the branch-free sampler against the one with conditionals, in one process.

Loads `--model` with seeded random weights and no offloading, then per sampler (`sampler_variants.use`: "select",
the package's, or "conditional") runs one warm-up `generate` and `--repeats` timed ones of `--tokens` new tokens
after a `--prompt`-token prompt (greedy; generate does not wait for each step, so the host may run ahead of the
GPU). Records per sampler: decode tok/s (median and repeats), prefill tok/s, and whether the greedy tokens equal
the first sampler's. Run from the repository root:
`PYTHONPATH=. python benchmarks/probes/probe_sampler_sync.py [--out FILE]`. Random weights.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import jax
import numpy as np

import pdscope_jax
import sampler_variants
from _common import emit, probe_result


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="deepseek-v2-lite")
    parser.add_argument("--samplers", nargs="+", default=["select", "conditional"],
                        choices=list(sampler_variants.KINDS))
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)

    model = pdscope_jax.load(args.model, weights="random")
    ids = np.random.default_rng(0).integers(0, min(1000, model.config.vocab_size), (1, args.prompt), dtype=np.int32)
    records, first = [], None
    for kind in args.samplers:
        sampler_variants.use(kind)
        model.generate(ids, args.tokens)  # compiles
        runs = [model.generate(ids, args.tokens) for _ in range(args.repeats)]
        tokens = runs[-1].tokens[0].tolist()
        first = tokens if first is None else first
        emit(records, {"sampler": kind, "decode_tok_s": statistics.median(r.decode_tokens_per_s for r in runs),
                       "decode_tok_s_repeats": [r.decode_tokens_per_s for r in runs],
                       "prefill_tok_s": statistics.median(r.prefill_tokens_per_s for r in runs),
                       "same_tokens_as_first_sampler": tokens == first, "tokens": tokens})
    devices = argparse.Namespace(accel=jax.devices()[0])
    return probe_result("whole-model decode: branch-free sampler vs conditionals (random weights)", devices, records,
                        args.out, model=args.model, weights="random (seeded, seed 0)", prompt=args.prompt,
                        tokens=args.tokens)


if __name__ == "__main__":
    main()
