"""Phase-blind baselines: static never loads, ondemand loads every missing expert, greedy balances one layer,
fate prefetches the predicted top-k; hand-made cost tables, plus hypothesis properties."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdscope_jax.sched import CostTable, LayerDemand, check_plan, make_planner


def linear_costs(cpu=1.0, gpu=0.5, launch=0.3, t_io=2.0, alpha=1.0, attn=0.0):
    """t_cpu(t) = cpu * t for 1 <= t <= 1000; t_gpu(m experts) = launch + m * (gpu - launch)."""
    return CostTable(token_buckets=(1, 1000), cpu_expert_seconds=(cpu, 1000 * cpu), gpu_expert_seconds=(gpu, gpu),
                     t_io=t_io, alpha=alpha, attn_prefill_seconds=(attn, attn), attn_decode_seconds=(attn, attn),
                     gpu_launch_seconds=launch)


def demand(tokens, resident=(), phase="prefill", next_scores=None, next_resident=(), free_slots=100, next_layer=1):
    e = len(tokens)
    res = np.zeros(e, bool)
    res[list(resident)] = True
    nres = np.zeros(e, bool)
    nres[list(next_resident)] = True
    return LayerDemand(layer=0, phase=phase, tokens_per_expert=np.asarray(tokens), resident=res,
                       next_layer=next_layer, next_scores=None if next_scores is None else np.asarray(next_scores),
                       next_resident=nres if next_layer is not None else None, free_slots=free_slots,
                       total_slots=max(free_slots, e))


def test_gpu_policy_computes_everything_on_gpu():
    d = demand([3, 0, 1], resident=[0, 1, 2], free_slots=0)
    plan = make_planner("gpu").plan(d, linear_costs())
    check_plan(d, plan)
    np.testing.assert_array_equal(plan.gpu, [0, 2])
    assert plan.cpu.size == plan.load_now.size == plan.prefetch.size == 0


def test_static_hot_set_from_counts_and_default():
    planner = make_planner("static", hot_per_layer=2, activation_counts={3: [5, 9, 1, 9]})
    np.testing.assert_array_equal(planner.hot_experts(3), [1, 3])  # 9 and 9 (tie by id), not 5
    np.testing.assert_array_equal(planner.hot_experts(4), [0, 1])  # no counts for layer 4: the first ones
    with pytest.raises(ValueError, match="hot_per_layer"):
        make_planner("static", hot_per_layer=-1)


def test_static_runs_resident_on_gpu_rest_on_cpu():
    d = demand([4, 0, 7, 2], resident=[0, 1], phase="prefill", next_scores=[1, 1, 1, 1])
    plan = make_planner("static", hot_per_layer=2).plan(d, linear_costs())
    check_plan(d, plan)
    np.testing.assert_array_equal(plan.gpu, [0])
    np.testing.assert_array_equal(plan.cpu, [2, 3])
    assert plan.load_now.size == plan.prefetch.size == plan.unload.size == 0 and not plan.stream_next_layer


def test_ondemand_loads_all_missing_and_streams_in_prefill():
    d = demand([4, 0, 7, 2], resident=[0])
    plan = make_planner("ondemand").plan(d, linear_costs())
    check_plan(d, plan)
    np.testing.assert_array_equal(plan.load_now, [2, 3])  # hottest first: 7 tokens, then 2
    assert plan.cpu.size == 0 and plan.stream_next_layer
    decode = make_planner("ondemand").plan(demand([0, 1, 1, 0], phase="decode"), linear_costs())
    assert not decode.stream_next_layer
    last = make_planner("ondemand").plan(demand([1, 1], next_layer=None), linear_costs())
    assert not last.stream_next_layer


def test_ondemand_cut_to_slots_keeps_hottest():
    d = demand([4, 9, 7, 2], free_slots=2)
    plan = make_planner("ondemand").plan(d, linear_costs())
    check_plan(d, plan)
    np.testing.assert_array_equal(plan.load_now, [1, 2])
    np.testing.assert_array_equal(plan.cpu, [0, 3])


def test_greedy_hand_computed():
    # cpu 1 s/token, t_gpu(m) = 0.3 + 0.2 m, transfer alpha 1 + 2 s each. Missing, hottest first: 0 (10), 1 (6),
    # 2 (3), 3 (1). Load 1: GPU 1 + 2 + 0.5 = 3.5 < CPU 6 + 3 + 1 = 10, taken. Load 2: GPU 1 + 4 + 0.7 = 5.7
    # >= CPU 3 + 1 = 4, not taken. Prefetch: this layer's 2 hottest ids (0, 1), minus 1 resident next layer.
    d = demand([10, 6, 3, 1, 0], next_resident=[1])
    plan = make_planner("greedy").plan(d, linear_costs())
    check_plan(d, plan)
    np.testing.assert_array_equal(plan.load_now, [0])
    np.testing.assert_array_equal(plan.cpu, [1, 2, 3])
    np.testing.assert_array_equal(plan.prefetch, [0])


def test_fate_prefetches_predicted_top_k():
    # predicted top-2 (default: 2 experts active now) are 3 (0.9) and 0 (0.8); 3 is already resident there
    d = demand([0, 5, 0, 2], next_scores=[0.8, 0.1, 0.3, 0.9], next_resident=[3])
    plan = make_planner("fate").plan(d, linear_costs())
    check_plan(d, plan)
    np.testing.assert_array_equal(plan.load_now, [1, 3])
    np.testing.assert_array_equal(plan.prefetch, [0])
    plan3 = make_planner("fate", top_k=3).plan(d, linear_costs())
    np.testing.assert_array_equal(plan3.prefetch, [0, 2])
    no_room = demand([0, 5, 0, 2], next_scores=[0.8, 0.1, 0.3, 0.9], free_slots=2)
    assert make_planner("fate").plan(no_room, linear_costs()).prefetch.size == 0


@st.composite
def demands(draw):
    e = draw(st.integers(1, 24))
    tokens = draw(st.lists(st.integers(0, 300), min_size=e, max_size=e))
    resident = [i for i in range(e) if draw(st.booleans())]
    scores = draw(st.lists(st.floats(0, 1), min_size=e, max_size=e))
    return demand(tokens, resident=resident, phase=draw(st.sampled_from(["prefill", "decode"])),
                  next_scores=scores, free_slots=draw(st.integers(0, 2 * e)))


@st.composite
def cost_tables(draw):
    pos = st.floats(1e-6, 1e-2)
    gpu = draw(pos)
    return linear_costs(cpu=draw(pos), gpu=gpu, launch=gpu * draw(st.floats(0, 1)), t_io=draw(pos),
                        alpha=draw(st.floats(0, 1e-3)))


@settings(max_examples=100, deadline=None)
@given(d=demands(), c=cost_tables())
def test_static_never_loads(d, c):
    plan = make_planner("static", hot_per_layer=3).plan(d, c)
    check_plan(d, plan)
    assert plan.load_now.size == plan.prefetch.size == plan.unload.size == 0
    np.testing.assert_array_equal(plan.gpu, np.flatnonzero(d.activated & d.resident))


@settings(max_examples=100, deadline=None)
@given(d=demands(), c=cost_tables())
def test_ondemand_loads_every_missing_expert_that_fits(d, c):
    plan = make_planner("ondemand").plan(d, c)
    check_plan(d, plan)
    missing = np.flatnonzero(d.activated & ~d.resident)
    assert plan.load_now.size == min(missing.size, d.free_slots)
    if missing.size <= d.free_slots:
        assert plan.cpu.size == 0


@settings(max_examples=150, deadline=None)
@given(d=demands(), c=cost_tables())
def test_greedy_balance(d, c):
    """After m loads the GPU side still finishes strictly before the CPU side, and one more load (when slots
    allow) would not: GPU(m) = t_transfer(m) + t_gpu(resident + loaded), CPU(m) = t_cpu(the rest)."""
    plan = make_planner("greedy").plan(d, c)
    check_plan(d, plan)
    tok = d.tokens_per_expert
    hot_first = d.missing_cold_to_hot()[::-1]
    m = plan.load_now.size
    np.testing.assert_array_equal(plan.load_now, hot_first[:m])

    def sides(j):
        gpu = c.t_transfer(j) + c.t_gpu(np.concatenate((tok[d.activated & d.resident], tok[hot_first[:j]])))
        return gpu, c.t_cpu(tok[hot_first[j:]])

    eps = 1e-12  # the planner sums the same terms in another order
    if m:
        gpu, cpu = sides(m)
        assert gpu < cpu + eps
    if m < min(hot_first.size, d.free_slots):
        gpu, cpu = sides(m + 1)
        assert gpu > cpu - eps
    assert plan.prefetch.size <= 2
