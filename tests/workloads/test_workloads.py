"""The skewed routing workload: exact designed routing in the real model, the intended popularity skew, and
parity of the offload engine on the rewritten weights."""

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
from pdscope_jax.workloads.routing import design, reference_stats, shares, top_quarter_share

NAME = "tiny-deepseek-v2-lite"


@pytest.fixture(scope="module")
def setup():
    cfg = preset(NAME)
    shapes = models.abstract_state(cfg, jnp.float32)
    flat = random_state(shapes, 0, lambda path: None)
    workload = design(cfg, "skewed", seed=0)
    return cfg, shapes, flat, workload


def _routing(cfg, flat, ids):
    model = models.from_flat(cfg, jnp.float32, flat)
    positions = jnp.broadcast_to(jnp.arange(ids.shape[1], dtype=jnp.int32), ids.shape)
    return np.sort(np.asarray(walk(model, jnp.asarray(ids), positions).experts), axis=-1)  # [M, N, K]


def test_model_routes_exactly_as_designed_with_the_intended_skew(setup):
    cfg, _, flat, workload = setup
    ids = np.random.default_rng(1).integers(0, cfg.vocab_size, (4, 128)).astype(np.int32)
    experts = _routing(cfg, workload.apply(flat), ids)
    np.testing.assert_array_equal(experts, workload.experts(ids))  # a function of the token id, as designed
    uniform = _routing(cfg, flat, ids)
    for m, entry in enumerate(workload.report):
        got = top_quarter_share(shares(experts[m], cfg.num_experts))
        # 512 tokens drawn from the 256-token vocabulary the design was fitted on
        assert got == pytest.approx(entry["target_top_quarter_share"], abs=0.06)
        assert got > top_quarter_share(shares(uniform[m], cfg.num_experts)) + 0.05
        assert entry["max_share_error"] < 0.01
    for entry in workload.report[1:]:  # inter-layer affinity: a lift over popularity near the reference's
        assert entry["lift"] == pytest.approx(entry["target_lift"], abs=0.15)


def test_reference_targets_are_read_from_the_training_results():
    stats = reference_stats()
    assert np.asarray(stats["counts"]).shape == (12, 32)
    assert design(preset(NAME), "uniform") is None
    with pytest.raises(ValueError, match="workload must be one of"):
        design(preset(NAME), "zipf")


def test_offload_engine_matches_plain_model_on_skewed_weights(setup):
    cfg, shapes, flat, workload = setup
    ids = np.random.default_rng(2).integers(0, cfg.vocab_size, (1, 24)).astype(np.int32)
    plain = Generator(models.from_flat(cfg, jnp.float32, workload.apply(flat)))
    loader = workload.loader(lambda paths, placement: random_state({p: shapes[p] for p in paths}, 0, placement))
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
