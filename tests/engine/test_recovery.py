"""A call that fails part-way (a program out of memory that had the slot pool donated to it) leaves the engine able to
run the next call, with the plain model's numbers (tiny float32 models on two CPU devices)."""

import jax
import numpy as np
import pytest

from pdscope_jax.engine import recovery
from test_offload_engine import TOL, Reference, _slots

SIMULATED = "RESOURCE_EXHAUSTED: out of memory (simulated)"


@pytest.fixture(scope="module")
def ds():
    return Reference("tiny-deepseek-v2-lite", batch=1, prompt=20, new=6)


def _failing(runner):
    """A program that, as a failed one given the pool's arrays, leaves them deleted and raises."""
    def fail(*args, **kwargs):
        for a in jax.tree.leaves(runner.pool.banks):
            a.delete()
        raise RuntimeError(SIMULATED)
    return fail


def _check_runs_as_plain(runner, ds):
    assert runner.pool.decode_slots == 0
    assert not any(a.is_deleted() for a in jax.tree.leaves(runner.pool.banks))
    np.testing.assert_array_equal(runner.generate(ds.ids, ds.new).tokens, ds.tokens)
    np.testing.assert_allclose(runner.logits(ds.ids), ds.logits, atol=TOL, rtol=0)


@pytest.mark.parametrize("call", ["generate", "logits"])
def test_a_slot_commit_failing_in_prefill_leaves_a_working_engine(ds, call):
    runner = ds.runner("ondemand", _slots(ds, "small"))
    store = runner.store
    programs = {"_commit": dict(store._commit), "_pull": dict(store._pull), "_commit_whole": store._commit_whole}
    for kind in (False, True):  # every program that writes slots: commits of staged copies, pull-and-commits
        store._commit[kind] = store._pull[kind] = _failing(runner)
    store._commit_whole = _failing(runner)
    with pytest.raises(RuntimeError, match="simulated"):  # the failure itself, not a deleted array after it
        runner.generate(ds.ids, ds.new) if call == "generate" else runner.logits(ds.ids)
    store.__dict__.update(programs)
    _check_runs_as_plain(runner, ds)


@pytest.mark.parametrize("policy", ["ondemand", "pdscope"])
def test_a_decode_program_failing_leaves_a_working_engine(ds, policy):
    runner = ds.runner(policy, _slots(ds, "double"))
    names = ("_decode_step", "_decode_chunk", "_decode_chunk_issued")
    programs = {name: getattr(runner, name) for name in names}
    for name in names:
        setattr(runner, name, _failing(runner))
    steps = runner.steps(ds.ids, ds.new)
    next(steps)  # prefill ran; decode's first program fails
    with pytest.raises(RuntimeError, match="simulated"):
        list(steps)
    for name, program in programs.items():
        setattr(runner, name, program)
    _check_runs_as_plain(runner, ds)


def test_after_failure_writes_the_policys_resident_experts_again(ds):
    runner = ds.runner("static", _slots(ds, "double"))
    resident = [runner.pool.resident(layer).copy() for layer in ds.cfg.moe_layers]
    assert sum(r.sum() for r in resident) > 0
    for a in jax.tree.leaves(runner.pool.banks):
        a.delete()
    assert recovery.after_failure(runner)
    assert all(np.array_equal(runner.pool.resident(layer), r) for layer, r in zip(ds.cfg.moe_layers, resident))
    _check_runs_as_plain(runner, ds)
    assert not recovery.after_failure(runner)  # nothing was lost this time
