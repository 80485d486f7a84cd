"""Where a whole `pdscope-jax` command's start goes (import, load, warm-up, run), by sampled main-thread stacks.

Run from the repository root (on the GPU node for real sizes):
    PYTHONPATH=. python benchmarks/probes/probe_start_stages.py --compile-cache DIR --kernel-cache DIR \
        [--out F.json] -- generate deepseek-v2-lite --weights random --policy pdscope ...
The command runs in this process (`pdscope_jax.cli.main.main`) with the given compilation and C++ kernel caches
(`PDSCOPE_JAX_COMPILE_CACHE`, `PDSCOPE_KERNEL_CACHE`): run it once to fill them, then again to see a warm start.
The sampler (`probe_load_stages.StackSampler`) starts before `import pdscope_jax`; every frame of the package
and of jax is kept by inclusive seconds, and the innermost frames by seconds.
Writes: {what, command, commit, wall_s, import_s, run_s, exit_code, inclusive_s, leaf_s}; prints the top frames.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import threading
import time
from pathlib import Path

from probe_load_stages import StackSampler, report, sampled_frames


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--compile-cache", type=Path, required=True)
    ap.add_argument("--kernel-cache", type=Path, required=True)
    ap.add_argument("--interval", type=float, default=0.005, help="seconds between samples")
    ap.add_argument("--top", type=int, default=80, help="frames kept per list")
    ap.add_argument("--out", type=Path)
    ap.add_argument("command", nargs=argparse.REMAINDER, help="-- then the pdscope-jax arguments")
    args = ap.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    os.environ["PDSCOPE_JAX_COMPILE_CACHE"] = str(args.compile_cache)
    os.environ["PDSCOPE_KERNEL_CACHE"] = str(args.kernel_cache)
    os.environ.pop("JAX_COMPILATION_CACHE_DIR", None)
    sys.setswitchinterval(args.interval / 10)
    sampler = StackSampler(threading.get_ident(), args.interval, keep="/")
    t0 = time.perf_counter()
    from pdscope_jax.cli.main import main as cli

    t1 = time.perf_counter()
    code = cli(command)
    t2 = time.perf_counter()
    sampler.stop()
    from pdscope_jax.artifacts.provenance import source_commit

    result = {"what": "where a pdscope-jax command's start goes (sampled main-thread stacks)",
              "command": "python3 " + shlex.join(sys.argv), "commit": source_commit(),
              "wall_s": round(t2 - t0, 2), "import_s": round(t1 - t0, 2), "run_s": round(t2 - t1, 2),
              "exit_code": code, **sampled_frames(sampler, args.top, ("pdscope_jax/", "jax/", "jaxlib/"))}
    return report(result, ("wall_s", "import_s", "run_s", "exit_code"), 40, args.out)


if __name__ == "__main__":
    main()
