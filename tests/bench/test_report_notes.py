"""The bench table's caption names the runs whose device decode ran without the host bridge, on a GPU only."""

from pdscope_jax.bench.report import bridge_missing, table

PHASE = {"cpu_seconds": 0.0, "gpu_seconds": 0.0, "transfer_seconds": 0.0, "exposed_transfer_seconds": 0.0,
         "bytes_moved": 0.0, "hit_rate": 0.5, "prefetch_accuracy": None, "planner_ms_per_layer": None,
         "prediction_recall": None}
WHY = "the experts are not bf16 arrays with host addresses"


def result(variant: str, device_steps: int, why: str) -> dict:
    return {"variant": variant, "policy": variant, "batch": 1, "prompt_len": 8, "prefill_tok_s": 1.0,
            "decode_tok_s": 1.0, "tokens_match_plain": True, "prefill": dict(PHASE),
            "decode": {**PHASE, "device_steps": device_steps}, "repeats": [{"decode_host": {"why_not": why}}]}


def test_runs_without_the_bridge_are_named_with_the_reason_on_a_gpu():
    rows = [result("pdscope", 7, WHY), result("ondemand", 7, ""), result("fate", 0, WHY)]
    assert [bridge_missing(r) for r in rows] == [WHY, None, None]  # a bridge ran; decode planned on the host
    caption = table(rows, on_gpu=True).caption
    assert f"pdscope: device decode ran without the host bridge ({WHY})" in caption
    assert "ondemand:" not in caption and "fate:" not in caption
    assert "host bridge" not in table(rows).caption  # on the CPU backend there is never a bridge: no notes
