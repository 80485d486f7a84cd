"""Whole-model decode throughput with the branch-free sampler against the one with conditionals, in one process.

Loads `--model` with seeded random weights and no offloading, then per sampler (`sampler_variants.use`: "select",
the package's; "select_chunks", its chunk programs without their conditional; or "conditional") runs one warm-up
`generate` and `--repeats` timed ones of `--tokens` new tokens after a `--prompt`-token prompt (greedy; generate
does not wait for each step, so the host may run ahead of the GPU). Records per sampler: decode tok/s (median and
repeats), prefill tok/s, and whether the greedy tokens equal the first sampler's (`same_tokens_as_first`). Run from
the repository root:
`PYTHONPATH=. python benchmarks/probes/probe_sampler_sync.py [--out FILE]`. Random weights.
"""

from __future__ import annotations

import argparse

import jax
import numpy as np

import pdscope_jax
import sampler_variants
from _common import emit, probe_result, timed_generations, whole_model_parser


def main(argv: list[str] | None = None) -> dict:
    parser = whole_model_parser(__doc__.splitlines()[0])
    parser.add_argument("--samplers", nargs="+", default=["select", "select_chunks"],
                        choices=list(sampler_variants.KINDS))
    args = parser.parse_args(argv)

    model = pdscope_jax.load(args.model, weights="random")
    ids = np.random.default_rng(0).integers(0, min(1000, model.config.vocab_size), (1, args.prompt), dtype=np.int32)
    records, first = [], None
    for kind in args.samplers:
        sampler_variants.use(kind)
        record, tokens = timed_generations(model.generate, ids, args.tokens, args.repeats, first)
        first = first or tokens
        emit(records, {"sampler": kind, **record})
    devices = argparse.Namespace(accel=jax.devices()[0])
    return probe_result("whole-model decode: branch-free sampler vs conditionals (random weights)", devices, records,
                        args.out, model=args.model, weights="random (seeded, seed 0)", prompt=args.prompt,
                        tokens=args.tokens)


if __name__ == "__main__":
    main()
