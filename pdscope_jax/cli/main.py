"""The `pdscope-jax` command line: one module per command in this folder, imported only when it runs.

    pdscope-jax run                                                the main job on the embedded default model
    pdscope-jax generate MODEL [--prompt TEXT | --ids 1,2,3] ...   plain or offloaded generation
    pdscope-jax bench ...                                          policies side by side
    pdscope-jax collect-traces ...                                 routing traces for PhasePer
    pdscope-jax train-predictors ...                               PhasePer predictors from traces
    pdscope-jax profile ...                                        cost table for AdaptSched
    pdscope-jax download NAME                                      fetch a checkpoint from the Hugging Face hub
    pdscope-jax serve MODEL [--port 8000 --api-key KEY] ...        OpenAI-compatible HTTP server
    pdscope-jax chat MODEL                                         terminal chat, answers streamed
    pdscope-jax quality [MODEL] [--dtype float32 --tokens N] ...   held-out perplexity of int8 / int4 experts

Contract: `main(argv) -> int` hands the arguments after the command's name to that module's function and
returns its exit status (0 when it returns something other than an int). A user error (`errors.InputError` and
its subclasses: bad ids or settings, unknown policy, budget too small, ...; also unknown model, corrupt
checkpoint, missing file) is printed as a few lines on stderr, without a traceback, with status 2; any other
exception is an internal error: its traceback is printed, status 1. `pdscope-jax --debug COMMAND ...` prints
the traceback of user errors too. No command or an unknown one prints the usage (status 2; 0 for -h/--help).
Every command but `download` runs with the persistent compilation cache on (`runtime.enable_compile_cache`);
`--no-compile-cache` (before or after the command name) turns it off, by setting PDSCOPE_JAX_COMPILE_CACHE=0
for this process and those it starts. This module imports nothing heavier than argparse, so
`pdscope-jax --help` does not start JAX. Commands that start JAX collect garbage less often (`GC_NEW_OBJECTS`).
`entry()` (the console script, `python -m pdscope_jax`) runs `main` and then `end_process`: where JAX ran, the
process ends at once after flushing its output, leaving the teardown to the operating system.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import os
import sys
import traceback
from typing import NoReturn

from pdscope_jax.errors import InputError

COMMANDS = {  # name: (module, function, help)
    "run": ("pdscope_jax.cli.run", "main", "the whole pipeline on the embedded reference MoE, policies side by side"),
    "generate": ("pdscope_jax.cli.generate", "main", "generate text or token ids with a model"),
    "bench": ("pdscope_jax.cli.bench", "main", "benchmark offloading policies"),
    "collect-traces": ("pdscope_jax.cli.collect_traces", "collect_traces_main", "record routing traces for PhasePer"),
    "train-predictors": ("pdscope_jax.cli.train_predictors", "train_predictors_main",
                         "train PhasePer on collected traces"),
    "profile": ("pdscope_jax.cli.profile", "profile_main", "measure the cost table of a model on this machine"),
    "download": ("pdscope_jax.cli.download", "main", "fetch a model's checkpoint from the Hugging Face hub"),
    "serve": ("pdscope_jax.cli.serve", "main", "an OpenAI-compatible HTTP server (the [serve] extra)"),
    "chat": ("pdscope_jax.cli.chat", "main", "chat with a model in the terminal, answers streamed"),
    "quality": ("pdscope_jax.cli.quality", "main", "perplexity and greedy agreement of int8 / int4 experts vs bf16"),
}
NO_JAX = {"download"}  # commands that compile nothing: they start without the compilation cache (or JAX)
NO_COMPILE_CACHE = "--no-compile-cache"
GC_NEW_OBJECTS = 50_000


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="pdscope-jax", description="Phase-adaptive MoE offloading on JAX.")
    parser.add_argument("--debug", action="store_true", help="print tracebacks for user errors too")
    parser.add_argument(NO_COMPILE_CACHE, action="store_true",
                        help="compile every program afresh, without reading or writing the persistent compilation "
                             "cache (default: on, in $XDG_CACHE_HOME or ~/.cache, under pdscope_jax/xla)")
    parser.add_argument("command", choices=sorted(COMMANDS),
                        help="; ".join(f"{k}: {v[2]}" for k, v in COMMANDS.items()))
    no_cache = NO_COMPILE_CACHE in argv
    argv = [a for a in argv if a != NO_COMPILE_CACHE]
    debug = bool(argv) and argv[0] == "--debug"
    if debug:
        argv = argv[1:]
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        return 0 if argv else 2
    args = parser.parse_args(argv[:1])
    module, function, _ = COMMANDS[args.command]
    if no_cache:
        os.environ["PDSCOPE_JAX_COMPILE_CACHE"] = "0"  # runtime.COMPILE_CACHE_ENV, which load() honours too
    elif args.command not in NO_JAX and "-h" not in argv and "--help" not in argv:
        from pdscope_jax.runtime import enable_compile_cache

        enable_compile_cache()
    if args.command not in NO_JAX:
        # One model a process: tracing makes many short-lived objects and every collection also runs XLA's
        # garbage callback, so collections are made rarer than Python's default (700 new objects).
        gc.set_threshold(GC_NEW_OBJECTS, 20, 20)
    command = getattr(importlib.import_module(module), function)
    try:
        result = command(argv[1:])
    except SystemExit:
        raise  # argparse's own usage errors (status 2) and --help (0)
    except KeyboardInterrupt:
        print(f"pdscope-jax {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as err:  # noqa: BLE001 (sorted into user and internal errors below)
        # InputError first: the other user error types import most of the package (and JAX)
        user = isinstance(err, InputError) or isinstance(err, _user_errors())
        if debug or not user:
            traceback.print_exc()
        if user:
            # Every such error names the problem and the fix, so the message is enough.
            print(f"pdscope-jax {args.command}: error: {err}", file=sys.stderr)
            return 2
        print(f"pdscope-jax {args.command}: internal error (a bug; the traceback above says where): "
              f"{type(err).__name__}: {err}", file=sys.stderr)
        return 1
    return result if isinstance(result, int) else 0


def end_process(status: int) -> NoReturn:
    """End the process with `status`. Where JAX was imported, output is flushed and the process ends without the
    interpreter's teardown: freeing a model's page-locked host memory buffer by buffer, the accelerator's client
    and every object costs a large model's run seconds that the operating system spends faster (nothing this
    package writes is left pending: files are closed and checkpoints waited for before a command returns)."""
    if "jax" not in sys.modules:
        sys.exit(status)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe or stream: nothing left to write
            pass
    os._exit(status)


def entry() -> NoReturn:
    """The `pdscope-jax` console script: `end_process(main())`."""
    end_process(main())


def _user_errors() -> tuple[type[Exception], ...]:
    from pdscope_jax.config import ConfigError
    from pdscope_jax.errors import InputError
    from pdscope_jax.phaseper.checkpoint import PredictorCheckpointError
    from pdscope_jax.phaseper.traces import TraceError
    from pdscope_jax.presets import UnknownModelError
    from pdscope_jax.runtime import RuntimeConfigError
    from pdscope_jax.sched.costs import CostTableError
    from pdscope_jax.sched.hot import HotTableError
    from pdscope_jax.store.budget import BudgetError
    from pdscope_jax.weights.checkpoint import CheckpointError

    return (InputError, UnknownModelError, ConfigError, CheckpointError, BudgetError, RuntimeConfigError,
            CostTableError, PredictorCheckpointError, TraceError, HotTableError, FileNotFoundError)


if __name__ == "__main__":
    entry()
