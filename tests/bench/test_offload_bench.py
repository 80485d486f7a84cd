"""Smoke runs of the offload benchmark and the two GPU-node scripts, at toy sizes on two CPU devices."""

import json
import runpy
import statistics
from pathlib import Path

import numpy as np
import pytest

from pdscope_jax.artifacts import provenance
from pdscope_jax.cli.bench import main as bench_main
from pdscope_jax.errors import InputError
from pdscope_jax.kernels import cpu_ffn
from pdscope_jax.presets import preset

SCRIPTS = Path(__file__).resolve().parents[2] / "benchmarks"
PROBES = SCRIPTS / "probes"


@pytest.fixture
def probes(monkeypatch):
    """The probe scripts import their shared helpers as `_common`, from their own folder."""
    monkeypatch.syspath_prepend(str(PROBES))
    return PROBES


def test_bench_writes_json_png_and_flat_memory(tmp_path):
    slot = preset("tiny-deepseek-v2-lite").expert_bytes(4)
    argv = ["--model", "tiny-deepseek-v2-lite", "--policies", "static", "pdscope", "gpu", "--prompt-lens", "16",
            "--new-tokens", "3", "--repeats", "2", "--warmup", "1", "--gpu-memory", "1GB",
            "--expert-pool", str(6 * slot), "--dtype", "float32", "--track-memory", "8", "--out", str(tmp_path)]
    report = bench_main(argv)
    files = sorted(p.suffix for p in tmp_path.iterdir())
    assert files == [".json", ".png"]
    saved = json.loads(next(tmp_path.glob("*.json")).read_text())
    assert saved["weights"] == "random" and saved["command"].endswith(" ".join(argv))
    assert saved["commit"] == provenance.source_commit()
    assert saved["jax"] and saved["device"].startswith("cpu:1")
    assert saved["cpu_kernel"]["enabled"] is (cpu_ffn.available())  # on by default where it can run
    assert [(r["policy"], r["prompt_len"]) for r in saved["results"]] == [("static", 16), ("pdscope", 16)]
    assert [e["policy"] for e in saved["errors"]] == ["gpu"]  # 6 slots cannot hold every expert
    for r in saved["results"]:
        assert len(r["repeats"]) == 2
        assert r["decode_tok_s"] == statistics.median(x["decode_tok_s"] for x in r["repeats"])
        assert "tokens_match_plain" not in r  # no plain run to compare with
        assert [x["pool"] for x in r["repeats"]] == ["cold", "warm"]
        assert (r["prefill_tok_s_cold"], r["prefill_tok_s_warm"]) == tuple(x["prefill_tok_s"] for x in r["repeats"])
        assert set(r["prefill"]) >= {"cpu_seconds", "gpu_seconds", "transfer_seconds", "exposed_transfer_seconds",
                                     "bytes_moved", "hit_rate", "prefetch_accuracy"}
    live = [s["live_array_bytes"] for s in report["memory"]["steps"]]
    assert len(live) == 8 and min(live) == max(live)


def test_bench_reports_a_failing_point_and_profiles_the_host(tmp_path, monkeypatch):
    """A point that raises is recorded and the rest still run; the partial JSON is replaced by the complete one;
    --cprofile lists host functions per run."""
    from pdscope_jax.engine.runner import OffloadRunner

    real_warmup = OffloadRunner.warmup

    def warmup(self, batch, prompt_len, new_tokens=2):
        if prompt_len == 12:
            raise RuntimeError("injected failure at 12 tokens")
        return real_warmup(self, batch, prompt_len, new_tokens)

    monkeypatch.setattr(OffloadRunner, "warmup", warmup)
    slot = preset("tiny-deepseek-v2-lite").expert_bytes(4)
    report = bench_main(["--model", "tiny-deepseek-v2-lite", "--policies", "ondemand:host", "--prompt-lens", "8", "12",
                         "16", "--new-tokens", "3", "--repeats", "1", "--gpu-memory", "1GB",
                         "--expert-pool", str(6 * slot), "--dtype", "float32", "--cprofile", "2",
                         "--no-cpu-kernel", "--out", str(tmp_path)])
    assert [r["prompt_len"] for r in report["results"]] == [8, 16]
    assert [(e["prompt_len"], e["error"]) for e in report["errors"]] == [(12, "RuntimeError: injected failure at "
                                                                              "12 tokens")]
    saved = json.loads(next(tmp_path.glob("bench_*.json")).read_text())
    assert saved["complete"] and len(saved["results"]) == 2
    assert saved["cpu_kernel"]["enabled"] is False  # --no-cpu-kernel: XLA:CPU only
    assert saved["results"][0]["device_decode"] is False  # the host plans each decode layer
    profile = saved["cprofile"]["ondemand:host"]
    assert profile["new_tokens"] == 2 and profile["by_cumulative_time"][0]["cumulative_s"] > 0
    assert any("generate" in row["function"] for row in profile["by_cumulative_time"])
    moe_layers = len(preset("tiny-deepseek-v2-lite").moe_layers)
    decode = profile["timeline_ms"]["decode"]  # one decode step
    assert decode["layers"] == moe_layers and decode["routed -> planned"] >= 0
    assert decode["layer_start -> gpu_done"] > 0 and decode["layer_start -> route_dispatched"] > 0
    assert profile["timeline_ms"]["prefill"]["layers"] == moe_layers


def test_decode_paths_probe_smoke(tmp_path, probes):
    main = runpy.run_path(str(probes / "probe_decode_paths.py"))["main"]
    result = main(["--hidden", "64", "--intermediate", "32", "--experts", "1", "2", "--reps", "1",
                   "--out", str(tmp_path / "paths.json")])
    kinds = {(r["kind"], r.get("experts")) for r in result["records"]}
    assert {("cpu_chain", 2), ("cpu_one_program", 2), ("cpu_threads", 1), ("copy_issue", 2), ("copy_done", 1)} <= kinds
    assert all(r["GBps"] > 0 for r in result["records"])
    assert json.loads((tmp_path / "paths.json").read_text())["expert_shape"]["hidden"] == 64


def test_decode_cpu_callback_probe_smoke(tmp_path, probes):
    main = runpy.run_path(str(probes / "probe_decode_cpu_callback.py"))["main"]
    result = main(["--hidden", "64", "--intermediate", "32", "--num-experts", "4", "--layers", "2", "--reps", "1",
                   "--variants", "2+0", "1+1", "0+0", "--out", str(tmp_path / "cb.json")])
    by = {r["variant"]: r for r in result["records"]}
    assert set(by) == {"2+0", "1+1", "0+0cb"} and all(r["ms_per_layer"] > 0 for r in by.values())
    assert by["1+1"]["cpu_alone_ms"] > 0 and "cpu_alone_ms" not in by["2+0"]
    assert json.loads((tmp_path / "cb.json").read_text())["weights"] == "seeded random"


def test_cpu_expert_script_smoke(tmp_path):
    main = runpy.run_path(str(SCRIPTS / "bench_cpu_expert.py"))["main"]
    summary = main(["--hidden", "64", "--intermediate", "32", "--tokens", "1", "16", "--pads", "16", "--reps", "1",
                    "--warm", "1", "--out", str(tmp_path / "cpu.json")])
    assert set(summary["one_row_ms"]) >= {"xla_bf16", "xla_f32", "xla_bf16_pad16", "engine_bf16"}
    assert summary["recommended_min_rows"] == 16
    assert json.loads((tmp_path / "cpu.json").read_text())["summary"]["shape"] == {"hidden": 64, "intermediate": 32}


def test_store_probe_script_smoke(tmp_path, probes):
    main = runpy.run_path(str(probes / "probe_store_gpu.py"))["main"]
    found = main(["--layers", "2", "--experts", "4", "--hidden", "64", "--intermediate", "32", "--matmul", "64",
                  "--out", str(tmp_path / "probe.json")])
    by = {row["what"]: row for row in found}
    assert by["placement"]["host_bytes_per_model_byte"] == pytest.approx(1.0)
    assert by["cpu_view"]["cpu_array_aliases"] and by["cpu_view"]["view_matches"]
    assert by["slot_write_in_place"]["same_address"]
    assert {row["variant"] for row in found if row["what"] == "overlap"} >= {"stage_before_compute"}


def test_tokens_before_divergence_counts_the_common_prefix():
    from pdscope_jax.bench.runs import common_prefix

    plain = np.array([[5, 6, 7, 8], [1, 2, 3, 4]])
    assert common_prefix(plain, plain.copy()) == 4
    assert common_prefix(plain, np.array([[5, 6, 7, 9], [1, 2, 0, 4]])) == 2  # the earliest difference counts
    assert common_prefix(plain, np.array([[0, 6, 7, 8], [1, 2, 3, 4]])) == 0


def test_copy_issue_probe_smoke(tmp_path, probes):
    main = runpy.run_path(str(probes / "probe_copy_issue.py"))["main"]
    result = main(["--hidden", "64", "--intermediate", "32", "--experts", "1", "2", "--slots", "4", "--reps", "1",
                   "--out", str(tmp_path / "copies.json")])
    kinds = {(r["kind"], r["experts"]) for r in result["records"]}
    ways = ("put_pairs", "put_merged", "jit_pull", "jit_pull_commit", "put_then_commit", "thread_put")
    assert {(way, k) for way in ways for k in (1, 2)} | {("cpu_alone", 1), ("cpu_beside_copy", 1)} <= kinds
    assert {("route_roundtrip", 0), ("route_roundtrip_packed", 0)} <= kinds
    assert all(r["done_ms"] > 0 and r["issue_ms"] >= 0 for r in result["records"])
    assert json.loads((tmp_path / "copies.json").read_text())["expert_shape"]["hidden"] == 64


def test_decode_host_probe_smoke(tmp_path, probes):
    main = runpy.run_path(str(probes / "probe_decode_host.py"))["main"]
    result = main(["--model", "tiny-deepseek-v2-lite", "--policies", "pdscope", "--variants", "engine", "inline",
                   "switch_0.001", "--tokens", "3", "--repeats", "1", "--gpu-memory", "1GB", "--expert-pool", "200KB",
                   "--out", str(tmp_path / "host.json")])
    assert [(r["policy"], r["variant"]) for r in result["records"]] == [
        ("pdscope", "engine"), ("pdscope", "inline"), ("pdscope", "switch_0.001")]
    for record in result["records"]:
        assert record["decode_ms_per_step"] > 0 and record["timeline_ms"]["layer_start -> route_dispatched"] > 0
    assert json.loads((tmp_path / "host.json").read_text())["weights"] == "random"


def test_dispatch_probe_smoke(tmp_path, probes):
    main = runpy.run_path(str(probes / "probe_dispatch.py"))["main"]
    result = main(["--model", "tiny-deepseek-v2-lite", "--reps", "2", "--busy-experts", "2", "--later-ms", "0.1",
                   "--out", str(tmp_path / "dispatch.json")])
    cases = {r["case"] for r in result["records"]}
    assert {"route", "route_leaves", "trivial_numpy", "trivial_pinned_busy_put", "device_put_numpy_busy_pull",
            "trivial_busy_put_later"} <= cases
    assert all(r["host_ms"] > 0 for r in result["records"])
    assert json.loads((tmp_path / "dispatch.json").read_text())["state_leaves"] > 0


def test_decode_step_probe_smoke(tmp_path, probes):
    main = runpy.run_path(str(probes / "probe_decode_step.py"))["main"]
    result = main(["--hidden", "16", "--intermediate", "8", "--num-experts", "8", "--top-k", "2", "--layers", "2",
                   "--slots", "5", "--reps", "3", "--warmup", "1", "--out", str(tmp_path / "step.json")])
    records = {r["variant"]: r for r in result["records"]}
    assert list(records) == ["resident", "engine", "fixed"]
    assert records["resident"]["misses_per_step"] == 0 and records["engine"]["misses_per_step"] > 0
    assert all(r["activated_per_step"] == 4 and r["pool_copies_in_hlo"] == 0 for r in records.values())
    assert records["engine"]["conditionals_in_hlo"] == 2 and records["fixed"]["conditionals_in_hlo"] == 0
    assert json.loads((tmp_path / "step.json").read_text())["expert_bytes"] == (16 * 16 + 8 * 16) * 2


def test_bench_refuses_an_unknown_policy_before_building(monkeypatch):
    import pdscope_jax.bench.compare

    monkeypatch.setattr(pdscope_jax.bench.compare, "compare", lambda *a: pytest.fail("built before the check"))
    with pytest.raises(InputError, match="--policies: unknown 'nope'"):
        bench_main(["--model", "tiny-deepseek-v2-lite", "--policies", "ondemand", "nope", "--prompt-lens", "8"])


def test_decode_step_probe_profiles_the_kernels_it_ran(tmp_path, probes):
    main = runpy.run_path(str(probes / "probe_decode_step.py"))["main"]
    result = main(["--hidden", "16", "--intermediate", "8", "--num-experts", "8", "--top-k", "2", "--layers", "2",
                   "--slots", "5", "--reps", "2", "--warmup", "1", "--variants", "engine", "--profile-steps", "2"])
    profile = result["records"][0]["kernel_profile"]
    assert profile["busy_us_per_step"] > 0 and profile["kernels_per_step"] > 0
    for key in ("by_hlo_op", "by_kernel"):
        assert profile[key] and all(kind["launches_per_step"] > 0 for kind in profile[key])


def test_results_name_the_commit_that_made_them(tmp_path, monkeypatch):
    """A COMMIT file at the tree's root wins over git (a copied tree may carry a stale HEAD); else git's short
    HEAD, "+dirty" when a tracked file differs; None outside a checkout."""
    import subprocess

    monkeypatch.setattr(provenance, "ROOT", tmp_path)
    assert provenance.source_commit() is None
    git = lambda *a: subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *a],  # noqa: E731
                                    cwd=tmp_path,
                                    capture_output=True, text=True, check=True).stdout.strip()
    git("init", "-q")
    (tmp_path / "f").write_text("1")
    git("add", "f")
    git("commit", "-qm", "x")
    head = git("rev-parse", "--short", "HEAD")
    assert provenance.source_commit() == head
    (tmp_path / "f").write_text("2")
    assert provenance.source_commit() == head + "+dirty"
    (tmp_path / "COMMIT").write_text("abc1234\n")
    assert provenance.source_commit() == "abc1234"
