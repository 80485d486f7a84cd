"""The next-layer prediction's recall measured in the run reaches the benchmark's JSON, table and summary line."""

import json

from rich.console import Console

from pdscope_jax.bench import report
from pdscope_jax.cli.bench import main as bench_main
from pdscope_jax.presets import preset


def test_bench_records_and_prints_the_prediction_recall_per_phase(tmp_path, capsys):
    slot = preset("tiny-deepseek-v2-lite").expert_bytes(4)
    argv = ["--model", "tiny-deepseek-v2-lite", "--policies", "fate:host", "pdscope:notrial", "greedy:host",
            "--workload", "uniform", "--predictability", "oracle", "--prompt-lens", "16", "--new-tokens", "3",
            "--repeats", "1", "--warmup", "1", "--gpu-memory", "1GB", "--expert-pool", str(6 * slot),
            "--dtype", "float32", "--out", str(tmp_path)]
    bench_main(argv)
    saved = json.loads(next(tmp_path.glob("*.json")).read_text())
    rows = {r["variant"]: r for r in saved["results"]}
    assert saved["workload_design"]["predictability"] == "oracle"
    fate, pdscope, greedy = rows["fate:host"], rows["pdscope:notrial"], rows["greedy:host"]  # the device step: no trial
    assert fate["decode"]["device_steps"] == 0
    assert fate["prefill"]["prediction_recall"] == 1.0 and fate["decode"]["prediction_recall"] == 1.0
    assert pdscope["decode"]["device_steps"] > 0 and pdscope["decode"]["prediction_recall"] is None
    assert pdscope["prefill"]["prediction_recall"] == 1.0
    assert greedy["prefill"]["prediction_recall"] is None and greedy["decode"]["prediction_recall"] is None
    for r in (fate, pdscope):  # the repeats keep the sums the medians come from
        assert r["repeats"][0]["prefill"]["predicted_hits"] == r["repeats"][0]["prefill"]["predicted_total"] > 0
    assert greedy["repeats"][0]["prefill"]["predicted_total"] == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [r["prediction_recall"] for r in summary["results"]] == [
        {"prefill": 1.0, "decode": 1.0}, {"prefill": 1.0, "decode": None}, {"prefill": None, "decode": None}]

    console = Console(width=300, record=True)
    console.print(report.table(saved["results"]))
    lines = {line.split("│")[1].strip(): line for line in console.export_text().splitlines() if line.count("│") > 3}
    assert "1.000/1.000" in lines["fate:host"]
    assert "1.000/n/a (device)" in lines["pdscope:notrial"]
    assert "-/-" in lines["greedy:host"]
