"""Where the whole-model (plain) decode step spends its time on the accelerator.

Loads `--model` with seeded random weights and no offloading (`pdscope_jax.load(..., policy=None)`), optionally
with quantized experts (`--quantize int8|int4`), runs a `--prompt`-token prompt, then times `--steps` decode steps
one by one (each waited for) and traces `--profile-steps` more under `jax.profiler.trace`
(`probe_decode_step.kernel_profile`): busy accelerator microseconds and kernels per step, and the kinds of kernel
by time; the greedy tokens of the timed steps. The step's wall time beside its busy time says how much is launch
gaps and host work. XLA_FLAGS is recorded: run it under different flags to compare.
Run from the repository root:
`PYTHONPATH=. python benchmarks/probes/probe_plain_decode.py [--quantize int4] [--out FILE]`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import jax
import numpy as np

import pdscope_jax
from _common import emit, probe_result
from probe_decode_step import kernel_profile


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="deepseek-v2-lite")
    parser.add_argument("--quantize", nargs="+", default=["none"], help="none, int8, int4: one record each")
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--profile-steps", type=int, default=8)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)

    records = []
    for quant in args.quantize:
        model = pdscope_jax.load(args.model, weights="random", quantize=None if quant == "none" else quant)
        ids = np.random.default_rng(0).integers(0, min(1000, model.config.vocab_size), (1, args.prompt), dtype=np.int32)
        total = args.steps + args.profile_steps + 8
        steps = model.steps(ids, max_new_tokens=total)
        for _ in range(4):  # prefill and the first steps: compilation
            jax.block_until_ready(next(steps))
        times, tokens = [], []
        for _ in range(args.steps):
            start = time.perf_counter()
            sampled = jax.block_until_ready(next(steps))
            times.append(time.perf_counter() - start)
            tokens.append(int(np.asarray(sampled.token).reshape(-1)[0]))

        def run_steps():
            for _ in range(args.profile_steps):
                jax.block_until_ready(next(steps))

        profile = kernel_profile(run_steps, args.profile_steps, args.top)
        steps.close()
        ms = statistics.median(times) * 1e3
        emit(records, {"quantize": quant, "prompt": args.prompt, "step_ms_median": ms,
                       "step_ms_min": min(times) * 1e3, "tok_s": 1e3 / ms,
                       "busy_ms_per_step": profile["busy_us_per_step"] / 1e3,
                       "kernels_per_step": profile["kernels_per_step"], "tokens": tokens, "profile": profile})
        del model, steps
    devices = argparse.Namespace(accel=jax.devices()[0])
    return probe_result("plain decode step: wall and accelerator busy time, kernels (random weights)", devices,
                        records, args.out, model=args.model, xla_flags=os.environ.get("XLA_FLAGS", ""),
                        gpu_kernels=os.environ.get("PDSCOPE_GPU_KERNELS", "1"))


if __name__ == "__main__":
    main()
