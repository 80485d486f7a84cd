"""Corrupt bytes anywhere in a saved predictor checkpoint (or trace set, layer_stats.json) are the project's own
error naming the file, never NaN predictions or a raw library error."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdscope_jax.phaseper.checkpoint import PredictorCheckpointError, load_predictors, save_predictors
from pdscope_jax.phaseper.collect import read_stats
from pdscope_jax.phaseper.predictor import PredictorHParams, PredictorSet
from pdscope_jax.phaseper.traces import TraceError, load_traces, write_synthetic_traces
from pdscope_jax.presets import preset

CFG = preset("tiny-deepseek-v2-lite")
HP = PredictorHParams(CFG.hidden_size, CFG.num_experts_per_tok, CFG.num_experts, proj_dim=8, hidden=16)
RNG = np.random.default_rng(0)
INPUTS = (RNG.normal(size=(4, 64)), RNG.random((4, 3)), RNG.integers(0, 8, (4, 3)))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    pset = PredictorSet(HP, CFG.moe_layers, (1, 2), seed=1)
    path = save_predictors(pset, CFG, tmp_path_factory.mktemp("ckpt"), corpus="c")
    files = sorted(p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file())
    return path, files, {key: pset.predict(*key, *INPUTS) for key in pset.keys()}


def test_the_manifest_lists_every_state_file(saved):
    path, files, _ = saved
    manifest = json.loads((path / "manifest.json").read_text())
    assert sorted(f"state/{name}" for name in manifest["files"]) == [f for f in files if f != "manifest.json"]
    assert manifest["format_version"] == 2 and len(manifest["checksum"]) == 64


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_a_corrupt_byte_anywhere_is_a_checkpoint_error(saved, data):
    path, files, want = saved
    name = data.draw(st.sampled_from(files))
    with tempfile.TemporaryDirectory() as scratch:
        copy = Path(scratch) / path.name
        shutil.copytree(path, copy)
        raw = bytearray((copy / name).read_bytes())
        offset = data.draw(st.integers(0, max(len(raw) - 1, 0)))
        kind = data.draw(st.sampled_from(["xor", "cut", "delete"]))
        if kind == "delete":
            (copy / name).unlink()
        else:
            if kind == "xor" and raw:
                raw[offset] ^= data.draw(st.integers(1, 255))
            else:
                del raw[offset:]
            (copy / name).write_bytes(bytes(raw))
        try:
            restored, _ = load_predictors(copy, CFG)
        except PredictorCheckpointError as err:
            message = str(err)
            assert "train-predictors" in message
            if name != "manifest.json":  # a state file's problem names that file
                assert name.split("/")[-1] in message or "manifest" in message, message
            return
    # only a change the seal cannot see loads: JSON whitespace of the manifest, which changes nothing
    assert name == "manifest.json" and kind == "xor"
    for key, probs in want.items():
        got = restored.predict(*key, *INPUTS)
        assert np.isfinite(got).all()
        np.testing.assert_allclose(got, probs, atol=1e-6)


def test_edited_manifest_is_refused(saved, tmp_path):
    path, _, _ = saved
    shutil.copytree(path, tmp_path / "c")
    manifest = json.loads((tmp_path / "c" / "manifest.json").read_text())
    manifest["hparams"]["hidden"] = 32
    (tmp_path / "c" / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(PredictorCheckpointError, match="content does not match its checksum.*train-predictors"):
        load_predictors(tmp_path / "c", CFG)


def test_traces_with_a_corrupt_or_missing_shard_name_it(tmp_path):
    write_synthetic_traces(tmp_path / "t")
    shard = tmp_path / "t" / "decode" / "layer1" / "a.000000.npy"
    raw = bytearray(shard.read_bytes())
    raw[-1] ^= 1
    shard.write_bytes(bytes(raw))
    traces = load_traces(tmp_path / "t")
    with pytest.raises(TraceError, match=r"a.000000.npy is corrupt.*collect-traces"):
        traces.layer("decode", 1)
    shard.unlink()
    with pytest.raises(TraceError, match=r"a.000000.npy is missing.*collect-traces"):
        load_traces(tmp_path / "t").layer("decode", 1)
    manifest = tmp_path / "t" / "manifest.json"
    manifest.write_text(manifest.read_text().replace('"dim": 32', '"dim": 33'))
    with pytest.raises(TraceError, match="does not match its checksum"):
        load_traces(tmp_path / "t")


def test_layer_stats_are_sealed(tmp_path):
    from pdscope_jax.sched.hot import HotTableError, activation_counts, write_layer_stats

    path = write_layer_stats(tmp_path / "layer_stats.json", [1, 2], {"decode": {1: [1, 0], 2: [0, 3]}})
    assert activation_counts(path)[2].tolist() == [0, 3]
    assert read_stats(tmp_path)["layers"] == [1, 2]
    path.write_text(path.read_text().replace("3.0", "4.0"))
    with pytest.raises(HotTableError, match="does not match its checksum.*collect-traces"):
        activation_counts(path)
    with pytest.raises(TraceError, match="does not match its checksum.*collect-traces"):
        read_stats(tmp_path)
