"""Two trees of the package in ONE process, their generations interleaved: a throughput comparison free of the
spread between processes.

    PYTHONPATH=. python3 benchmarks/compare_trees_inprocess.py --old-tree OLD [--new-tree NEW] --model \
        deepseek-v2-lite --policies pdscope ondemand fate greedy static --prompt-lens 128 4096 --new-tokens 32 \
        --repeats 4 --gpu-memory 24GB --expert-pool 8GB [--cost-table PATH] [--pin-cpu-scale S] [--control] \
        --out OUT.json

OLD (and NEW; default: this checkout's `pdscope_jax`) is a folder holding a `pdscope_jax/` package, copied under a
temporary folder as `pdscope_jax_old` (`pdscope_jax_new`), every `pdscope_jax` name in it rewritten, so both trees
import side by side. Each tree loads the model once (`load(..., weights="random", seed=0)`: the same weights); per
policy both switch to it (`set_policy`) and warm up every prompt length, then each repeat runs one generation per
tree on the same random prompt, the tree going first alternating. The tree loaded second pays a little on every
staged array (JAX's sharding-keyed caches; docs/MEASUREMENTS.md): `--new-first` swaps the load order.
`--pin-cpu-scale S` holds the in-situ CPU calibration of both trees at S (a multiple of 0.1, >= 1) for every
(phase, step rows): the planners see the cost table's CPU times times S (a calibration learned live would make two
copies of one tree plan differently from timing noise). Either layout (`offload.engine.OffloadRunner._cpu_scale`
or `engine.calibration.CpuCalibration`) is patched after `load`; a tree with neither stops the run; each row
records the scales each runner reports. `--policies plain` alone compares the whole model (no policy, no budget;
a generation of each prompt length warms it up). `--control` loads the old tree again (`pdscope_jax_control`,
after the old one) and runs it in every repeat: control / old, the same code against itself, is the noise floor
new / old is read against. Each tree holds its own weights in host memory: the script stops before a load when
less is available than the first tree took.
Output: JSON with `command`, `commit` (the new tree's: --new-commit, else this checkout's), `script_commit`,
`old_commit`, `pin_cpu_scale`, `xla_flags`, per (policy, prompt, tree) every timed repeat's prefill / decode tok/s
(after `--settle` untimed ones) and their medians, new / old (and control / old) of the medians and the median of
each repeat's ratio (`*_paired_ratio`), `cpu_cost_scale` and `plans` (loads, prefetches, GPU / CPU experts, bytes)
per tree, `same_plans`, and whether every tree generated the same tokens. A line per generation goes to stderr.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import psutil

from _shared import commit

OLD_NAME, NEW_NAME, CONTROL_NAME = "pdscope_jax_old", "pdscope_jax_new", "pdscope_jax_control"
PLAIN = "plain"


def import_tree(tree: Path, into: Path, name: str):
    """Copy `tree/pdscope_jax` to `into/name`, rewriting the package name, and import it as `name`."""
    target = into / name
    shutil.copytree(tree / "pdscope_jax", target, ignore=shutil.ignore_patterns("__pycache__", "assets"))
    for path in target.rglob("*.py"):
        path.write_text(re.sub(r"\bpdscope_jax\b", name, path.read_text()))
    if str(into) not in sys.path:
        sys.path.insert(0, str(into))
    return importlib.import_module(name)


class PinnedScale(dict):
    """A calibration's scale table held at `value`: every key looked up reads `value` (and is recorded, so the
    runner's report names each (phase, rows) its planners used); whatever is stored becomes `value`."""

    def __init__(self, value: float):
        super().__init__()
        self.value = value

    def get(self, key, default=None):
        dict.__setitem__(self, key, self.value)
        return self.value

    def __setitem__(self, key, value):
        dict.__setitem__(self, key, self.value)


def _calibration(engine):
    """-> (layout, owner, scale attribute, learning method, costs lookup, base table, reported scales) of
    `engine`'s in-situ CPU calibration; SystemExit where it has neither known layout."""
    cal = getattr(engine, "_calibration", None)
    if cal is not None and all(hasattr(cal, a) for a in ("scale", "observe", "costs_for", "as_stats")):
        return "engine.calibration.CpuCalibration", cal, "scale", "observe", cal.costs_for, cal.costs, cal.as_stats
    if all(hasattr(engine, a) for a in ("_cpu_scale", "_calibrate_cpu", "_planner_costs")):
        return ("offload.engine.OffloadRunner._cpu_scale", engine, "_cpu_scale", "_calibrate_cpu",
                engine._planner_costs, engine.costs, lambda: engine.stats["cpu_cost_scale"])
    raise SystemExit(f"--pin-cpu-scale: {type(engine).__module__}.{type(engine).__name__} has neither "
                     "`_calibration` (CpuCalibration: scale, observe, costs_for, as_stats) nor `_cpu_scale`, "
                     "`_calibrate_cpu`, `_planner_costs`: this tree's CPU calibration cannot be pinned")


def pin_cpu_scale(engine, scale: float) -> str:
    """Hold `engine`'s CPU calibration at `scale`, check that its planners now see the CPU times times `scale`;
    -> the layout patched."""
    layout, owner, attr, learn, lookup, base, _ = _calibration(engine)
    pinned = PinnedScale(scale)
    setattr(owner, attr, pinned)
    setattr(owner, learn, lambda *args, **kwargs: None)  # nothing measured reaches the scale
    seen = tuple(lookup("prefill", -1).cpu_expert_seconds)
    if seen != tuple(v * scale for v in base.cpu_expert_seconds):
        raise SystemExit(f"--pin-cpu-scale {scale}: the planners of {layout} see CPU times {seen[:3]}..., not "
                         f"the table's times {scale}")
    pinned.clear()  # forget the check's key
    return layout


def reported_scales(engine) -> dict[str, float]:
    return dict(_calibration(engine)[-1]())


PLAN_COUNTS = ("experts_loaded_now", "experts_prefetched", "gpu_experts", "cpu_experts", "bytes_moved")


def plan_counts(engine) -> dict[str, dict[str, int]]:
    """What the planners decided since the policy was set, per phase (both layouts' `stats`)."""
    stats = engine.stats
    return {phase: {k: stats[phase][k] for k in PLAN_COUNTS} for phase in ("prefill", "decode")}


def check_host_memory(name: str, per_tree: int | None) -> None:
    """Stop before loading tree `name` when the host's available memory is below what the first tree took (its
    RSS growth, pinned copies included): a pinned allocation that does not fit stalls instead of failing."""
    available = psutil.virtual_memory().available
    if per_tree is not None and available < 1.05 * per_tree:
        raise SystemExit(f"loading the {name} tree needs about {per_tree / 1e9:.1f} GB of host memory (what the first "
                         f"tree took) and {available / 1e9:.1f} GB is available: drop --control, or compare fewer "
                         "trees per process")


def run(args, report: dict) -> dict:
    """Fill `report["rows"]`, writing the report to `args.out` after every row (a run cut short keeps its rows)."""
    with tempfile.TemporaryDirectory() as tmp:
        old = import_tree(Path(args.old_tree), Path(tmp), OLD_NAME)
        new = importlib.import_module("pdscope_jax") if args.new_tree is None else \
            import_tree(Path(args.new_tree), Path(tmp), NEW_NAME)
        control = import_tree(Path(args.old_tree), Path(tmp), CONTROL_NAME) if args.control else None
        report["packages"] = {"old": old.__name__, "new": new.__name__}
        if control is not None:
            report["packages"]["control"] = control.__name__
        report["xla_flags"] = os.environ.get("XLA_FLAGS", "")
        pool = None if args.expert_pool == "none" else args.expert_pool
        runtime = {"gpu_memory": args.gpu_memory, "expert_pool": pool,
                   "max_seq_len": max(args.prompt_lens) + args.new_tokens}
        if args.cost_table:
            runtime["cost_table"] = args.cost_table
        order = [("new", new), ("old", old)] if args.new_first else [("old", old), ("new", new)]
        if control is not None:  # right after the old tree: the place in the load order matters (see above)
            order.insert([name for name, _ in order].index("old") + 1, ("control", control))
        trees, report["load_seconds"] = {}, {}
        quantized = {} if args.quantize is None else {"quantize": args.quantize}  # old trees may lack the argument
        plain = args.policies == [PLAIN]  # the whole model on the accelerator: no policy, no budget
        if plain:
            runtime = {}  # the whole model takes no runtime settings
        rss_start, per_tree = psutil.Process().memory_info().rss, None
        for name, module in order:  # loaded, and warmed up, in this order
            check_host_memory(name, per_tree)
            start = time.perf_counter()
            trees[name] = module.load(args.model, weights="random", seed=0, dtype=args.dtype,
                                      policy=None if plain else args.policies[0], **quantized, **runtime)
            report["load_seconds"][name] = round(time.perf_counter() - start, 1)
            per_tree = per_tree or psutil.Process().memory_info().rss - rss_start
            print(f"loaded {name} ({module.__name__}) in {report['load_seconds'][name]} s", file=sys.stderr,
                  flush=True)
        report["load_order"] = list(trees)
        if args.pin_cpu_scale is not None:
            report["pinned_layout"] = {name: pin_cpu_scale(r.engine, args.pin_cpu_scale) for name, r in trees.items()}
        rng = np.random.default_rng(0)
        vocab = trees["new"].config.vocab_size
        rows = report.setdefault("rows", [])
        for policy in args.policies:
            for name, runner in trees.items():
                start = time.perf_counter()
                if not plain:
                    runner.engine.set_policy(policy)
                for t in args.prompt_lens:
                    if plain:  # a generation of each shape compiles its programs
                        runner.generate(np.zeros((1, t), np.int32), max_new_tokens=args.new_tokens)
                    else:
                        runner.engine.warmup(1, t, args.new_tokens)
                print(f"{policy} {name}: set and warmed up in {time.perf_counter() - start:.1f} s", file=sys.stderr,
                      flush=True)
            names = list(trees)
            for t in args.prompt_lens:
                times = {name: [] for name in names}
                same_tokens = True
                for rep in range(-args.settle, args.repeats):  # negative: settling, not timed
                    ids = rng.integers(0, vocab, size=(1, t)).astype(np.int32)
                    order = names[rep % len(names):] + names[:rep % len(names)]  # each tree first in turn
                    outs = {name: trees[name].generate(ids, max_new_tokens=args.new_tokens) for name in order}
                    if rep < 0:
                        continue
                    for name, out in outs.items():
                        times[name].append((out.prefill_tokens_per_s, out.decode_tokens_per_s))
                        print(f"{policy} {t} repeat {rep + 1}/{args.repeats} {name}: prefill "
                              f"{out.prefill_tokens_per_s:.1f} decode {out.decode_tokens_per_s:.2f} tok/s",
                              file=sys.stderr, flush=True)
                    same_tokens &= all(np.array_equal(outs["old"].tokens, out.tokens) for out in outs.values())
                row = {"policy": policy, "prompt_len": t, "same_tokens": same_tokens}
                for name, reps in times.items():
                    row[name] = {"prefill_tok_s": [p for p, _ in reps], "decode_tok_s": [d for _, d in reps],
                                 "prefill_median": statistics.median(p for p, _ in reps),
                                 "decode_median": statistics.median(d for _, d in reps)}
                for phase in ("prefill", "decode"):
                    row[f"{phase}_ratio"] = row["new"][f"{phase}_median"] / row["old"][f"{phase}_median"]
                    row[f"{phase}_paired_ratio"] = paired_ratio(row["new"][f"{phase}_tok_s"],
                                                                row["old"][f"{phase}_tok_s"])
                    if control is not None:
                        row[f"{phase}_control_ratio"] = (row["control"][f"{phase}_median"]
                                                         / row["old"][f"{phase}_median"])
                        row[f"{phase}_control_paired_ratio"] = paired_ratio(row["control"][f"{phase}_tok_s"],
                                                                            row["old"][f"{phase}_tok_s"])
                # the calibration each runner reports after the row (learned, or pinned), and its decisions
                if not plain:
                    row["cpu_cost_scale"] = {name: reported_scales(r.engine) for name, r in trees.items()}
                    row["plans"] = {name: plan_counts(r.engine) for name, r in trees.items()}
                row["same_plans"] = plain or all(row["plans"]["old"] == plans for plans in row["plans"].values())
                rows.append(row)
                if args.out:
                    args.out.write_text(json.dumps(report, indent=1) + "\n")
                control_note = "" if control is None else (f"  control/old {row['prefill_control_ratio']:.3f} / "
                                                           f"{row['decode_control_ratio']:.3f}")
                print(f"{policy:9s} {t:6d} prefill new/old {row['prefill_ratio']:.3f} (paired "
                      f"{row['prefill_paired_ratio']:.3f})  decode new/old {row['decode_ratio']:.3f} (paired "
                      f"{row['decode_paired_ratio']:.3f}){control_note}  same tokens: {same_tokens}  same plans: "
                      f"{row['same_plans']}", flush=True)
                if args.pin_cpu_scale is not None:
                    check_pinned(row["cpu_cost_scale"], args.pin_cpu_scale)
    return report


def paired_ratio(new: list[float], old: list[float]) -> float:
    """The median of each repeat's new / old: the two generations of a repeat ran back to back, so a drift over
    the repeats (both trees slowing or speeding together) cancels in it, where a ratio of medians keeps it."""
    return statistics.median(n / o for n, o in zip(new, old))


def check_pinned(scales: dict[str, dict[str, float]], pin: float) -> None:
    """Every tree reports at least one scale, and every scale is `pin`; else SystemExit."""
    for name, tree in scales.items():
        if not tree or any(s != pin for s in tree.values()):
            raise SystemExit(f"--pin-cpu-scale {pin}: the {name} tree reports {tree or 'no scale'}")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old-tree", required=True, help="folder holding the earlier pdscope_jax/ package")
    ap.add_argument("--old-commit", default="?")
    ap.add_argument("--new-tree", default=None,
                    help="folder holding the later pdscope_jax/ package (default: this checkout's)")
    ap.add_argument("--new-commit", default=None, help="the --new-tree's commit, recorded as `commit`")
    ap.add_argument("--model", default="deepseek-v2-lite")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--quantize", default=None, choices=["int8", "int4"], help="routed experts quantized (both trees)")
    ap.add_argument("--policies", nargs="+", default=["pdscope", "ondemand"])
    ap.add_argument("--prompt-lens", type=int, nargs="+", default=[128, 4096])
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--settle", type=int, default=0, metavar="N",
                    help="N untimed repeats per prompt length before the timed ones (the planners' and caches' "
                         "first generations drift)")
    ap.add_argument("--gpu-memory", default="24GB")
    ap.add_argument("--expert-pool", default="8GB", help="the expert pool's cap, or none (the budget decides)")
    ap.add_argument("--cost-table", default=None)
    ap.add_argument("--pin-cpu-scale", type=float, default=None, metavar="S",
                    help="hold both trees' in-situ CPU calibration at S (>= 1, a multiple of 0.1) for every "
                         "phase and step size")
    ap.add_argument("--new-first", action="store_true",
                    help="load and warm up the new tree first (the tree loaded second pays for JAX's caches keyed "
                         "by the first tree's sharding objects: run both orders)")
    ap.add_argument("--control", action="store_true",
                    help="load the old tree twice and run both: control / old, the same code against itself, is "
                         "the noise floor for new / old")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    pin = args.pin_cpu_scale
    if pin is not None and not (pin >= 1 and round(pin, 1) == pin):
        ap.error(f"--pin-cpu-scale {pin}: must be >= 1 and a multiple of 0.1 (the trees round their scale to a "
                 "tenth before scaling the table)")
    if PLAIN in args.policies and (len(args.policies) > 1 or pin is not None):
        ap.error(f"--policies {PLAIN} (the whole model, no offloading) runs alone and without --pin-cpu-scale: "
                 "it loads the trees without a policy, and has no planner to pin")
    if args.new_commit is not None and args.new_tree is None:
        ap.error("--new-commit names the --new-tree's commit; without --new-tree the new tree is this checkout")
    script_commit = commit()
    report = {"what": "old and new tree in one process, generations interleaved",
              "command": " ".join(["python3", "benchmarks/compare_trees_inprocess.py",
                                   *(sys.argv[1:] if argv is None else argv)]),
              "commit": script_commit if args.new_tree is None else (args.new_commit or "?"),
              "script_commit": script_commit, "old_commit": args.old_commit,
              "old_tree": args.old_tree, "new_tree": args.new_tree or "(this checkout)", "model": args.model,
              "pin_cpu_scale": pin, "weights": "random (seeded; both trees the same)", "rows": []}
    return run(args, report)


if __name__ == "__main__":
    main()
