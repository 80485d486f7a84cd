"""The main job: the whole pipeline on the embedded default model, policies side by side.

Contract: `main(argv)` loads the embedded reference MoE (`pdscope_jax.load("reference-moe")`, a small
DeepSeek-V2-architecture model trained on the Python standard library) and its PhasePer predictors
(shipped in `pdscope_jax/assets/predictors/reference-moe`), prints a plain generation, then runs the same prompt
under every offloading policy with an expert pool that holds only a fraction of the routed experts, and prints
per phase: tokens/s, slot hit rate, prefetch accuracy, exposed transfer time, CPU/GPU expert counts, and whether
the tokens equal the plain model's (they must: policies change placement, never results; the exit status is 1
when any policy's tokens differ). Arguments are checked before anything loads (one `errors.InputError`).

On a machine without a GPU, a second CPU device stands in for the accelerator: the figures then show the
mechanics (hits, transfers, prefetch accuracy), not GPU speed.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from pdscope_jax.cli.options import add_quantize
from pdscope_jax.sched import COMPARED

PROMPT = '''import os
import sys


def read_config(path):
    """Read a configuration file and return a dict."""
    result = {}
    with open(path) as f:
        for line in f:
'''
REFERENCE_PREDICTORS = Path(__file__).resolve().parents[1] / "assets" / "predictors" / "reference-moe"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdscope-jax run", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="reference-moe")
    parser.add_argument("--predictors", type=Path, default=REFERENCE_PREDICTORS,
                        help="PhasePer checkpoint directory (skipped with a note when absent)")
    parser.add_argument("--prompt", default=PROMPT)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--expert-pool-fraction", type=float, default=0.25,
                        help="share of all routed experts the GPU slot pool may hold")
    parser.add_argument("--policies", nargs="+", default=list(COMPARED),
                        help="offloading policies (default: %(default)s)")
    parser.add_argument("--dtype", default="float32", help="float32 on CPU: XLA:CPU bf16 is slow at few rows")
    add_quantize(parser)
    parser.add_argument("--max-seq-len", type=int, default=1024,
                        help="tokens (prompt plus new) the offloaded KV cache holds (default: %(default)s)")
    args = parser.parse_args(argv)
    check_args(args)

    import numpy as np
    from rich.console import Console
    from rich.table import Table

    import pdscope_jax
    from pdscope_jax.runtime import request_cpu_stand_in, select_devices

    request_cpu_stand_in()  # without a GPU, cpu:1 stands in for the accelerator and cpu:0 is the CPU backend

    console = Console(width=None if sys.stdout.isatty() else 150)
    started = time.perf_counter()
    plain = pdscope_jax.load(args.model, dtype=args.dtype, quantize=args.quantize)
    reference = plain.generate(args.prompt, max_new_tokens=args.new_tokens)
    console.rule(f"{args.model}: plain model, whole on one device")
    console.print(args.prompt + f"[bold green]{reference.text[0]}[/]", highlight=False)
    console.print(f"prefill {reference.prefill_tokens_per_s:.0f} tok/s, "
                  f"decode {reference.decode_tokens_per_s:.1f} tok/s")

    cfg = plain.config
    itemsize = np.dtype(args.dtype).itemsize
    all_experts = len(cfg.moe_layers) * cfg.num_experts
    pool_bytes = int(args.expert_pool_fraction * all_experts * cfg.expert_bytes(itemsize))
    predictors = args.predictors if (args.predictors / "manifest.json").exists() else None
    if predictors is None:
        console.print(f"[yellow]no PhasePer checkpoint at {args.predictors}: pdscope and fate use the next layer's "
                      "gate on the current hidden state as their predictor")
    else:
        console.print(f"PhasePer checkpoint: {predictors}")
    runner = pdscope_jax.load(args.model, dtype=args.dtype, quantize=args.quantize, policy=args.policies[0],
                              predictors=predictors,
                              gpu_memory="4GB", expert_pool=pool_bytes, max_seq_len=args.max_seq_len)
    engine = runner.engine
    devices = select_devices()
    console.rule(f"offloaded: {engine.pool.num_slots} of {all_experts} experts fit the slot pool "
                 f"(accelerator {devices.accel}, CPU backend {devices.cpu})")
    table = Table("policy", "same tokens", "prefill tok/s", "decode tok/s", "hit rate (p/d)",
                  "prefetch acc. (p/d)", "exposed transfer s", "GPU/CPU experts (decode)")
    prompt_len = len(plain.tokenizer.encode(args.prompt))
    mismatched = []
    for policy in args.policies:
        engine.set_policy(policy)
        engine.warmup(1, prompt_len, args.new_tokens)  # compile, then start from an empty pool
        out = runner.generate(args.prompt, max_new_tokens=args.new_tokens)
        pre, dec = engine.stats["prefill"], engine.stats["decode"]
        same = np.array_equal(out.tokens, reference.tokens)
        if not same:
            mismatched.append(policy)
        table.add_row(
            policy, "yes" if same else "[red]NO",
            f"{out.prefill_tokens_per_s:.0f}", f"{out.decode_tokens_per_s:.1f}",
            f"{_pct(pre['hit_rate'])} / {_pct(dec['hit_rate'])}",
            f"{_pct(pre['prefetch_accuracy'])} / {_pct(dec['prefetch_accuracy'])}",
            f"{pre['exposed_transfer_seconds'] + dec['exposed_transfer_seconds']:.3f}",
            f"{dec['gpu_experts']} / {dec['cpu_experts']}")
    console.print(table)
    console.print(f"total {time.perf_counter() - started:.1f} s")
    if mismatched:
        console.print(f"[red]tokens differ from the plain model under: {', '.join(mismatched)}")
        return 1
    return 0


def check_args(args) -> None:
    """Everything checkable before loading: policies, dtype, token count, pool fraction (one InputError)."""
    import math

    from pdscope_jax.api import DTYPES
    from pdscope_jax.errors import collect, raise_problems
    from pdscope_jax.sched import check_policy

    problems: list[str] = []
    for policy in args.policies:
        collect(problems, check_policy, policy)
    if args.dtype not in DTYPES:
        problems.append(f"--dtype {args.dtype!r} is not supported; supported: {', '.join(DTYPES)}")
    if args.new_tokens < 1:
        problems.append(f"--new-tokens must be >= 1, got {args.new_tokens}")
    if args.max_seq_len < 1:
        problems.append(f"--max-seq-len must be >= 1, got {args.max_seq_len}")
    if not (math.isfinite(args.expert_pool_fraction) and 0 < args.expert_pool_fraction <= 1):
        problems.append(f"--expert-pool-fraction must lie in (0, 1], got {args.expert_pool_fraction}")
    raise_problems(problems, "bad arguments")


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.0f}%"
