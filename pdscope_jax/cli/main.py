"""The `pdscope-jax` command line.

Each sub-command hands its remaining arguments to the module that owns the work, imported only when that
sub-command runs (so `pdscope-jax --help` stays fast):

    pdscope-jax run                                                the main job on the embedded default model
    pdscope-jax generate MODEL [--prompt TEXT | --ids 1,2,3] ...   plain or offloaded generation
    pdscope-jax bench ...                                          policies side by side (pdscope_jax.bench.compare)
    pdscope-jax collect-traces ...                                 routing traces for PhasePer
    pdscope-jax train-predictors ...                               PhasePer predictors from traces
    pdscope-jax profile ...                                        cost table for AdaptSched
"""

from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS = {
    "run": ("pdscope_jax.cli.run", "main", "the whole pipeline on the embedded reference MoE, policies side by side"),
    "generate": ("pdscope_jax.cli.generate", "main", "generate text or token ids with a model"),
    "bench": ("pdscope_jax.bench.compare", "main", "benchmark offloading policies"),
    "collect-traces": ("pdscope_jax.phaseper.collect", "collect_traces_main", "record routing traces for PhasePer"),
    "train-predictors": ("pdscope_jax.cli.train_predictors", "train_predictors_main", "train PhasePer on collected traces"),
    "profile": ("pdscope_jax.bench.profile", "profile_main", "measure the cost table of a model on this machine"),
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
        # Bad input (unknown model, corrupt checkpoint, budget too small, ...): every such error names the
        # problem and the fix, so show the message, not a traceback.
        print(f"pdscope-jax {args.command}: error: {err}", file=sys.stderr)
        return 2
    return result if isinstance(result, int) else 0


def _user_errors() -> tuple[type[Exception], ...]:
    from pdscope_jax.config import ConfigError
    from pdscope_jax.store.budget import BudgetError
    from pdscope_jax.phaseper.checkpoint import PredictorCheckpointError
    from pdscope_jax.phaseper.traces import TraceError
    from pdscope_jax.presets import UnknownModelError
    from pdscope_jax.runtime import RuntimeConfigError
    from pdscope_jax.sched.costs import CostTableError
    from pdscope_jax.weights.checkpoint import CheckpointError

    return (UnknownModelError, ConfigError, CheckpointError, BudgetError, RuntimeConfigError, CostTableError,
            PredictorCheckpointError, TraceError, FileNotFoundError)


if __name__ == "__main__":
    sys.exit(main())
