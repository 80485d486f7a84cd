"""benchmarks/compare_trees_inprocess.py: two trees in one process give the same tokens and a ratio per phase."""

import json
import runpy
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_same_tree_twice_gives_identical_tokens_and_both_ratios(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "path", list(sys.path))  # the script puts the renamed copy first on sys.path
    main = runpy.run_path(str(REPO / "benchmarks" / "compare_trees_inprocess.py"))["main"]
    out = tmp_path / "inprocess.json"
    report = main(["--old-tree", str(REPO), "--old-commit", "self", "--model", "tiny-deepseek-v2-lite",
                   "--dtype", "float32", "--policies", "ondemand", "static", "--prompt-lens", "12",
                   "--new-tokens", "3", "--repeats", "2", "--gpu-memory", "1GB", "--expert-pool", "200KB",
                   "--out", str(out)])
    assert [(r["policy"], r["prompt_len"]) for r in report["rows"]] == [("ondemand", 12), ("static", 12)]
    for row in report["rows"]:
        assert row["same_tokens"] is True  # same code, same seeded weights, same prompts
        for tree in ("old", "new"):
            assert len(row[tree]["prefill_tok_s"]) == len(row[tree]["decode_tok_s"]) == 2
        assert row["prefill_ratio"] == row["new"]["prefill_median"] / row["old"]["prefill_median"]
    saved = json.loads(out.read_text())
    assert saved["old_commit"] == "self" and "--old-tree" in saved["command"] and saved["rows"] == report["rows"]
    assert "pdscope_jax_old" in sys.modules  # the earlier tree was imported under its own name
