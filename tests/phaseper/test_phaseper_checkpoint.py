import json

import jax
import numpy as np
import pytest
from flax import nnx

from pdscope_jax.phaseper import checkpoint as ckpt_mod
from pdscope_jax.phaseper.checkpoint import PredictorCheckpointError, load_predictors, save_predictors
from pdscope_jax.phaseper.predictor import PredictorHParams, PredictorSet
from pdscope_jax.presets import preset

CFG = preset("tiny-deepseek-v2-lite")  # hidden 64, 8 experts, top-3, MoE layers 1..3
HP = PredictorHParams(CFG.hidden_size, CFG.num_experts_per_tok, CFG.num_experts, proj_dim=8, hidden=16)


def _pset(seed):
    return PredictorSet(HP, CFG.moe_layers, (1, 2), seed=seed)


def _inputs():
    rng = np.random.default_rng(0)
    return rng.normal(size=(4, 64)), rng.random((4, 3)), rng.integers(0, 8, (4, 3))


def _same(p, q):
    return all(
        np.allclose(p.predict(phase, layer, *_inputs()), q.predict(phase, layer, *_inputs()))
        for phase, layer in p.keys()
    )


def test_roundtrip_and_manifest(tmp_path):
    pset = _pset(1)
    metrics = {"phases": {"prefill": {"recall_at_k": 0.9, "table5": float("nan")}}}
    path = save_predictors(pset, CFG, tmp_path / "predictors", corpus="synthetic test corpus", metrics=metrics)
    assert path == tmp_path / "predictors" / "tiny-deepseek-v2-lite"
    assert sorted(p.name for p in (tmp_path / "predictors").iterdir()) == ["tiny-deepseek-v2-lite"]
    restored, manifest = load_predictors(tmp_path / "predictors", CFG)
    assert _same(pset, restored) and not _same(_pset(2), restored)
    on_disk = json.loads((path / "manifest.json").read_text())
    assert on_disk == manifest
    assert manifest["fingerprint"] == CFG.fingerprint() and manifest["corpus"] == "synthetic test corpus"
    assert manifest["groups"] == {"input_end": 1, "middle_end": 2} and manifest["moe_layers"] == [1, 2, 3]
    assert manifest["hparams"] == HP.to_dict()
    assert manifest["metrics"]["phases"]["prefill"] == {"recall_at_k": 0.9, "table5": None}
    assert restored.groups == (1, 2) and restored.hp == HP


def test_resave_replaces_previous(tmp_path):
    save_predictors(_pset(1), CFG, tmp_path)
    save_predictors(_pset(2), CFG, tmp_path)
    restored, _ = load_predictors(tmp_path / "tiny-deepseek-v2-lite", CFG)
    assert _same(_pset(2), restored)
    assert [p.name for p in tmp_path.iterdir()] == ["tiny-deepseek-v2-lite"]


def test_other_model_fails_naming_both_fingerprints(tmp_path):
    path = save_predictors(_pset(1), CFG, tmp_path)
    other = CFG.replace(num_experts=16)
    with pytest.raises(PredictorCheckpointError) as err:
        load_predictors(path, other)
    assert CFG.fingerprint() in str(err.value) and other.fingerprint() in str(err.value)


def test_interrupted_save_is_never_picked_up(tmp_path, monkeypatch):
    save_predictors(_pset(1), CFG, tmp_path)

    def crash(*args, **kwargs):
        raise KeyboardInterrupt("power cut before the manifest was written")

    monkeypatch.setattr(ckpt_mod, "_write_manifest", crash)
    with pytest.raises(KeyboardInterrupt):
        save_predictors(_pset(2), CFG, tmp_path)
    monkeypatch.undo()
    leftovers = [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    assert len(leftovers) == 1 and (leftovers[0] / "state").exists()
    restored, _ = load_predictors(tmp_path, CFG)  # the earlier, complete checkpoint is what loads
    assert _same(_pset(1), restored)
    with pytest.raises(PredictorCheckpointError, match="temporary directory of an unfinished save"):
        load_predictors(leftovers[0], CFG)


def test_partial_directories_fail_clearly(tmp_path, monkeypatch):
    def crash(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(ckpt_mod, "_write_manifest", crash)
    with pytest.raises(KeyboardInterrupt):
        save_predictors(_pset(1), CFG, tmp_path)
    monkeypatch.undo()
    with pytest.raises(PredictorCheckpointError, match="interrupted save"):
        load_predictors(tmp_path, CFG)
    # a directory with the right name but no manifest (copied or truncated by hand)
    partial = tmp_path / "copy" / "tiny-deepseek-v2-lite"
    (partial / "state").mkdir(parents=True)
    with pytest.raises(PredictorCheckpointError, match="no manifest.json.*interrupted"):
        load_predictors(tmp_path / "copy", CFG)
    with pytest.raises(PredictorCheckpointError, match="no predictor checkpoint"):
        load_predictors(tmp_path / "nowhere", CFG)


def test_restored_parameters_are_arrays_of_the_right_shapes(tmp_path):
    pset = _pset(3)
    restored, _ = load_predictors(save_predictors(pset, CFG, tmp_path), CFG)
    for key in pset.keys():
        want = jax.tree.map(lambda x: (x.shape, x.dtype), nnx.to_pure_dict(pset.state(*key)))
        got = jax.tree.map(lambda x: (x.shape, x.dtype), nnx.to_pure_dict(restored.state(*key)))
        assert want == got


def test_a_checkpoint_from_before_the_linear_path_loads_without_it(tmp_path):
    import dataclasses

    from pdscope_jax.artifacts import integrity

    pset = PredictorSet(dataclasses.replace(HP, linear=False), CFG.moe_layers, (1, 2), seed=4)
    path = save_predictors(pset, CFG, tmp_path)
    manifest = json.loads((path / "manifest.json").read_text())
    del manifest["hparams"]["linear"], manifest[integrity.CHECKSUM_KEY]  # as such checkpoints were written
    (path / "manifest.json").write_text(json.dumps(integrity.seal(manifest)))
    restored, _ = load_predictors(path, CFG)
    assert restored.hp.linear is False and _same(pset, restored)
