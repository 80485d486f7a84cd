"""`pdscope-jax profile`: the command line of the cost-table measurement (`bench.costs.measure_cost_table`).

Contract: `profile_main(argv) -> dict` parses MODEL and the measurement options, records the command line as
`pdscope-jax profile ARGS`, and returns the saved table as a dict. `parse_args(argv)` is the parsing alone;
`check_args(args)` checks every option before anything is built or measured (model known, buckets, counts
and repeats positive, at least one bucket under --max-tokens, the expert sizes fit --quantize, --quality goes
with --quantize, the output writable) and raises one
`errors.InputError` naming every problem.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    from pdscope_jax.runtime import RuntimeConfig

    p = argparse.ArgumentParser(prog="pdscope-jax profile",
                                description="Measure a model's cost table on the machine at hand.")
    p.add_argument("model", help="preset name or checkpoint directory (only its config.json is read)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--quantize", choices=("int8", "int4"),
                   help="measure experts stored int8 (per channel) or int4 (groups of 64): CPU and GPU expert "
                        "times and transfers of the quantized bytes (a table per precision)")
    p.add_argument("--quality", choices=("int8", "mixed", "int4"),
                   help="also measure the transfer of the int4 copies this quality loads (mixed, int4): the table's "
                        "precision axis")
    p.add_argument("--buckets", nargs="+", type=int, default=list(DEFAULT_BUCKETS), help="token buckets")
    p.add_argument("--max-tokens", type=int, default=None, help="drop buckets above this")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--decode-context", type=int, default=512, help="cached positions a decode step attends to")
    p.add_argument("--decode-max-batch", type=int, default=64, help="largest decode batch measured")
    p.add_argument("--cpu-min-rows", type=int, default=RuntimeConfig.cpu_min_rows,
                   help="the engine's CPU row padding (default: RuntimeConfig's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help="JSON path (default: the cost-table directory)")
    return p.parse_args(argv)


def check_args(args) -> None:
    """Every problem of the options at once (one InputError); reads the model's config only."""
    from pdscope_jax.cli import checks
    from pdscope_jax.errors import raise_problems
    from pdscope_jax.sched.costs import costs_dir

    problems: list[str] = []
    checks.check_model(problems, "MODEL", args.model)
    if args.quantize is not None and not problems:
        from pdscope_jax.api import quantize_problems, resolve

        problems += [f"--quantize {args.quantize}: {p}" for p in quantize_problems(resolve(args.model)[0],
                                                                                  args.quantize)]
    from pdscope_jax.sched.precision import quality_problems

    problems += [f"--quality {args.quality}: {p}" for p in quality_problems(args.quality, args.quantize)]
    checks.check_ints(problems, "--buckets", args.buckets)
    checks.check_int(problems, "--max-tokens", args.max_tokens)
    if args.max_tokens is not None and args.buckets and all(isinstance(b, int) and b > args.max_tokens
                                                            for b in args.buckets):
        problems.append(f"--max-tokens {args.max_tokens} drops every bucket of --buckets {args.buckets}: raise it "
                        "or add smaller buckets")
    for flag, value in (("--repeats", args.repeats), ("--decode-context", args.decode_context),
                        ("--decode-max-batch", args.decode_max_batch), ("--cpu-min-rows", args.cpu_min_rows)):
        checks.check_int(problems, flag, value)
    checks.check_seed(problems, "--seed", args.seed)
    if args.out is not None:
        checks.check_writable_file(problems, "--out", args.out)
    else:
        checks.check_writable_dir(problems, "the cost-table folder (--out unset; $PDSCOPE_JAX_COSTS)", costs_dir())
    raise_problems(problems, "bad arguments")


def profile_main(argv: list[str] | None = None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    check_args(args)
    from pdscope_jax.bench.costs import measure_cost_table

    return measure_cost_table(args, shlex.join(["pdscope-jax", "profile", *argv]))


if __name__ == "__main__":
    profile_main()
