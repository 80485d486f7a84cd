import time

import jax
import numpy as np
import pytest

from pdscope_jax.phaseper.finetune import ErrorWindow, OnlineFineTuner, _Recent, token_errors
from pdscope_jax.phaseper.predictor import PredictorHParams, PredictorSet

HP = PredictorHParams(dim=16, k=2, num_experts=8, proj_dim=8, hidden=16)
LAYERS, GROUPS = (0, 1, 2, 3, 4), (2, 4)  # layers 0, 1 input; 2, 3 middle


def _token(rng, error):
    """One decode token whose scores miss `error` (0, 0.5 or 1) of its true next-layer experts."""
    a = rng.normal(size=(1, HP.dim)).astype(np.float32)
    w = np.array([[0.6, 0.4]], np.float32)
    e = np.array([[0, 1]], np.int32)
    e_next = np.array([[2, 3]], np.int32)
    scores = np.zeros((1, HP.num_experts), np.float32)
    picks = {0.0: [2, 3], 0.5: [2, 5], 1.0: [5, 6]}[error]
    scores[0, picks] = 1.0
    return a, w, e, e_next, scores


def test_token_errors_by_hand():
    scores = np.array([[0.9, 0.8, 0.1, 0.0], [0.1, 0.2, 0.9, 0.8], [0.0, 0.1, 0.2, 0.9]])
    e_next = np.array([[0, 2], [2, 3], [0, 1]])
    np.testing.assert_allclose(token_errors(scores, e_next), [0.5, 0.0, 1.0])


def _trigger_points(window, stream):
    return [i for i, err in enumerate(stream) if window.push([err])]


def test_window_needs_sixteen_tokens():
    assert _trigger_points(ErrorWindow(16, 0.25), [1.0] * 15) == []
    assert _trigger_points(ErrorWindow(16, 0.25), [1.0] * 40) == [15, 31]  # emptied after each trigger


def test_window_threshold_is_strict_and_slides():
    assert _trigger_points(ErrorWindow(16, 0.25), [0.25] * 100) == []
    # 16 clean tokens, then misses: mean 4/16 = 0.25 does not trigger, 5/16 does (the 21st token, index 20)
    assert _trigger_points(ErrorWindow(16, 0.25), [0.0] * 16 + [1.0] * 5) == [20]
    # alternating 0 / 0.5 averages exactly 0.25; one more miss tips it over
    assert _trigger_points(ErrorWindow(16, 0.25), [0.0, 0.5] * 8 + [1.0]) == [16]


def test_window_batch_push_equals_token_by_token():
    stream = np.random.default_rng(0).choice([0.0, 0.5, 1.0], size=200, p=[0.7, 0.2, 0.1])
    one_by_one = ErrorWindow()
    n_single = len(_trigger_points(one_by_one, stream))
    batched = ErrorWindow()
    n_batched = sum(batched.push(stream[i:i + 7]) for i in range(0, 200, 7))
    assert n_single == n_batched > 0 and one_by_one.mean() == batched.mean()


def test_recent_buffer_keeps_last_tokens():
    buf = _Recent(4, dim=2, k=1)
    for i in range(6):
        buf.add(np.full((1, 2), i), np.ones((1, 1)), np.full((1, 1), i), np.full((1, 1), i))
    assert buf.fill == 4 and sorted(buf.e[:, 0]) == [2, 3, 4, 5]
    buf.add(np.arange(20).reshape(10, 2), np.ones((10, 1)), np.arange(10)[:, None], np.arange(10)[:, None])
    assert sorted(buf.e[:, 0]) == [6, 7, 8, 9]
    small = _Recent(5, dim=1, k=1)
    small.add(np.zeros((2, 1)), np.ones((2, 1)), np.array([[1], [2]]), np.array([[1], [2]]))
    assert small.tiled()[2][:, 0].tolist() == [1, 2, 1, 2, 1]


def test_trigger_counting_through_observe():
    rng = np.random.default_rng(0)
    pset = PredictorSet(HP, LAYERS, GROUPS, seed=0)
    with OnlineFineTuner(pset, steps=1) as tuner:
        for _ in range(40):
            assert not tuner.observe("decode", 2, *_token(rng, 1.0))  # middle layer: not tracked
        assert tuner.counters().triggers == 0 and tuner.window_error("decode") == 0.0
        stream = [0.0] * 16 + [1.0] * 5 + [0.5] * 10
        fired = [i for i, err in enumerate(stream) if tuner.observe("decode", i % 2, *_token(rng, err))]
        assert fired == [20]
        assert tuner.window_error("prefill") == 0.0  # phases are tracked apart
        tuner.wait_idle(timeout=120)
        c = tuner.counters()
    assert c.triggers == 1 and c.finetunes == 1 and c.tracked_tokens == 31 and c.observe_calls == 71


def test_observe_never_waits_for_training():
    rng = np.random.default_rng(1)
    pset = PredictorSet(HP, LAYERS, GROUPS, seed=0)
    before = {key: pset.state(*key) for key in pset.keys()}
    with OnlineFineTuner(pset, steps=300, learning_rate=1e-2) as tuner:
        for i in range(15):
            assert not tuner.observe("decode", 0, *_token(rng, 1.0))
            tuner.observe("decode", 2, *_token(rng, 1.0))  # buffers data for a middle layer too
        t0 = time.perf_counter()
        assert tuner.observe("decode", 0, *_token(rng, 1.0))
        trigger_call = time.perf_counter() - t0
        assert tuner.busy and tuner.counters().finetunes == 0  # returned while training is under way
        for _ in range(16):  # a second trigger while the job is pending is coalesced into it
            tuner.observe("decode", 0, *_token(rng, 1.0))
        tuner.wait_idle(timeout=120)
        c = tuner.counters()
    assert c.triggers == 2 and c.finetunes == 1
    assert trigger_call < c.finetune_seconds / 10 and c.observe_seconds_max < c.finetune_seconds / 10
    for key in [("decode", 0), ("decode", 2)]:
        loss_before, loss_after = tuner.last_losses[key]
        assert loss_after < loss_before
        assert not all(jax.tree.leaves(jax.tree.map(np.array_equal, before[key], pset.state(*key))))
    for key in [("prefill", 0), ("decode", 1)]:  # untouched: other phase, and a layer with no data
        assert all(jax.tree.leaves(jax.tree.map(np.array_equal, before[key], pset.state(*key))))


def test_worker_errors_surface():
    rng = np.random.default_rng(2)
    pset = PredictorSet(HP, LAYERS, GROUPS, seed=0)
    tuner = OnlineFineTuner(pset, steps=1)
    a, w, e, e_next, scores = _token(rng, 1.0)
    for _ in range(16):
        tuner.observe("decode", 0, a[:, :3], w, e, e_next, scores)  # wrong width: training fails
    with pytest.raises(RuntimeError, match="online fine-tuning failed"):
        tuner.wait_idle(timeout=120)
    tuner.close()
