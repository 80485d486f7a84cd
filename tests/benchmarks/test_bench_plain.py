"""benchmarks/bench_plain.py (the whole-model upper bound) runs end to end and writes what it reports."""

import json
import shlex

import pytest


def test_bench_plain_writes_json_and_png(tmp_path, load_script):
    bench = load_script("bench_plain")
    argv = ["--model", "tiny-mixtral-8x7b", "--lengths", "8", "16", "--new-tokens", "3", "--repeats", "1",
            "--out", str(tmp_path)]
    result = bench.main(argv)
    saved = json.loads((tmp_path / "plain_tiny-mixtral-8x7b.json").read_text())
    assert saved["rows"] == result["rows"] and [r["prompt_tokens"] for r in saved["rows"]] == [8, 16]
    for row in saved["rows"]:  # the reported rates are those of the recorded times (batch 1, 3 - 1 decoded tokens)
        (prefill,), (decode,) = row["prefill_seconds"], row["decode_seconds"]
        assert row["prefill_tok_s"] == pytest.approx(row["prompt_tokens"] / prefill)
        assert row["decode_tok_s"] == pytest.approx(2 / decode)
    assert saved["weights"].startswith("random") and saved["new_tokens"] == 3 and saved["repeats"] == 1
    assert saved["command"] == shlex.join(["python", "benchmarks/bench_plain.py", *argv])
    assert (tmp_path / "plain_tiny-mixtral-8x7b.png").stat().st_size > 0
