import dataclasses

import jax
import numpy as np
import pytest

from pdscope_jax.phaseper.losses import expert_frequencies, loss_coefficients, targets
from pdscope_jax.phaseper.predictor import PredictorHParams, PredictorSet
from pdscope_jax.phaseper.traces import load_traces, write_synthetic_traces
from pdscope_jax.phaseper.train import (
    TrainConfig,
    adamw,
    evaluate_predictors,
    make_step_fns,
    recall_at_k,
    split_by_sequences,
    split_by_steps,
    table5_accuracy,
    table5_hits,
    train_predictors,
)

HP = PredictorHParams(dim=32, k=2, num_experts=8, proj_dim=16, hidden=32)
BASE = TrainConfig(batch_size=32, learning_rate=3e-3)  # one batch shape for every test: compiled once


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    path = tmp_path_factory.mktemp("traces") / "t"
    return load_traces(write_synthetic_traces(path, prefill_steps=(96,) * 6, decode_steps=96, seed=0))


@pytest.mark.parametrize("phase,layer", [("prefill", 0), ("decode", 0), ("prefill", 2)])
def test_training_steps_lower_the_loss(traces, phase, layer):
    pset = PredictorSet(HP, traces.layers, (1, 3), seed=0)
    full = traces.pairs(phase, layer)
    a, w, e, e_next = (x[:BASE.batch_size] for x in (full.a, full.w, full.e, full.e_next))
    tx = adamw(3e-3)
    train_step, logits_fn, loss_fn = make_step_fns(pset.graphdef(layer))
    coefs = loss_coefficients(phase, pset.group(layer), 1.0)
    y = targets(e_next, 8)
    freq = expert_frequencies(e_next, 8)
    state = pset.state(phase, layer)
    opt = tx.init(state)
    first = float(loss_fn(logits_fn(state, a, w, e), y, freq, 2.0, coefs))
    for _ in range(5):
        state, opt, loss = train_step(state, opt, a, w, e, y, freq, 2.0, coefs)
    last = float(loss_fn(logits_fn(state, a, w, e), y, freq, 2.0, coefs))
    assert last < first


def test_train_predictors_learns_and_reports(traces):
    pset, metrics = train_predictors(traces, (1, 3), HP, epochs=12, seed=0, config=BASE, progress=False)
    chance = 2 / 8
    for phase in ("prefill", "decode"):
        summary = metrics["phases"][phase]
        assert summary["recall_at_k"] > 2 * chance, summary
        assert 0 <= summary["table5"] <= 1
        for layer, m in summary["layers"].items():
            # a decode predictor starts from the trained prefill one, which may already be its best
            assert m["trained"] and (phase == "decode" or m["best_epoch"] >= 1)
            assert 0 <= m["best_epoch"] <= m["epochs_run"] <= 12
            assert m["n_train"] + m["n_val"] == len(traces.pairs(phase, layer))
    assert metrics["phases"]["prefill"]["layers"][1]["group"] == "middle"
    again = evaluate_predictors(pset, traces)
    assert again["phases"]["prefill"]["recall_at_k"] > 2 * chance


def test_early_stopping_when_validation_does_not_improve(traces):
    cfg = dataclasses.replace(BASE, learning_rate=0.0, weight_decay=0.0, patience=2)
    _, metrics = train_predictors(traces, (1, 3), HP, epochs=30, config=cfg, progress=False)
    for m in metrics["phases"]["prefill"]["layers"].values():
        assert m["epochs_run"] == 2 and m["best_epoch"] == 0


def test_split_by_steps_keeps_steps_whole():
    rng = np.random.default_rng(0)
    steps = np.array([3, 5, 2, 4])
    train_idx, val_idx, val_steps = split_by_steps(steps, 0.25, rng)
    assert sorted(np.concatenate([train_idx, val_idx]).tolist()) == list(range(14))
    starts = {0: 3, 3: 5, 8: 2, 10: 4}
    assert len(val_steps) == 1 and val_idx[0] in starts and starts[val_idx[0]] == val_steps[0]
    train_idx, val_idx, val_steps = split_by_steps(np.array([10]), 0.3, rng)
    assert list(val_idx) == [7, 8, 9] and list(val_steps) == [3]


def test_recall_at_k_by_hand():
    probs = np.array([[0.9, 0.8, 0.1, 0.0], [0.1, 0.2, 0.9, 0.8]])
    e_next = np.array([[0, 2], [2, 3]])
    assert recall_at_k(probs, e_next, 2) == pytest.approx((0.5 + 1.0) / 2)


def test_table5_by_hand():
    # one step of 4 tokens over 8 experts, top-2 each; true counts: e0=4, e1=3, e2=1, others 0
    e_next = np.array([[0, 1], [0, 1], [0, 1], [0, 2]])
    probs = np.zeros((4, 8))
    # predicted counts rank: e5 > e6 > e7 > e3 > e1 > e0 > e2 > e4
    probs[0] = [0.2, 0.3, 0.1, 0.4, 0.0, 0.7, 0.6, 0.5]
    # true ranks: e0 0, e1 1, e2 2 (m = 3 experts with tokens); predicted: e0 5, e1 4, e2 6
    # hits need |pred - true| <= 2: e0 |5-0| no, e1 |4-1| no, e2 |6-2| no
    assert table5_hits(probs, e_next, np.array([4]), 8) == (0, 3)
    probs[0] = [0.7, 0.6, 0.1, 0.5, 0.0, 0.4, 0.3, 0.2]
    # predicted ranks: e0 0, e1 1, e3 2, e5 3, e6 4, e7 5, e2 6, e4 7 -> e0, e1 hit; e2 (true 2, pred 6) misses
    assert table5_hits(probs, e_next, np.array([4]), 8) == (2, 3)


def test_table5_ties_and_steps():
    # two decode steps of one token (top-2): both true experts tie at rank interval [0, 1]
    e_next = np.array([[3, 5], [1, 2]])
    probs = np.zeros((2, 6))
    probs[0] = [0.6, 0.5, 0.4, 0.3, 0.2, 0.1]  # e3 pred rank 3 (<= 1 + 2: hit), e5 rank 5 (miss)
    probs[1] = [0.0, 0.9, 0.8, 0.0, 0.0, 0.0]  # e1, e2 ranks 0 and 1: hits
    assert table5_hits(probs, e_next, np.array([1, 1]), 6) == (3, 4)
    assert table5_accuracy(probs, e_next, np.array([1, 1]), 6) == pytest.approx(0.75)


def test_decode_validation_takes_whole_sequences():
    steps = np.full(6, 4)  # 6 decode steps of 4 sequences: token i of step s is row i % 4
    train_idx, val_idx, val_steps = split_by_sequences(steps, 0.25, np.random.default_rng(0))
    assert sorted(np.concatenate([train_idx, val_idx]).tolist()) == list(range(24))
    assert len({int(i) % 4 for i in val_idx}) == 1 and len(val_idx) == 6 and val_steps.tolist() == [1] * 6
    assert not {int(i) % 4 for i in val_idx} & {int(i) % 4 for i in train_idx}
    _, val_idx, _ = split_by_sequences(np.array([4, 4, 3]), 0.25, np.random.default_rng(0))  # uneven: whole steps
    assert len(val_idx) in (3, 4)


def test_decode_predictors_start_from_the_prefill_ones(traces):
    cfg = dataclasses.replace(BASE, decode_from_prefill=True)
    pset, _ = train_predictors(traces, (1, 3), HP, epochs=0, config=cfg, progress=False, phases=("prefill", "decode"))
    for layer in pset.source_layers:  # no epoch run: each decode predictor is its prefill predictor as trained
        assert all(np.array_equal(p, d) for p, d in zip(jax.tree.leaves(pset.state("prefill", layer)),
                                                          jax.tree.leaves(pset.state("decode", layer))))
    fresh, metrics = train_predictors(traces, (1, 3), HP, epochs=0, config=BASE, progress=False, phases=("prefill",))
    assert not metrics["phases"]["decode"]["layers"]  # a phase left out is not trained
    assert not all(np.array_equal(p, d) for p, d in zip(jax.tree.leaves(fresh.state("prefill", 0)),
                                                         jax.tree.leaves(fresh.state("decode", 0))))
