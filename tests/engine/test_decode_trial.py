"""The decode mode chosen by timing both executors at warm-up (engine.decode_trial): who runs a trial, what it
records, that decode then runs the executor it chose, and that either choice keeps the plain model's tokens."""

import numpy as np
import pytest

from pdscope_jax.engine import decode, decode_trial
from pdscope_jax.runtime import RuntimeConfig, RuntimeConfigError
from test_offload_engine import Reference, _slots


@pytest.fixture(scope="module")
def ds():
    return Reference("tiny-deepseek-v2-lite", batch=1, prompt=20, new=6)


def _timings(monkeypatch, device: float, host: float) -> list:
    """Trial timings fixed per executor (the runs themselves still happen); -> the executors timed, in order."""
    timed, run = [], decode_trial.decode_seconds

    def fixed(engine, ids, tokens, cache_tokens, executor):
        run(engine, ids, tokens, cache_tokens, executor)
        if tokens == decode_trial.COMPILE_TOKENS:
            return 0.0
        timed.append(executor)
        return (device if executor is decode.DeviceDecode else host) * (tokens - 1)

    monkeypatch.setattr(decode_trial, "decode_seconds", fixed)
    return timed


def test_pdscope_times_both_executors_and_records_them(ds):
    runner = ds.runner("pdscope", _slots(ds, "double"))
    runner.warmup(1, ds.ids.shape[1], ds.new)
    trial = runner.stats["decode_trials"]["1"]
    assert set(trial["ms_per_step"]) == {"device", "host"} and trial["steps"] == 4
    assert trial["compiled_while_timed"] == 0  # both executors' programs compiled before timing
    assert all(ms > 0 for ms in trial["ms_per_step"].values())
    assert trial["chosen"] == min(trial["ms_per_step"], key=trial["ms_per_step"].get)
    # the trial's runs leave nothing in the statistics
    assert runner.stats["decode"]["steps"] == 0 and runner.stats["prefill"]["steps"] == 0
    out = runner.generate(ds.ids, ds.new)
    np.testing.assert_array_equal(out.tokens, ds.tokens)
    device_steps = runner.stats["decode"]["device_steps"]
    assert device_steps == (ds.new - 1 if trial["chosen"] == "device" else 0)


@pytest.mark.parametrize("faster", ["device", "host"])
def test_decode_runs_the_executor_the_trial_found_faster(ds, monkeypatch, faster):
    timed = _timings(monkeypatch, device=1.0 if faster == "device" else 2.0, host=1.0 if faster == "host" else 2.0)
    runner = ds.runner("pdscope", _slots(ds, "double"))
    runner.warmup(1, ds.ids.shape[1], ds.new)
    assert timed == [decode.DeviceDecode, decode.HostDecode]
    assert runner.stats["decode_trials"]["1"]["chosen"] == faster
    assert decode.choose(runner, 1, ds.new - 1) is decode_trial.EXECUTORS[faster]
    out = runner.generate(ds.ids, ds.new)
    np.testing.assert_array_equal(out.tokens, ds.tokens)
    assert runner.stats["decode"]["device_steps"] == (ds.new - 1 if faster == "device" else 0)
    # another batch size was not tried: the one-program step, as without a trial
    assert decode.choose(runner, 2, ds.new - 1) is decode.DeviceDecode


def test_a_new_policy_or_engine_option_forgets_the_trial(ds, monkeypatch):
    _timings(monkeypatch, device=2.0, host=1.0)
    runner = ds.runner("pdscope", _slots(ds, "double"))
    runner.warmup(1, ds.ids.shape[1], ds.new)
    runner.set_policy("pdscope")  # the same planner and options: the trial stands
    assert "1" in runner.stats["decode_trials"]
    runner.set_policy("pdscope", decode_bank=False)
    assert runner.stats["decode_trials"] == {}
    assert decode.choose(runner, 1, ds.new - 1) is decode.DeviceDecode


@pytest.mark.parametrize("policy, rc", [("ondemand", {}), ("fate", {}), ("pdscope", {"decode_trial": 0}),
                                        ("pdscope", {"device_decode": False})])
def test_no_trial_for_baselines_when_off_or_when_one_executor_can_run(ds, monkeypatch, policy, rc):
    timed = _timings(monkeypatch, device=2.0, host=1.0)
    runner = ds.runner(policy, _slots(ds, "double"), **rc)
    runner.warmup(1, ds.ids.shape[1], ds.new)
    assert timed == [] and runner.stats["decode_trials"] == {}


def test_trial_steps_are_bounded_by_the_run_and_checked():
    with pytest.raises(RuntimeConfigError, match="decode_trial must be a non-negative integer"):
        RuntimeConfig(decode_trial=-1)
    assert RuntimeConfig(decode_trial=0).decode_trial == 0


def test_a_two_token_run_times_its_one_decode_step(ds):
    runner = ds.runner("pdscope", _slots(ds, "double"))
    runner.warmup(1, ds.ids.shape[1], 2)
    assert runner.stats["decode_trials"]["1"]["steps"] == 1
