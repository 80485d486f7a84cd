"""The `pdscope-jax` command line: one module per command in this folder, imported only when it runs.

    pdscope-jax run                                                the main job on the embedded default model
    pdscope-jax generate MODEL [--prompt TEXT | --ids 1,2,3] ...   plain or offloaded generation
    pdscope-jax bench ...                                          policies side by side
    pdscope-jax collect-traces ...                                 routing traces for PhasePer
    pdscope-jax train-predictors ...                               PhasePer predictors from traces
    pdscope-jax profile ...                                        cost table for AdaptSched

Contract: `main(argv) -> int` hands the arguments after the command's name to that module's function and
returns its exit status (0 when it returns something other than an int). A bad input error (unknown model,
corrupt checkpoint, budget too small, ...) is printed as one line on stderr with status 2; no command or an
unknown one prints the usage (status 2; 0 for -h/--help). This module imports nothing heavier than argparse, so
`pdscope-jax --help` does not start JAX.
"""

from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS = {  # name: (module, function, help)
    "run": ("pdscope_jax.cli.run", "main", "the whole pipeline on the embedded reference MoE, policies side by side"),
    "generate": ("pdscope_jax.cli.generate", "main", "generate text or token ids with a model"),
    "bench": ("pdscope_jax.cli.bench", "main", "benchmark offloading policies"),
    "collect-traces": ("pdscope_jax.cli.collect_traces", "collect_traces_main", "record routing traces for PhasePer"),
    "train-predictors": ("pdscope_jax.cli.train_predictors", "train_predictors_main", "train PhasePer on collected traces"),
    "profile": ("pdscope_jax.cli.profile", "profile_main", "measure the cost table of a model on this machine"),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="pdscope-jax", description="Phase-adaptive MoE offloading on JAX.")
    parser.add_argument("command", choices=sorted(COMMANDS), help="; ".join(f"{k}: {v[2]}" for k, v in COMMANDS.items()))
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        return 0 if argv else 2
    args = parser.parse_args(argv[:1])
    module, function, _ = COMMANDS[args.command]
    command = getattr(importlib.import_module(module), function)
    try:
        result = command(argv[1:])
    except _user_errors() as err:
        # Every such error names the problem and the fix, so show the message, not a traceback.
        print(f"pdscope-jax {args.command}: error: {err}", file=sys.stderr)
        return 2
    return result if isinstance(result, int) else 0


def _user_errors() -> tuple[type[Exception], ...]:
    from pdscope_jax.config import ConfigError
    from pdscope_jax.phaseper.checkpoint import PredictorCheckpointError
    from pdscope_jax.phaseper.traces import TraceError
    from pdscope_jax.presets import UnknownModelError
    from pdscope_jax.runtime import RuntimeConfigError
    from pdscope_jax.sched.costs import CostTableError
    from pdscope_jax.store.budget import BudgetError
    from pdscope_jax.weights.checkpoint import CheckpointError

    return (UnknownModelError, ConfigError, CheckpointError, BudgetError, RuntimeConfigError, CostTableError,
            PredictorCheckpointError, TraceError, FileNotFoundError)


if __name__ == "__main__":
    sys.exit(main())
