"""benchmarks/long_run.py: memory reads over decode steps and server requests, and two processes' tokens."""

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "long_run.py"


def test_long_run_reads_memory_and_compares_two_processes(tmp_path):
    out = tmp_path / "long_run.json"
    # four server requests at once, read every two: each larger batch would compile one more decode program
    argv = ["--model", "tiny-deepseek-v2-lite", "--dtype", "float32", "--policies", "pdscope", "--gpu-memory", "1GB",
            "--expert-pool", "40KB", "--steps", "12", "--every", "4", "--settle", "4", "--requests", "4",
            "--every-requests", "2", "--check-tokens", "6", "--cpu-devices", "2", "--out", str(out)]
    # one compilation cache for the run and the two fresh processes it starts: they compile the same programs
    env = {**os.environ, "PDSCOPE_JAX_COMPILE_CACHE": str(tmp_path / "xla")}
    subprocess.run([sys.executable, str(SCRIPT), *argv], check=True, capture_output=True, text=True, timeout=600,
                   env=env)
    report = json.loads(out.read_text())
    assert set(report["runs"]) == {"plain", "pdscope"}
    for run in report["runs"].values():
        assert [r["step"] for r in run["reads"]] == [4, 8, 12]  # from --settle, every --every steps, to --steps
        assert all(r["host_rss"] > 0 for r in run["reads"])
        assert run["host_rss_drift"] == (max(r["host_rss"] for r in run["reads"]) - min(
            r["host_rss"] for r in run["reads"])) / run["reads"][0]["host_rss"]
        assert run["flat"] == (run["host_rss_drift"] <= 0.01)  # the CPU backend reports no allocator bytes
    assert report["runs"]["pdscope"]["budget_bytes"] == 10**9  # --gpu-memory 1GB, as the engine sized itself
    assert report["after_plain_freed"]["host_rss"] > 0
    server = report["server"]
    assert [r["requests"] for r in server["reads"]] == [2, 4] and server["bad_answer_count"] == 0
    # float32 on the CPU backend: two fresh processes sample the same tokens for every policy
    assert report["two_processes"] == {p: {"same_tokens": True, "first_difference": None} for p in ("plain", "pdscope")}
    assert report["all_flat"] == all(r["flat"] for r in [*report["runs"].values(), server])
    assert report["weights"].startswith("random") and report["command"].startswith("python benchmarks/long_run.py")
