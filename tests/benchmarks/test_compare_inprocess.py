"""benchmarks/compare_trees_inprocess.py: two trees in one process (and the old one again, the control) give the
same tokens and a ratio per phase.

The script runs in a child process of its own, as it is used: it imports a second copy of the package (and of
its CPU kernel library) beside the first, which must not share a process with the rest of the test session.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_same_tree_thrice_pinned_gives_identical_tokens_plans_and_every_ratio(tmp_path):
    """One run covers the options together (each run imports and loads the package thrice, which is most of its
    time): --new-tree, --control, --new-first, --settle and --pin-cpu-scale."""
    out = tmp_path / "inprocess.json"
    argv = ["--old-tree", str(REPO), "--old-commit", "self", "--new-tree", str(REPO), "--new-commit", "newc",
            "--model", "tiny-deepseek-v2-lite", "--dtype", "float32", "--policies", "greedy", "--prompt-lens", "12",
            "--new-tokens", "3", "--repeats", "2", "--settle", "1", "--gpu-memory", "1GB", "--expert-pool", "200KB",
            "--new-first", "--control", "--pin-cpu-scale", "2.0", "--out", str(out)]
    # one compilation cache for the three copies of one tree: the copies loaded after the first read its programs
    env = {**os.environ, "PYTHONPATH": str(REPO), "PDSCOPE_JAX_COMPILE_CACHE": str(tmp_path / "xla")}
    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / "compare_trees_inprocess.py"), *argv],
                          env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["commit"] == "newc" and report["script_commit"] and report["pin_cpu_scale"] == 2.0
    assert report["old_commit"] == "self" and "--old-tree" in report["command"]
    assert report["packages"] == {"old": "pdscope_jax_old", "new": "pdscope_jax_new", "control": "pdscope_jax_control"}
    assert report["load_order"] == ["new", "old", "control"]  # --new-first; the control right after the old
    assert set(report["pinned_layout"].values()) == {"engine.calibration.CpuCalibration"}
    [row] = report["rows"]
    assert (row["policy"], row["prompt_len"]) == ("greedy", 12)
    assert row["same_tokens"] is True and row["same_plans"] is True  # one tree thrice, its planners held equal
    for tree in ("old", "new", "control"):
        assert len(row[tree]["prefill_tok_s"]) == len(row[tree]["decode_tok_s"]) == 2
        assert row["cpu_cost_scale"][tree] and set(row["cpu_cost_scale"][tree].values()) == {2.0}
    assert row["prefill_ratio"] == row["new"]["prefill_median"] / row["old"]["prefill_median"]
    assert row["decode_control_ratio"] == row["control"]["decode_median"] / row["old"]["decode_median"]
    ratios = sorted(n / o for n, o in zip(row["new"]["decode_tok_s"], row["old"]["decode_tok_s"]))
    assert row["decode_paired_ratio"] == (ratios[0] + ratios[1]) / 2  # the median of each repeat's ratio
    assert "prefill_control_paired_ratio" in row
    assert f"{row['policy']:9s}" in done.stdout  # a line per row as it is measured
    assert "greedy 12 repeat 2/2 new: prefill" in done.stderr  # a line per timed generation
    assert "repeat 0/2" not in done.stderr  # the settling repeat is not reported as timed


def test_the_whole_model_compares_in_one_process(tmp_path):
    """--policies plain: both trees load the whole model (no policy, no budget) and give a row of ratios; plain
    with another policy, or with --pin-cpu-scale, is refused."""
    out = tmp_path / "plain.json"
    argv = ["--old-tree", str(REPO), "--model", "tiny-deepseek-v2-lite", "--dtype", "float32", "--policies", "plain",
            "--prompt-lens", "12", "--new-tokens", "3", "--repeats", "2", "--out", str(out)]
    env = {**os.environ, "PYTHONPATH": str(REPO), "PDSCOPE_JAX_COMPILE_CACHE": str(tmp_path / "xla")}
    script = [sys.executable, str(REPO / "benchmarks" / "compare_trees_inprocess.py")]
    done = subprocess.run([*script, *argv], env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    [row] = json.loads(out.read_text())["rows"]
    assert (row["policy"], row["prompt_len"], row["same_tokens"]) == ("plain", 12, True)
    assert "plans" not in row and len(row["new"]["decode_tok_s"]) == 2 and row["decode_ratio"] > 0
    for extra in (["--policies", "plain", "greedy"], ["--pin-cpu-scale", "2.0"]):
        refused = subprocess.run([*script, *argv, *extra], env=env, capture_output=True, text=True, timeout=120)
        assert refused.returncode == 2 and "runs alone" in refused.stderr
