"""The routing workloads: exact designed routing in the real model, the intended popularity (skewed) or equal
shares (uniform), the calibrated predictability of the next layer's routing, and parity of the offload engine on
the rewritten weights."""

from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from pdscope_jax import models
from pdscope_jax.generation.generator import Generator
from pdscope_jax.engine.runner import OffloadRunner
from pdscope_jax.phaseper.collect import walk
from pdscope_jax.presets import preset
from pdscope_jax.runtime import RuntimeConfig
from pdscope_jax.weights.random_init import random_state
from pdscope_jax.workloads.predictability import PREDICTABILITY, reference_targets
from pdscope_jax.workloads.routing import affinity_lift, design, reference_stats, shares, top_quarter_share

NAME = "tiny-deepseek-v2-lite"


@pytest.fixture(scope="module")
def setup():
    cfg = preset(NAME)
    shapes = models.abstract_state(cfg, jnp.float32)
    flat = random_state(shapes, 0, lambda path: None)
    workload = design(cfg, "skewed", seed=0)
    return cfg, shapes, flat, workload


def _walk(cfg, flat, ids):
    """(model, walk) of the model with parameters `flat` over token ids [B, T]."""
    model = models.from_flat(cfg, jnp.float32, flat)
    positions = jnp.broadcast_to(jnp.arange(ids.shape[1], dtype=jnp.int32), ids.shape)
    return model, walk(model, jnp.asarray(ids), positions)


def _routing(cfg, flat, ids):
    return np.sort(np.asarray(_walk(cfg, flat, ids)[1].experts), axis=-1)  # [M, N, K]


def _fate(cfg, flat, ids):
    """[M-1, N, K] top-k of MoE layer j+1's router kernel on layer j's MoE input, in the model itself (what `fate`
    and `pdscope`'s gate fallback score: the order of the logits is the order of the scores)."""
    model, out = _walk(cfg, flat, ids)
    kernels = [np.asarray(model.layers[i].mlp.gate.kernel[...]) for i in cfg.moe_layers]
    a, k = np.asarray(out.a), cfg.num_experts_per_tok
    return np.stack([np.sort(np.argpartition(-(a[m] @ kernels[m + 1]), k - 1, axis=1)[:, :k], axis=1)
                     for m in range(len(kernels) - 1)])


def _recall(guess, true, k):
    """Mean over tokens of |guess ∩ true| / k, [N, K] each."""
    return float((guess[:, :, None] == true[:, None, :]).any(axis=2).sum(axis=1).mean() / k)


def test_model_routes_exactly_as_designed_with_the_intended_skew(setup):
    cfg, _, flat, workload = setup
    ids = np.random.default_rng(1).integers(0, cfg.vocab_size, (4, 128)).astype(np.int32)
    experts = _routing(cfg, workload.apply(flat), ids)
    np.testing.assert_array_equal(experts, workload.experts(ids))  # a function of the token id, as designed
    random_weights = _routing(cfg, flat, ids)
    for m, entry in enumerate(workload.report):
        got = top_quarter_share(shares(experts[m], cfg.num_experts))
        # 512 tokens drawn from the 256-token vocabulary the design was fitted on
        assert got == pytest.approx(entry["target_top_quarter_share"], abs=0.06)
        assert got > top_quarter_share(shares(random_weights[m], cfg.num_experts)) + 0.05
        assert entry["max_share_error"] < 0.01
    for entry in workload.report[1:]:  # inter-layer affinity: a lift over popularity near the reference's
        assert entry["lift"] == pytest.approx(entry["target_lift"], abs=0.15)


def test_reference_targets_are_read_from_the_training_results():
    stats = reference_stats()
    assert np.asarray(stats["counts"]).shape == (12, 32)
    targets = reference_targets()
    assert len(targets["pairs"]) == 11 and 0.7 < np.mean(targets["fate_recall_at_k"]["prefill"]) < 0.95
    with pytest.raises(ValueError, match="workload must be one of"):
        design(preset(NAME), "zipf")
    for bad in ("always", 1.5, -0.1, None):
        with pytest.raises(ValueError, match="predictability must"):
            design(preset(NAME), "uniform", predictability=bad)


@pytest.mark.parametrize("name", ["tiny-deepseek-v2-lite", "tiny-qwen3-30b-a3b", "tiny-mixtral-8x7b",
                                  "tiny-moonlight-16b-a3b"])
def test_uniform_has_equal_shares_and_independent_layers(name):
    cfg = preset(name)
    workload = design(cfg, "uniform", seed=0)
    e = cfg.num_experts
    experts = workload.experts(np.arange(cfg.vocab_size))
    for m in range(len(experts)):  # the whole vocabulary, the population the benchmarks' prompts are drawn from
        assert np.abs(shares(experts[m], e) - 1.0 / e).max() < 0.2 / e
    # consecutive layers read disjoint parts of the code: on many fresh codes the affinity table lifts nothing
    codes = np.random.default_rng(3).standard_normal((200_000, workload.channel)).astype(np.float32)
    codes[:, -1] = 1.0
    k, layers = cfg.num_experts_per_tok, list(cfg.moe_layers)
    picks = [np.argpartition(-(codes @ workload.rows[i]), k - 1, axis=1)[:, :k] for i in layers]
    for cur, nxt in zip(picks, picks[1:]):
        assert abs(affinity_lift(cur, nxt, e)[2]) < 0.01


def test_uniform_routes_in_the_model_as_designed():
    cfg = preset("tiny-qwen3-30b-a3b")
    flat = random_state(models.abstract_state(cfg, jnp.float32), 0, lambda path: None)
    workload = design(cfg, "uniform", seed=0)
    ids = np.random.default_rng(1).integers(0, cfg.vocab_size, (4, 128)).astype(np.int32)
    experts = _routing(cfg, workload.apply(flat), ids)
    np.testing.assert_array_equal(experts, workload.experts(ids))
    assert workload.summary()["workload"] == "uniform" and workload.summary()["predictability"] == "reference"


@pytest.mark.parametrize("name", ["tiny-qwen3-30b-a3b", NAME])
def test_greedy_decode_walks_the_vocabulary_so_it_routes_as_prompts_do(name):
    """Random weights' greedy tokens may loop on a few ids (decode then routes few experts, and every cache hits);
    the workload's lm_head makes token t's greedy successor `successor[t]`, one cycle through the vocabulary, so
    decode's tokens never repeat within it and its routing has the designed shares."""
    cfg = preset(name)
    flat = random_state(models.abstract_state(cfg, jnp.float32), 0, lambda path: None)
    workload = design(cfg, "uniform", seed=0)
    model = Generator(models.from_flat(cfg, jnp.float32, workload.apply(flat)))
    ids = np.random.default_rng(3).integers(0, cfg.vocab_size, (4, 8)).astype(np.int32)
    new = 48
    tokens = np.asarray(model.generate(ids, new).tokens)  # [4, new]
    before = np.concatenate([ids[:, -1:], tokens[:, :-1]], axis=1)
    np.testing.assert_array_equal(tokens, workload.successor[before])  # float32: no near-ties
    assert all(np.unique(row).size == new for row in tokens)
    experts = workload.experts(tokens.reshape(-1))  # [M, N, K]
    e = cfg.num_experts
    for layer in experts:
        assert np.abs(shares(layer, e) - 1 / e).max() < 0.6 / e  # 192 tokens: equal shares within sampling noise
    assert workload.summary()["decode"].startswith("greedy tokens walk")


@pytest.mark.parametrize("workload_name", ["uniform", "skewed"])
@pytest.mark.parametrize("setting", [*PREDICTABILITY, 0.0])
def test_the_fate_style_predictor_in_the_model_has_the_calibrated_recall(setup, workload_name, setting):
    """The next layer's gate on this layer's MoE input, run in the model: exactly the designed guess, and its
    recall@k the setting's: oracle 1, reference the reference MoE's per pair within 2 points, 0 the popularity
    guess (chance for uniform, the skew's top-k for skewed)."""
    cfg, _, flat, _ = setup
    workload = design(cfg, workload_name, seed=0, predictability=setting)
    ids = np.arange(cfg.vocab_size, dtype=np.int32).reshape(4, -1)
    rewritten = workload.apply(flat)
    experts, fate = _routing(cfg, rewritten, ids), _fate(cfg, rewritten, ids)
    np.testing.assert_array_equal(fate, workload.fate_experts(ids))
    k, e = cfg.num_experts_per_tok, cfg.num_experts
    recalls = [_recall(fate[m], experts[m + 1], k) for m in range(len(fate))]
    pairs = workload.report[1:]
    assert recalls == pytest.approx([entry["fate_recall"] for entry in pairs], abs=1e-9)
    if setting == "oracle":
        assert recalls == [1.0] * len(recalls)
    elif setting == "reference":
        assert recalls == pytest.approx([entry["target_fate_recall"] for entry in pairs], abs=0.02)
    else:
        popular = [np.argsort(-shares(experts[m + 1], e))[:k] for m in range(len(fate))]
        chance = [_recall(np.tile(p, (experts.shape[1], 1)), experts[m + 1], k) for m, p in enumerate(popular)]
        assert recalls == pytest.approx(chance, abs=0.03)


@pytest.mark.parametrize("workload_name", ["uniform", "skewed"])
def test_offload_engine_matches_plain_model_on_workload_weights(setup, workload_name):
    cfg, shapes, flat, workload = setup
    workload = design(cfg, workload_name, seed=0) if workload_name == "uniform" else workload
    ids = np.random.default_rng(2).integers(0, cfg.vocab_size, (1, 24)).astype(np.int32)
    # the lm_head as drawn, so that the logits see every hidden dimension (the workload's reads the channel only)
    rewritten = {**workload.apply(flat), "lm_head.kernel": flat["lm_head.kernel"]}
    plain = Generator(models.from_flat(cfg, jnp.float32, rewritten))

    def loader(paths, placement):
        drawn = random_state({p: shapes[p] for p in paths}, 0, placement)
        return {p: v if p == "lm_head.kernel" else workload.transform(p, v) for p, v in drawn.items()}

    rc = RuntimeConfig(gpu_memory="1GB", expert_pool=6 * cfg.expert_bytes(4), policy="pdscope", max_seq_len=64)
    runner = OffloadRunner(models.abstract_model(cfg, jnp.float32), rc, loader)
    np.testing.assert_allclose(runner.logits(ids), plain.logits(ids), atol=1e-4, rtol=0)
    np.testing.assert_array_equal(runner.generate(ids, 4).tokens, plain.generate(ids, 4).tokens)


def test_the_reference_data_ships_inside_the_package():
    """An installed package (not a checkout) runs the skewed workload and the main job with PhasePer: both defaults
    lie under the package folder, which pyproject's package-data ("assets/**/*") ships."""
    import pdscope_jax
    from pdscope_jax.cli.run import REFERENCE_PREDICTORS
    from pdscope_jax.workloads.routing import REFERENCE_RESULTS

    package = Path(pdscope_jax.__file__).resolve().parent
    for path in (REFERENCE_RESULTS, REFERENCE_PREDICTORS / "manifest.json"):
        assert path.is_relative_to(package / "assets") and path.is_file()
    stats = reference_stats()
    assert len(stats["counts"]) == 12 and len(stats["counts"][0]) == 32  # the reference MoE: 12 MoE layers, 32 experts


@pytest.mark.parametrize("workload_name, setting", [("skewed", "reference"), ("uniform", 0.5)])
def test_a_cached_design_equals_a_fresh_one_and_a_corrupt_file_is_rebuilt(tmp_path, workload_name, setting):
    from pdscope_jax.workloads import cache

    cfg = preset(NAME)
    fresh = design(cfg, workload_name, seed=3, predictability=setting, cache=False)
    assert not list(tmp_path.iterdir())
    first = design(cfg, workload_name, seed=3, predictability=setting, cache=tmp_path)
    (path,) = tmp_path.iterdir()
    stamp = path.stat().st_mtime_ns
    cached = design(cfg, workload_name, seed=3, predictability=setting, cache=tmp_path)
    assert path.stat().st_mtime_ns == stamp  # read, not written again
    for got in (first, cached):
        np.testing.assert_array_equal(got.codes, fresh.codes)
        assert got.rows.keys() == fresh.rows.keys() and got.masks.keys() == fresh.masks.keys()
        for layer in fresh.rows:
            np.testing.assert_array_equal(got.rows[layer], fresh.rows[layer])
        for layer in fresh.masks:
            np.testing.assert_array_equal(got.masks[layer], fresh.masks[layer])
        assert got.summary() == fresh.summary() and got.cfg is cfg
    ids = np.arange(cfg.vocab_size)
    np.testing.assert_array_equal(cached.experts(ids), fresh.experts(ids))
    # every input of the fit is in the key: another seed or setting is another file
    design(cfg, workload_name, seed=4, predictability=setting, cache=tmp_path)
    design(cfg, workload_name, seed=3, predictability="oracle", cache=tmp_path)
    assert len(list(tmp_path.iterdir())) == 3
    for broken in (b"not a zip file", path.read_bytes()[: path.stat().st_size // 2]):
        path.write_bytes(broken)
        assert cache.load(path, cfg) is None
        rebuilt = design(cfg, workload_name, seed=3, predictability=setting, cache=tmp_path)
        np.testing.assert_array_equal(rebuilt.codes, fresh.codes)
        assert rebuilt.summary() == fresh.summary()
        assert cache.load(path, cfg) is not None  # written again, whole
    assert not [p for p in tmp_path.iterdir() if p.suffix != ".npz"]  # no temporary file left behind


def test_the_workload_cache_folder_follows_the_environment(tmp_path, monkeypatch):
    from pdscope_jax.workloads import cache

    monkeypatch.setenv(cache.ENV, "off")
    assert cache.cache_folder() is None and cache.cache_folder(tmp_path) == tmp_path
    monkeypatch.setenv(cache.ENV, str(tmp_path / "designs"))
    assert cache.cache_folder() == tmp_path / "designs" and cache.cache_folder(False) is None
    monkeypatch.delenv(cache.ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cache.cache_folder() == tmp_path / "pdscope_jax" / "workloads"
    design(preset(NAME), "uniform", seed=0)
    assert [p.suffix for p in (tmp_path / "pdscope_jax" / "workloads").iterdir()] == [".npz"]
