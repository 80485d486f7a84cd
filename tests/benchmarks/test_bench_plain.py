"""benchmarks/bench_plain.py (the whole-model upper bound) runs end to end and writes what it reports."""

import importlib.util
import json
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_plain.py"


def test_bench_plain_writes_json_and_png(tmp_path):
    spec = importlib.util.spec_from_file_location("bench_plain", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    result = bench.main(["--model", "tiny-mixtral-8x7b", "--lengths", "8", "16", "--new-tokens", "3",
                         "--repeats", "1", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "plain_tiny-mixtral-8x7b.json").read_text())
    assert saved["rows"] == result["rows"] and [r["prompt_tokens"] for r in saved["rows"]] == [8, 16]
    assert all(r["prefill_tok_s"] > 0 and r["decode_tok_s"] > 0 for r in saved["rows"])
    assert saved["weights"].startswith("random") and "bench_plain.py" in saved["command"]
    assert (tmp_path / "plain_tiny-mixtral-8x7b.png").stat().st_size > 0
