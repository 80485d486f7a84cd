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
    """Trial timings fixed per executor, `device` / `host` seconds a step after a one-off second (the runs
    themselves still happen); -> (executor, tokens) of every run after the host's compiling one, in order."""
    runs, run = [], decode_trial.decode_seconds

    def fixed(engine, ids, tokens, cache_tokens, executor):
        run(engine, ids, tokens, cache_tokens, executor)
        runs.append((executor, tokens))
        return 1.0 + (device if issubclass(executor, decode.DeviceDecode) else host) * (tokens - 1)

    monkeypatch.setattr(decode_trial, "decode_seconds", fixed)
    return runs


def test_pdscope_times_both_executors_and_records_them(ds):
    runner = ds.runner("pdscope", _slots(ds, "double"))
    runner.warmup(1, ds.ids.shape[1], ds.new)
    trial = runner.stats["decode_trials"]["1"]
    assert set(trial["ms_per_step"]) == {"device", "host"} and trial["steps"] == ds.new - 2
    assert trial["compiled_while_timed"] == 0  # both executors' programs compiled before timing
    assert all(ms > 0 for ms in trial["ms_per_step"].values())
    assert trial["chosen"] == min(trial["ms_per_step"], key=trial["ms_per_step"].get)
    # the trial's runs leave nothing in the statistics
    assert runner.stats["decode"]["steps"] == 0 and runner.stats["prefill"]["steps"] == 0
    out = runner.generate(ds.ids, ds.new)
    np.testing.assert_array_equal(out.tokens, ds.tokens)
    device_steps = runner.stats["decode"]["device_steps"]
    assert device_steps == (ds.new - 1 if trial["chosen"] == "device" else 0)


def test_a_warm_up_with_a_trial_precompiles_routed_programs_once(ds, monkeypatch):
    runner = ds.runner("pdscope", _slots(ds, "double"))
    calls, precompile = [], runner.precompile_routed
    monkeypatch.setattr(runner, "precompile_routed", lambda: calls.append(1) or precompile())
    runner.warmup(1, ds.ids.shape[1], ds.new)
    assert "1" in runner.stats["decode_trials"] and len(calls) == 1
    assert runner.stats["decode_trials"]["1"]["compiled_while_timed"] == 0


@pytest.mark.parametrize("faster", ["device", "host"])
def test_decode_runs_the_executor_the_trial_found_faster(ds, monkeypatch, faster):
    runs = _timings(monkeypatch, device=1.0 if faster == "device" else 2.0, host=1.0 if faster == "host" else 2.0)
    runner = ds.runner("pdscope", _slots(ds, "double"))
    runner.warmup(1, ds.ids.shape[1], ds.new)
    two, longest = decode_trial.COMPILE_TOKENS, ds.new  # the steps the cache holds, the one-off cost cancelled
    stepwise = decode_trial.StepwiseDevice
    assert runs == [(decode.HostDecode, two), (stepwise, two), (stepwise, longest),
                    (decode.HostDecode, two), (decode.HostDecode, longest)]
    trial = runner.stats["decode_trials"]["1"]
    assert trial["chosen"] == faster and trial["ms_per_step"] == {"device": 1e3 * (1.0 if faster == "device" else 2.0),
                                                                   "host": 1e3 * (1.0 if faster == "host" else 2.0)}
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
    runs = _timings(monkeypatch, device=2.0, host=1.0)
    runner = ds.runner(policy, _slots(ds, "double"), **rc)
    runner.warmup(1, ds.ids.shape[1], ds.new)
    assert runs == [] and runner.stats["decode_trials"] == {}


def test_trial_steps_are_bounded_by_the_run_and_checked():
    with pytest.raises(RuntimeConfigError, match="decode_trial must be a non-negative integer"):
        RuntimeConfig(decode_trial=-1)
    assert RuntimeConfig(decode_trial=0).decode_trial == 0


def test_the_trial_fits_the_runs_cache(ds):
    runner = ds.runner("pdscope", _slots(ds, "double"))
    runner.warmup(1, ds.ids.shape[1], 2)  # one decode step: nothing to take a difference of
    assert runner.stats["decode_trials"] == {}
    runner.warmup(1, ds.ids.shape[1], 3)
    assert runner.stats["decode_trials"]["1"]["steps"] == 1


@pytest.mark.parametrize("faster", ["device", "host"])
def test_chunked_device_steps_are_tried_a_program_a_step_and_run_in_chunks(ds, monkeypatch, faster):
    """Where real runs chunk the device steps, the trial times them a program a step (no chunk program of a trial
    length), compiled before timing, and the run it chooses the device for still runs in chunks."""
    runs = _timings(monkeypatch, device=1.0 if faster == "device" else 2.0, host=1.0 if faster == "host" else 2.0)
    runner = ds.runner("pdscope", _slots(ds, "double"), decode_chunk=2)
    runner.warmup(1, ds.ids.shape[1], ds.new)
    stepwise, two = decode_trial.StepwiseDevice, decode_trial.COMPILE_TOKENS
    host = decode.HostDecode
    assert runs == [(host, two), (stepwise, two),  # compiling runs
                    (stepwise, two), (stepwise, ds.new), (host, two), (host, ds.new)]
    trial = runner.stats["decode_trials"]["1"]
    assert trial["chosen"] == faster and trial["compiled_while_timed"] == 0
    dispatched = []
    chunk, step = runner._decode_chunk, runner._decode_step
    monkeypatch.setattr(runner, "_decode_chunk", lambda n, *a: dispatched.append(n) or chunk(n, *a))
    monkeypatch.setattr(runner, "_decode_step", lambda *a: dispatched.append(1) or step(*a))
    out = runner.generate(ds.ids, ds.new)
    np.testing.assert_array_equal(out.tokens, ds.tokens)
    assert dispatched == ([2, 2, 1] if faster == "device" else [])
