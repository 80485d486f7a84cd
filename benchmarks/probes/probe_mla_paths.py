"""Whole-model decode of an MLA model (DeepSeek) by attention path and cache length, in one process.

Loads `--model` once with seeded random weights (no offloading), then for each prompt length in `--prompts` and
each arm runs one warm-up `generate` (compiles) and `--repeats` timed ones of `--tokens` new tokens (greedy,
`generate`'s default of 32 decode steps a program). Arms: `expanded` (every cached position expanded into per-head
keys and values, `models.deepseek.LATENT_MAX_QUERY` = 0), `latent` (decode attends in the latent space whatever
the cache's length, `LATENT_MIN_CACHE` = 0), and at the first prompt length `latent-select-sampler` (the latent
path with the chunk programs' sampler drawing for greedy rows too, `generation.generator.CHUNK_SAMPLER_BRANCHES` =
False). The arms change module constants read while tracing, so every arm starts from `jax.clear_caches()`.
Records per (prompt, arm): decode tok/s (median and repeats), prefill tok/s, the cache length, the path the
shipped rule takes there, and whether the greedy tokens equal the first arm's at that length (bf16 near-ties may
part them). The results file is rewritten after every record. Run from the repository root:
`PYTHONPATH=. python benchmarks/probes/probe_mla_paths.py --prompts 512 4096 [--out FILE]`. Random weights.
"""

from __future__ import annotations

import argparse

import jax
import numpy as np

import pdscope_jax
from _common import emit, probe_result, timed_generations, whole_model_parser
from pdscope_jax.generation import generator as generation
from pdscope_jax.generation.generator import CACHE_BUCKET, Generator
from pdscope_jax.models import deepseek

SHIPPED = (deepseek.LATENT_MAX_QUERY, deepseek.LATENT_MIN_CACHE)
ARMS = {"expanded": (0, SHIPPED[1], True), "latent": (SHIPPED[0], 0, True),
        "latent-select-sampler": (SHIPPED[0], 0, False)}


def main(argv: list[str] | None = None) -> dict:
    parser = whole_model_parser(__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, nargs="+", default=[512, 4096])
    args = parser.parse_args(argv)

    runner = pdscope_jax.load(args.model, weights="random")
    records = []
    devices = argparse.Namespace(accel=jax.devices()[0])

    def save():
        return probe_result("whole-model decode of an MLA model by attention path and cache length (random weights)",
                            devices, records, args.out, model=args.model, weights="random (seeded, seed 0)",
                            tokens=args.tokens, shipped_rule={"latent_max_query": SHIPPED[0],
                                                              "latent_min_cache": SHIPPED[1]})

    for i, prompt in enumerate(args.prompts):
        ids = np.random.default_rng(0).integers(0, min(1000, runner.config.vocab_size), (1, prompt), dtype=np.int32)
        first = None
        cache_length = -(-(prompt + args.tokens) // CACHE_BUCKET) * CACHE_BUCKET
        for arm, (max_query, min_cache, sampler_branches) in ARMS.items():
            if arm == "latent-select-sampler" and i:
                continue
            deepseek.LATENT_MAX_QUERY, deepseek.LATENT_MIN_CACHE = max_query, min_cache
            generation.CHUNK_SAMPLER_BRANCHES = sampler_branches
            jax.clear_caches()
            generation._compiled.clear()
            record, tokens = timed_generations(Generator(runner.model).generate, ids, args.tokens, args.repeats, first)
            first = first or tokens
            emit(records, {"prompt": prompt, "arm": arm, "cache_length": cache_length,
                           "shipped_path": "latent" if cache_length >= SHIPPED[1] else "expanded", **record})
            save()
    return save()


if __name__ == "__main__":
    main()
