"""Two trees' bench results side by side: what `scripts/compare_trees.sh` measured, as one JSON and a table.

    python3 benchmarks/compare_trees_report.py OLD.json NEW.json --call N --order "old new" \
        --old-commit C1 --new-commit C2 --command "..." --out benchmarks/results/NAME.json

Input: two JSON files written by `pdscope-jax bench` with the same arguments (one per tree, one device call).
Output: a JSON with the provenance fields the results index reads (`what`, `command`, `commit`, `call`, `weights`),
`old_commit`, `order` (which tree ran first), `comparison` (per policy, prompt length and phase: old, new, new /
old, and the cold and warm prefill repeats) and both bench files whole under `trees`; a PNG of the ratios beside it;
and the same table printed. Only reads and writes files; the figures are the bench files' own medians.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def comparison(old: dict, new: dict) -> list[dict]:
    """Rows for every (policy, prompt) both files hold: prefill and decode tok/s, old, new and new / old."""
    rows = []
    for o in old["results"]:
        n = next((r for r in new["results"] if r["policy"] == o["policy"] and r["prompt_len"] == o["prompt_len"]
                  and r.get("batch") == o.get("batch")), None)
        if n is None:
            continue
        for phase in ("prefill", "decode"):
            key = f"{phase}_tok_s"
            row = {"policy": o["policy"], "prompt_len": o["prompt_len"], "phase": phase, "old": o[key],
                   "new": n[key], "ratio": n[key] / o[key] if o[key] else None}
            if phase == "prefill":
                for pool in ("cold", "warm"):
                    row[f"old_{pool}"], row[f"new_{pool}"] = o.get(f"{key}_{pool}"), n.get(f"{key}_{pool}")
            rows.append(row)
    return rows


def table(rows: list[dict]) -> str:
    lines = [f"{'policy':9s} {'prompt':>6s} {'phase':7s} {'old':>9s} {'new':>9s} {'new/old':>8s}"]
    for r in rows:
        lines.append(f"{r['policy']:9s} {r['prompt_len']:6d} {r['phase']:7s} {r['old']:9.2f} {r['new']:9.2f} "
                     f"{r['ratio']:8.3f}")
    return "\n".join(lines)


def plot(rows: list[dict], title: str, path: Path) -> None:
    """Bars of new / old per (policy, prompt, phase), with the +-3 % band."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['policy']}\n{r['prompt_len']} {r['phase'][:3]}" for r in rows]
    fig, ax = plt.subplots(figsize=(max(8, 0.75 * len(rows)), 4))
    ax.bar(range(len(rows)), [r["ratio"] for r in rows], color=["C0" if r["phase"] == "prefill" else "C1"
                                                                 for r in rows])
    ax.axhspan(0.97, 1.03, color="0.85", zorder=0)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(range(len(rows)), labels, fontsize=7)
    ax.set_ylim(0.6, 1.25)
    ax.set_ylabel("new / old tok/s")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("old", type=Path)
    ap.add_argument("new", type=Path)
    ap.add_argument("--call", type=int, required=True, help="the device call that measured both")
    ap.add_argument("--order", required=True, help='which tree ran first, e.g. "old new"')
    ap.add_argument("--old-commit", required=True)
    ap.add_argument("--new-commit", required=True)
    ap.add_argument("--command", required=True, help="the command of the device call")
    ap.add_argument("--what", default="the same bench for an earlier tree and this one in one device call")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    old, new = json.loads(args.old.read_text()), json.loads(args.new.read_text())
    rows = comparison(old, new)
    report = {"what": args.what, "command": args.command, "commit": args.new_commit, "old_commit": args.old_commit,
              "call": args.call, "weights": new.get("weights", "?"), "model": new.get("model"),
              "workload": new.get("workload"), "order": args.order.split(), "comparison": rows,
              "trees": {"old": old, "new": new}}
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    plot(rows, f"{args.what} (call {args.call}; weights: {report['weights']})", args.out.with_suffix(".png"))
    print(table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
