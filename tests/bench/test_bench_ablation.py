"""The benchmark's ablation sequence, batch list, plain upper bound, skewed workload and checkpoint models,
at toy sizes on two CPU devices."""

import json
from pathlib import Path

from pdscope_jax.cli.bench import main as bench_main
from pdscope_jax.presets import preset

REFERENCE = Path(__file__).resolve().parents[2] / "pdscope_jax" / "assets" / "reference-moe"


def test_ablation_on_skewed_tiny_model(tmp_path):
    slots = 2 * preset("tiny-deepseek-v2-lite").num_experts + 4  # two layers fit: prefill can stream
    argv = ["--model", "tiny-deepseek-v2-lite", "--ablation", "--workload", "skewed", "--batch", "1", "2",
            "--prefill-chunk", "16", "--prompt-lens", "24", "--new-tokens", "3", "--repeats", "1", "--warmup", "1",
            "--gpu-memory", "1GB", "--expert-pool", str(slots * preset("tiny-deepseek-v2-lite").expert_bytes(4)),
            "--dtype", "float32", "--out", str(tmp_path)]
    report = bench_main(argv)
    saved = json.loads(next(tmp_path.glob("bench_*.json")).read_text())
    assert saved["workload"] == "skewed" and saved["weights"] == "random" and saved["ablation"]
    assert [entry["layer"] for entry in saved["workload_design"]["layers"]] == [1, 2, 3]
    assert Path(saved["hot_table"]).exists()  # recorded from an untimed on-demand run
    order = ["greedy", "+h", "+i", "+p+a", "+g+c", "plain"]
    assert [(r["variant"], r["batch"]) for r in report["results"]] == [(v, b) for v in order for b in (1, 2)]
    for r in report["results"]:
        if r["policy"] == "plain":
            continue
        assert r["tokens_match_plain"]  # every engine configuration gives the plain model's tokens
        assert r["tokens_before_divergence"] == 3
        assert r["prefill"]["planner_ms_per_layer"] > 0
        if r["variant"] == "+g+c":  # decode as one accelerator program per step: no planner call, no split
            assert r["decode"]["device_steps"] > 0 and r["decode"]["planner_ms_per_layer"] is None
        else:
            assert r["decode"]["device_steps"] == 0 and r["decode"]["planner_ms_per_layer"] > 0
        assert r["async_io"] == (r["variant"] not in ("greedy", "+h"))
        assert r["batched_gpu"] == (r["variant"] == "+g+c")
        assert (r["hot_table"] is None) == (r["variant"] == "greedy")


def test_checkpoint_model_with_plain_upper_bound(tmp_path):
    argv = ["--model", str(REFERENCE), "--policies", "pdscope", "plain", "--prompt-lens", "16", "--new-tokens",
            "3", "--repeats", "1", "--warmup", "1", "--gpu-memory", "1GB", "--expert-pool", "2MB", "--dtype",
            "float32", "--out", str(tmp_path)]
    report = bench_main(argv)
    assert report["weights"] == "checkpoint" and report["workload"] == "checkpoint"
    assert report["command"].endswith(" ".join(argv)) and report["complete"]
    assert [(r["policy"], r["prompt_len"]) for r in report["results"]] == [("pdscope", 16), ("plain", 16)]
    offload, plain = report["results"]
    assert offload["tokens_match_plain"] and offload["tokens_before_divergence"] == 3
    assert plain["tokens_match_plain"] is None and len(plain["repeats"]) == 1
