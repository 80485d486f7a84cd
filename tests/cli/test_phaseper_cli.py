"""`pdscope-jax train-predictors`: the --smoke path end to end, and the refusal of foreign traces."""

import json

import pytest

from pdscope_jax.api import resolve
from pdscope_jax.phaseper.checkpoint import load_predictors
from pdscope_jax.cli.train_predictors import SMOKE_MODEL, train_predictors_main
from pdscope_jax.errors import InputError
from pdscope_jax.phaseper.traces import load_traces, write_synthetic_traces


def test_smoke_collects_trains_saves_and_reloads(tmp_path, capsys):
    assert train_predictors_main(["--smoke", "--out", str(tmp_path), "--no-progress"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    cfg, _ = resolve(SMOKE_MODEL)
    target = tmp_path / SMOKE_MODEL
    assert summary["checkpoint"] == str(target)
    assert (target / "layer_groups.png").stat().st_size > 0
    pset, manifest = load_predictors(tmp_path, cfg)
    assert manifest["fingerprint"] == cfg.fingerprint()
    assert "smoke" in manifest["corpus"]
    # Groups come from the collected similarity, and are what the set was built with.
    lg = manifest["metrics"]["layer_groups"]
    assert (lg["input_end"], lg["middle_end"]) == pset.groups == tuple(summary["groups"])
    assert len(lg["similarity"]) == len(lg["weight_spread"]) == len(cfg.moe_layers)
    assert lg["similarity_source"].startswith("layer_stats.json")
    traces = load_traces(tmp_path / "smoke-traces")
    assert traces.fingerprint == cfg.fingerprint() and traces.tokens("decode", traces.layers[0]) == 8 * 4
    for phase in ("prefill", "decode"):
        layers = manifest["metrics"]["phases"][phase]["layers"]
        assert all(m["trained"] and m["epochs_run"] >= 1 for m in layers.values())
        assert 0.0 <= summary["validation"][phase]["recall_at_k"] <= 1.0
    assert manifest["metrics"]["command"].startswith("pdscope-jax train-predictors --smoke")


def test_traces_of_another_model_are_refused(tmp_path):
    traces = write_synthetic_traces(tmp_path / "t", fingerprint="not-this-model")
    with pytest.raises(InputError, match="not-this-model"):
        train_predictors_main(["--traces", str(traces), "--model", SMOKE_MODEL, "--out", str(tmp_path / "p")])
    assert not (tmp_path / "p").exists() or not any((tmp_path / "p").iterdir())


def test_missing_traces_is_a_usage_error(tmp_path):
    with pytest.raises(InputError, match="--traces is required"):
        train_predictors_main(["--model", SMOKE_MODEL, "--out", str(tmp_path)])
