"""The next-layer prediction's recall, measured in the run (`PhaseStats.prediction_recall`): exact on the oracle
workload, the designed value on the reference one, None without a predictor or in device decode."""

import jax.numpy as jnp
import numpy as np
import pytest

from pdscope_jax import models
from pdscope_jax.engine.runner import OffloadRunner
from pdscope_jax.engine.stats import PhaseStats, prediction_hits
from pdscope_jax.presets import preset
from pdscope_jax.runtime import RuntimeConfig
from pdscope_jax.weights.random_init import random_state
from pdscope_jax.workloads.routing import design

NAME = "tiny-deepseek-v2-lite"


def _runner(setting, policy: str, device_decode: bool = False) -> tuple[OffloadRunner, object]:
    cfg = preset(NAME)
    shapes = models.abstract_state(cfg, jnp.float32)
    workload = design(cfg, "uniform", seed=0, predictability=setting)
    loader = workload.loader(lambda paths, placement: random_state({p: shapes[p] for p in paths}, 0, placement))
    rc = RuntimeConfig(gpu_memory="1GB", expert_pool=6 * cfg.expert_bytes(4), policy=policy, max_seq_len=64,
                       device_decode=device_decode)
    return OffloadRunner(models.abstract_model(cfg, jnp.float32), rc, loader), workload


def _every_token_alone(runner: OffloadRunner) -> float:
    """Prefill recall over one-token prompts of every vocabulary id: per-token recall@k over the population the
    workload was calibrated on."""
    runner.reset_stats()
    for token in range(runner.config.vocab_size):
        runner.generate(np.array([[token]], np.int32), 1)
    stats = runner.phase_stats["prefill"]
    assert stats.predicted_total == runner.config.vocab_size * (len(runner.config.moe_layers) - 1) * \
        runner.config.num_experts_per_tok
    return stats.prediction_recall


def test_prediction_hits_counts_the_top_k_of_the_scores_against_the_activated_set():
    assert prediction_hits(np.array([0.1, 0.5, 0.0, 0.4]), np.array([1, 3])) == (2, 2)
    assert prediction_hits(np.array([0.1, 0.5, 0.0, 0.4]), np.array([0, 3])) == (1, 2)
    assert prediction_hits(np.zeros(4), np.array([0])) == (1, 1)  # ties: the lower id first
    assert prediction_hits(np.zeros(4), np.array([], np.int64)) == (0, 0)
    assert PhaseStats().prediction_recall is None and PhaseStats().to_dict()["prediction_recall"] is None
    assert PhaseStats(predicted_hits=3, predicted_total=4).to_dict()["prediction_recall"] == 0.75


@pytest.mark.parametrize("policy", ["fate", "pdscope"])
def test_oracle_prediction_is_exact_in_both_phases(policy):
    runner, _ = _runner("oracle", policy)
    ids = np.random.default_rng(2).integers(0, runner.config.vocab_size, (1, 24)).astype(np.int32)
    runner.generate(ids, 8)
    prefill, decode = runner.phase_stats["prefill"], runner.phase_stats["decode"]
    assert decode.device_steps == 0 and decode.predicted_total == 7 * 2 * runner.config.num_experts_per_tok
    assert prefill.prediction_recall == 1.0 and decode.prediction_recall == 1.0
    assert _every_token_alone(runner) == 1.0


def test_reference_prediction_has_the_designed_recall():
    """One token per step: the pooled recall is the mean over layer pairs of the design's per-token recall@k
    on the vocabulary, which lies within the calibration's tolerance of the reference targets."""
    runner, workload = _runner("reference", "fate")
    pairs = workload.summary()["layers"][1:]
    measured = _every_token_alone(runner)
    assert measured == pytest.approx(np.mean([p["fate_recall"] for p in pairs]), abs=1e-9)
    assert measured == pytest.approx(np.mean([p["target_fate_recall"] for p in pairs]), abs=0.02)
    assert measured < 0.95  # not the oracle's


def test_no_predictor_or_device_decode_reports_none():
    ids = np.random.default_rng(2).integers(0, preset(NAME).vocab_size, (1, 16)).astype(np.int32)
    runner, _ = _runner("oracle", "greedy")
    runner.generate(ids, 4)
    assert runner.stats["prefill"]["prediction_recall"] is None and runner.stats["decode"]["prediction_recall"] is None
    assert runner.phase_stats["prefill"].predicted_total == 0
    runner, _ = _runner("oracle", "pdscope", device_decode=True)
    runner.generate(ids, 4)
    assert runner.phase_stats["decode"].device_steps == 3
    assert runner.stats["decode"]["prediction_recall"] is None and runner.phase_stats["decode"].predicted_total == 0
    assert runner.stats["prefill"]["prediction_recall"] == 1.0
