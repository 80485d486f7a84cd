"""Where one `pdscope_jax.load` of an offloaded model spends its wall time, by sampled stacks of the main thread.

Run from the repository root (on the GPU node for real sizes; random weights, no persistent compilation cache):
    PYTHONPATH=. python benchmarks/probes/probe_load_stages.py [--model deepseek-v2-lite] [--policy pdscope]
        [--gpu-memory 24GB] [--expert-pool 8GB] [--host-alloc auto|jax|torch] [--out load_stages.json]
A sampler thread reads the main thread's stack every --interval seconds (the interpreter's switch interval is
cut so it gets the GIL) and weights each sample by the wall time since the previous one. A frame holding the
GIL through a long C call is seen late: read the figures as where the time goes, to a second or so.
`--host-alloc` forces the expert store's allocation (`pdscope_jax.store.expert_store`); "auto" leaves it.
Writes: {what, command, commit, weights, host_alloc, import_s, load_s, stages_s (OffloadRunner.startup_seconds),
inclusive_s: [[frame, seconds]] for this package's frames (file:line function), leaf_s: the innermost frames};
prints the stages and the top frames.
"""

from __future__ import annotations

import argparse
import collections
import json
import shlex
import sys
import threading
import time
from pathlib import Path


class StackSampler:
    """Wall seconds per frame of one thread's stack, sampled by a daemon thread until `stop()`."""

    def __init__(self, thread_id: int, interval: float, keep: str):
        self.inclusive, self.leaf = collections.Counter(), collections.Counter()
        self._id, self._interval, self._keep, self._stop = thread_id, interval, keep, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        last = time.perf_counter()
        while not self._stop.wait(self._interval):
            now = time.perf_counter()
            dt, last = now - last, now
            frame, seen, innermost = sys._current_frames().get(self._id), set(), True
            while frame is not None:
                where = f"{_short(frame.f_code.co_filename)}:{frame.f_lineno} {frame.f_code.co_name}"
                if innermost:
                    self.leaf[where] += dt
                    innermost = False
                if self._keep in frame.f_code.co_filename and where not in seen:
                    self.inclusive[where] += dt
                    seen.add(where)
                frame = frame.f_back

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def _short(filename: str) -> str:
    for marker in ("/site-packages/", "/pdscope_jax/"):
        if marker in filename:
            head = "pdscope_jax/" if marker == "/pdscope_jax/" else ""
            return head + filename.split(marker, 1)[1]
    return filename


def sampled_frames(sampler: StackSampler, top: int, keep: tuple[str, ...] = ("",)) -> dict:
    """{inclusive_s, leaf_s}: the `top` frames by seconds ([[frame, seconds]]), inclusive ones starting with `keep`."""
    inclusive = [(w, s) for w, s in sampler.inclusive.most_common() if w.startswith(keep)][:top]
    return {"inclusive_s": [[w, round(s, 2)] for w, s in inclusive],
            "leaf_s": [[w, round(s, 2)] for w, s in sampler.leaf.most_common(top)]}


def report(result: dict, headline: tuple[str, ...], shown: int, out: Path | None) -> dict:
    """Print the `headline` fields as JSON and the `shown` top inclusive frames; write the result to `out`."""
    print(json.dumps({k: result[k] for k in headline}))
    for where, seconds in result["inclusive_s"][:shown]:
        print(f"{seconds:8.2f} s  {where}")
    if out:
        out.write_text(json.dumps(result, indent=1) + "\n")
    return result


def force_host_alloc(alloc: str) -> None:
    """Make every ExpertStore built from now on allocate with `alloc` (a later call replaces an earlier one)."""
    from pdscope_jax.store import expert_store

    init = getattr(expert_store.ExpertStore.__init__, "unforced", expert_store.ExpertStore.__init__)

    def forced(self, *args, **kwargs):
        init(self, *args, **{**kwargs, "host_alloc": alloc})
    forced.unforced = init
    expert_store.ExpertStore.__init__ = forced


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="deepseek-v2-lite")
    ap.add_argument("--policy", default="pdscope")
    ap.add_argument("--gpu-memory", default="24GB")
    ap.add_argument("--expert-pool", default="8GB")
    ap.add_argument("--host-alloc", choices=("auto", "jax", "driver"), default="auto")
    ap.add_argument("--interval", type=float, default=0.005, help="seconds between samples")
    ap.add_argument("--top", type=int, default=60, help="frames kept per list")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    sys.setswitchinterval(args.interval / 10)
    t0 = time.perf_counter()
    import pdscope_jax
    from pdscope_jax.artifacts.provenance import source_commit

    if args.host_alloc != "auto":
        force_host_alloc(args.host_alloc)
    sampler = StackSampler(threading.get_ident(), args.interval, keep="pdscope_jax")
    t1 = time.perf_counter()
    runner = pdscope_jax.load(args.model, weights="random", policy=args.policy, gpu_memory=args.gpu_memory,
                              expert_pool=args.expert_pool, max_seq_len=512, compile_cache=False)
    t2 = time.perf_counter()
    sampler.stop()
    store = getattr(runner.engine, "store", None)
    result = {"what": f"where a load of offloaded {args.model} spends its wall time (sampled main-thread stacks)",
              "command": "python3 " + shlex.join(sys.argv), "commit": source_commit(), "weights": "random (seeded)",
              "host_alloc": store.host_alloc if store else None, "import_s": round(t1 - t0, 1),
              "load_s": round(t2 - t1, 1), "stages_s": {k: round(v, 1) for k, v in runner.startup_seconds.items()},
              **sampled_frames(sampler, args.top)}
    return report(result, ("host_alloc", "import_s", "load_s", "stages_s"), 25, args.out)


if __name__ == "__main__":
    main()
