"""benchmarks/serve_load.py: the real server under 1 and 2 concurrent streams, then the same requests through
`generate`, on the tiny DeepSeek-V2-Lite offloaded (pdscope)."""

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "serve_load.py"
NEW = 4


def test_serve_load_measures_the_server_and_generate(tmp_path):
    out = tmp_path / "serve_load.json"
    argv = ["--model", "tiny-deepseek-v2-lite", "--policy", "pdscope", "--gpu-memory", "1GB", "--expert-pool", "40KB",
            "--concurrency", "1", "2", "--prompt-tokens", "8", "--max-tokens", str(NEW), "--startup-timeout", "300",
            "--out", str(out)]
    env = {**os.environ, "PDSCOPE_JAX_COMPILE_CACHE": str(tmp_path / "xla")}  # the generate phase reads the server's
    done = subprocess.run([sys.executable, str(SCRIPT), *argv], capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["weights"].startswith("random") and report["command"].startswith("python benchmarks/serve_load.py")
    assert report["machine"]["devices"] and report["settings"]["policy"] == "pdscope"
    server, generate = report["server"], report["generate"]
    assert server["stopped_cleanly"] and server["exit_code"] == 143  # SIGTERM, after uvicorn's and the service's stop
    assert server["startup_s"] > 0 and len(server["warmup_s"]) == 2
    assert set(server["by_c"]) == set(generate["sequential"]) == {"1", "2"} and generate["batch"] == {}
    for c, res in server["by_c"].items():
        assert len(res["streams"]) == int(c) and res["errors"] == [] and res["lost_tokens"] == 0
        for s in res["streams"]:
            assert 0 < s["ttft_s"] < s["total_s"] and s["tok_s"] > 0
            # every token the server generated arrived (an EOS is counted in usage but never sent)
            assert s["tokens"] == s["usage_completion_tokens"] - (s["finish_reason"] == "stop")
            assert s["finish_reason"] == "stop" or s["tokens"] == NEW
        assert 0 < res["ttft_s_median"] <= res["ttft_s_p90"] and res["aggregate_tok_s"] > 0 and res["wall_s"] > 0
    for c, res in generate["sequential"].items():
        (run,) = res["requests"]
        assert len(run) == int(c) and all(r["tokens"] == NEW and r["prefill_s"] > 0 and r["decode_s"] > 0
                                          for r in run)
        # one after another: the second request's first token comes after the whole first request
        assert [r["ttft_s"] for r in run] == [sum(q["total_s"] for q in run[:i]) + r["prefill_s"]
                                              for i, r in enumerate(run)]
        assert res["aggregate_tok_s"] == sum(r["tokens"] for r in run) / sum(r["total_s"] for r in run)
    table = done.stdout.splitlines()
    assert sum("server" in line for line in table) == 2 and sum("generate 1-by-1" in line for line in table) == 2
