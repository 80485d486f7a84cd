"""Two trees of the package in ONE process, their generations interleaved: a throughput comparison free of the
spread between processes.

    PYTHONPATH=. python3 benchmarks/compare_trees_inprocess.py --old-tree OLD --model deepseek-v2-lite \
        --policies pdscope ondemand fate greedy static --prompt-lens 128 4096 --new-tokens 32 --repeats 4 \
        --gpu-memory 24GB --expert-pool 8GB [--cost-table PATH] --out OUT.json

OLD is a folder holding an earlier `pdscope_jax/` package (for example `git worktree add OLD <commit>`). It is
copied under a temporary folder as the package `pdscope_jax_old` (every `pdscope_jax` name in it rewritten), so
both trees import side by side. Each tree loads the model once (`load(..., weights="random", seed=0)`: the same
weights); per policy both switch to it (`set_policy`) and warm up every prompt length, then each repeat runs one
generation per tree on the same random prompt, the tree that goes first alternating between repeats. The tree
loaded second runs JAX's sharding-keyed caches on objects equal to, not identical with, the first tree's, which
costs it a little on every staged array (docs/MEASUREMENTS.md): `--new-first` swaps the load order (run both and
take the geometric mean of the ratios); OLD set to a copy of the new tree gives the noise floor.
Output: JSON with `command`, `commit` (of this tree: `_shared.commit`), `old_commit` (--old-commit), `weights`,
per (policy, prompt, tree) every repeat's prefill / decode tok/s and their medians, new / old of the medians,
and whether both trees generated the same tokens in every repeat (they must: same weights, same prompt).
"""

from __future__ import annotations

import argparse
import importlib
import json
import re
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

import numpy as np

from _shared import commit

OLD_NAME = "pdscope_jax_old"


def import_old(tree: Path, into: Path):
    """Copy `tree/pdscope_jax` to `into/pdscope_jax_old`, rewriting the package name, and import it."""
    target = into / OLD_NAME
    shutil.copytree(tree / "pdscope_jax", target, ignore=shutil.ignore_patterns("__pycache__", "assets"))
    for path in target.rglob("*.py"):
        path.write_text(re.sub(r"\bpdscope_jax\b", OLD_NAME, path.read_text()))
    sys.path.insert(0, str(into))
    return importlib.import_module(OLD_NAME)


def run(args, report: dict) -> dict:
    """Fill `report["rows"]`, writing the report to `args.out` after every row (a run cut short keeps its rows)."""
    import pdscope_jax as new

    with tempfile.TemporaryDirectory() as tmp:
        old = import_old(Path(args.old_tree), Path(tmp))
        runtime = {"gpu_memory": args.gpu_memory, "expert_pool": args.expert_pool,
                   "max_seq_len": max(args.prompt_lens) + args.new_tokens}
        if args.cost_table:
            runtime["cost_table"] = args.cost_table
        order = (("new", new), ("old", old)) if args.new_first else (("old", old), ("new", new))
        trees = {name: module.load(args.model, weights="random", seed=0, dtype=args.dtype, policy=args.policies[0],
                                   **runtime) for name, module in order}  # loaded, and warmed up, in this order
        report["load_order"] = list(trees)
        rng = np.random.default_rng(0)
        vocab = trees["new"].config.vocab_size
        rows = report.setdefault("rows", [])
        for policy in args.policies:
            for runner in trees.values():
                runner.engine.set_policy(policy)
                for t in args.prompt_lens:
                    runner.engine.warmup(1, t, args.new_tokens)
            for t in args.prompt_lens:
                times = {"old": [], "new": []}
                same_tokens = True
                for rep in range(args.repeats):
                    ids = rng.integers(0, vocab, size=(1, t)).astype(np.int32)
                    order = ("old", "new") if rep % 2 == 0 else ("new", "old")
                    tokens = {}
                    for name in order:
                        out = trees[name].generate(ids, max_new_tokens=args.new_tokens)
                        tokens[name] = np.asarray(out.tokens)
                        times[name].append((out.prefill_tokens_per_s, out.decode_tokens_per_s))
                    same_tokens &= bool(np.array_equal(tokens["old"], tokens["new"]))
                row = {"policy": policy, "prompt_len": t, "same_tokens": same_tokens}
                for name, reps in times.items():
                    row[name] = {"prefill_tok_s": [p for p, _ in reps], "decode_tok_s": [d for _, d in reps],
                                 "prefill_median": statistics.median(p for p, _ in reps),
                                 "decode_median": statistics.median(d for _, d in reps)}
                for phase in ("prefill", "decode"):
                    row[f"{phase}_ratio"] = row["new"][f"{phase}_median"] / row["old"][f"{phase}_median"]
                rows.append(row)
                if args.out:
                    args.out.write_text(json.dumps(report, indent=1) + "\n")
                print(f"{policy:9s} {t:6d} prefill new/old {row['prefill_ratio']:.3f}  decode new/old "
                      f"{row['decode_ratio']:.3f}  same tokens: {same_tokens}", flush=True)
    return report


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old-tree", required=True, help="folder holding the earlier pdscope_jax/ package")
    ap.add_argument("--old-commit", default="?")
    ap.add_argument("--model", default="deepseek-v2-lite")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--policies", nargs="+", default=["pdscope", "ondemand"])
    ap.add_argument("--prompt-lens", type=int, nargs="+", default=[128, 4096])
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--gpu-memory", default="24GB")
    ap.add_argument("--expert-pool", default="8GB")
    ap.add_argument("--cost-table", default=None)
    ap.add_argument("--new-first", action="store_true",
                    help="load and warm up the new tree first (the tree loaded second pays for JAX's caches keyed "
                         "by the first tree's sharding objects: run both orders)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    report = {"what": "old and new tree in one process, generations interleaved",
              "command": " ".join(["python3", "benchmarks/compare_trees_inprocess.py",
                                   *(sys.argv[1:] if argv is None else argv)]),
              "commit": commit(), "old_commit": args.old_commit, "model": args.model,
              "weights": "random (seeded; both trees the same)", "rows": []}
    return run(args, report)


if __name__ == "__main__":
    main()
