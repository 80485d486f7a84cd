"""Planner contracts: CostTable arithmetic and JSON, LayerDemand validation, check_plan, and every registered
planner's plans passing check_plan on random demands."""

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdscope_jax.sched import (COMPARED, PLAIN, POLICIES, CostTable, CostTableError, LayerDemand, ObservingPlanner,
                               Plan, Planner,
                               PlanError, check_plan, make_planner)


def linear_costs(cpu=1.0, gpu=0.5, launch=0.3, t_io=2.0, alpha=1.0, attn=3.0):
    """t_cpu(t) = cpu * t for 1 <= t <= 1000; t_gpu(m experts) = launch + m * (gpu - launch)."""
    return CostTable(token_buckets=(1, 1000), cpu_expert_seconds=(cpu, 1000 * cpu), gpu_expert_seconds=(gpu, gpu),
                     t_io=t_io, alpha=alpha, attn_prefill_seconds=(attn, attn), attn_decode_seconds=(attn, attn),
                     gpu_launch_seconds=launch)


def demand(tokens, resident=(), phase="prefill", next_scores=None, next_resident=(), free_slots=100,
           total_slots=100, next_layer=1):
    e = len(tokens)
    res = np.zeros(e, bool)
    res[list(resident)] = True
    nres = None
    if next_layer is not None:
        nres = np.zeros(e, bool)
        nres[list(next_resident)] = True
    return LayerDemand(layer=0, phase=phase, tokens_per_expert=np.asarray(tokens), resident=res,
                       next_layer=next_layer, next_scores=None if next_scores is None else np.asarray(next_scores),
                       next_resident=nres, free_slots=free_slots, total_slots=total_slots)


# ---- CostTable -------------------------------------------------------------------------------------------


def test_cpu_interpolation_regimes():
    c = CostTable(token_buckets=(8, 16, 32), cpu_expert_seconds=(1.0, 2.0, 6.0), gpu_expert_seconds=(1, 1, 1),
                  t_io=1.0, alpha=0.0, attn_prefill_seconds=(0, 0, 0), attn_decode_seconds=(0, 0, 0))
    assert c.t_cpu(0) == 0.0
    assert c.t_cpu(3) == pytest.approx(1.0)     # below the first bucket: the first bucket's time
    assert c.t_cpu(12) == pytest.approx(1.5)    # halfway between 8 (1.0) and 16 (2.0)
    assert c.t_cpu(24) == pytest.approx(4.0)    # halfway between 16 (2.0) and 32 (6.0)
    assert c.t_cpu(64) == pytest.approx(12.0)   # past the last bucket: 6.0 * 64 / 32
    assert c.t_cpu([3, 12, 0, 64]) == pytest.approx(1.0 + 1.5 + 0.0 + 12.0)  # a list: summed


def test_gpu_batch_pays_launch_once():
    c = linear_costs(gpu=0.5, launch=0.3)
    assert c.t_gpu(7) == pytest.approx(0.5)            # one expert alone: its measured time
    assert c.t_gpu([7, 9, 11]) == pytest.approx(0.3 + 3 * 0.2)  # launch once + 3 marginals of 0.5 - 0.3
    assert c.t_gpu([7, 9, 11]) < 3 * c.t_gpu(7)
    assert c.t_gpu([]) == 0.0 and c.t_gpu([0, 0]) == 0.0
    # growing batches: base of 2 experts, then add 3: 0.7, 0.9, 1.1, 1.3
    growth = c.gpu_growing(c.gpu_marginals([5, 5]), c.gpu_marginals([1, 2, 3]))
    np.testing.assert_allclose(growth, [0.7, 0.9, 1.1, 1.3])
    np.testing.assert_allclose(c.gpu_growing((), c.gpu_marginals([1, 2])), [0.0, 0.5, 0.7])


def test_transfer_derived_and_measured():
    c = linear_costs(t_io=2.0, alpha=1.0)
    assert c.t_transfer(0) == 0.0
    assert c.t_transfer(3) == pytest.approx(7.0)  # alpha + 3 * t_io
    np.testing.assert_allclose(c.t_transfer(np.array([0, 1, 2])), [0.0, 3.0, 5.0])
    m = CostTable(token_buckets=(1,), cpu_expert_seconds=(1,), gpu_expert_seconds=(1,), t_io=0.5, alpha=1.0,
                  attn_prefill_seconds=(0,), attn_decode_seconds=(0,), transfer_counts=(2, 4),
                  transfer_seconds=(2.0, 3.0))
    assert m.t_transfer(1) == pytest.approx(1.5)  # between (0, alpha = 1.0) and (2, 2.0)
    assert m.t_transfer(3) == pytest.approx(2.5)  # between (2, 2.0) and (4, 3.0)
    assert m.t_transfer(6) == pytest.approx(4.0)  # past the curve: 3.0 + 2 * t_io


def test_attention_per_phase():
    c = CostTable(token_buckets=(1, 100), cpu_expert_seconds=(1, 1), gpu_expert_seconds=(1, 1), t_io=1, alpha=0,
                  attn_prefill_seconds=(1.0, 10.0), attn_decode_seconds=(0.5, 0.5))
    assert c.t_attn("prefill", 100) == pytest.approx(10.0)
    assert c.t_attn("decode", 1) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="phase"):
        c.t_attn("train", 1)


def test_analytic_roofline_and_label():
    # DeepSeek-V2-Lite expert: 17.3 MB, 6 * 2048 * 1408 FLOPs per token
    c = CostTable.analytic(expert_bytes=17.3e6, flops_per_token=6 * 2048 * 1408, pcie_GBps=27.0, cpu_GFLOPs=2000.0,
                           gpu_TFLOPs=500.0, cpu_floor_seconds=0.0, gpu_launch_seconds=80e-6)
    assert c.source == "analytic"
    assert c.t_io == pytest.approx(17.3e6 / 27e9)
    # 1 token: memory-bound on CPU (17.3 MB at 100 GB/s = 173 us); 4096 tokens: compute-bound (70.9 GFLOP / 2 TF)
    assert c.t_cpu(1) == pytest.approx(173e-6)
    assert c.t_cpu(4096) == pytest.approx(4096 * 6 * 2048 * 1408 / 2e12)
    assert c.t_gpu(1) == pytest.approx(80e-6 + 17.3e6 / 3000e9)
    assert json.loads(c.to_json())["source"] == "analytic"


def test_json_round_trip(tmp_path):
    c = CostTable(token_buckets=(1, 16), cpu_expert_seconds=(1e-4, 2e-4), gpu_expert_seconds=(1e-4, 1.2e-4), t_io=6e-4,
                  alpha=2e-5, attn_prefill_seconds=(1e-4, 3e-4), attn_decode_seconds=(1e-4, 1e-4),
                  gpu_launch_seconds=7.8e-5, transfer_counts=(1, 16), transfer_seconds=(6e-4, 6e-3), model="tiny",
                  meta={"command": "pdscope-jax profile"})
    again = CostTable.from_json(c.to_json())
    assert again == c
    c.save(tmp_path / "costs.json")
    assert CostTable.load(tmp_path / "costs.json") == c
    assert json.loads(c.to_json())["version"] == 1


def test_malformed_json_lists_every_problem(tmp_path):
    good = json.loads(linear_costs().to_json())
    bad = dict(good, version=7, extra=1)
    del bad["t_io"]
    with pytest.raises(CostTableError) as err:
        CostTable.from_json(json.dumps(bad))
    for fragment in ("missing key 't_io'", "unknown key 'extra'", "version 7"):
        assert fragment in str(err.value)
    with pytest.raises(CostTableError, match="5 values for 2 token buckets"):
        CostTable.from_json(json.dumps(dict(good, cpu_expert_seconds=[1, 2, 3, 4, 5])))
    with pytest.raises(CostTableError, match="attn_seconds"):
        CostTable.from_json(json.dumps(dict(good, attn_seconds={"prefill": [1, 1]})))
    with pytest.raises(CostTableError, match="not valid JSON"):
        CostTable.from_json("{")
    with pytest.raises(CostTableError, match="malformed"):
        CostTable.from_json(json.dumps(dict(good, t_io="fast")))
    (tmp_path / "bad.json").write_text("[]")
    with pytest.raises(CostTableError, match="bad.json"):
        CostTable.load(tmp_path / "bad.json")


def test_invalid_values_rejected():
    with pytest.raises(CostTableError, match="strictly increasing"):
        CostTable(token_buckets=(4, 2), cpu_expert_seconds=(1, 1), gpu_expert_seconds=(1, 1), t_io=1,
                  alpha=0, attn_prefill_seconds=(0, 0), attn_decode_seconds=(0, 0))
    with pytest.raises(CostTableError, match="t_io"):
        linear_costs(t_io=0.0)
    with pytest.raises(CostTableError, match="launch"):
        linear_costs(gpu=0.5, launch=0.6)


# ---- LayerDemand / Plan / check_plan ----------------------------------------------------------------------


def test_layer_demand_validation():
    with pytest.raises(ValueError, match="phase"):
        demand([1, 0], phase="train")
    with pytest.raises(ValueError, match="resident has shape"):
        LayerDemand(0, "decode", np.array([1, 0]), np.zeros(3, bool), None, None, None, 1, 2)
    with pytest.raises(ValueError, match="free_slots"):
        demand([1, 0], free_slots=3, total_slots=2)
    with pytest.raises(ValueError, match="next_layer is None"):
        LayerDemand(0, "decode", np.array([1, 0]), np.zeros(2, bool), None, np.ones(2), None, 1, 2)


def test_step_tokens_and_missing_order():
    d = demand([3, 0, 1, 3, 2], resident=[4])
    assert d.step_tokens == 3  # no num_tokens: the lower bound max(tokens_per_expert)
    np.testing.assert_array_equal(d.missing_cold_to_hot(), [2, 0, 3])  # 1, 3, 3 tokens; tie 0 < 3 by id
    assert LayerDemand(0, "prefill", np.array([3, 1]), np.zeros(2, bool), None, None, None, 0, 0,
                       num_tokens=2).step_tokens == 2


def test_plan_from_loads_and_check():
    d = demand([5, 0, 2, 7], resident=[0, 1], free_slots=1)
    p = Plan.from_loads(d, load_now=[3], unload=[1])
    np.testing.assert_array_equal(p.gpu, [0, 3])
    np.testing.assert_array_equal(p.cpu, [2])
    check_plan(d, p)


@pytest.mark.parametrize("field, value, message", [
    ("cpu", [2, 3], "activated experts computed nowhere|both gpu and cpu"),
    ("cpu", [1, 2], "non-activated experts computed"),
    ("gpu", [0], "activated experts computed nowhere"),
    ("load_now", [0, 3], "load_now holds resident"),
    ("load_now", [2], "load_now not in gpu"),
    ("gpu", [0, 2, 3], "neither resident nor loaded"),
    ("unload", [2], "unload holds non-resident"),
    ("prefetch", [0, 1], "needs 3 slots"),
    ("prefetch", [3], "already resident"),
    ("cpu", [2, 2], "repeats ids"),
    ("prefetch", [9], "outside"),
])
def test_check_plan_catches(field, value, message):
    d = demand([5, 0, 2, 7], resident=[0, 1], next_resident=[3], free_slots=1)
    good = Plan.from_loads(d, load_now=[3])
    check_plan(d, good)
    bad = Plan(**{**good.__dict__, field: np.asarray(value, dtype=np.int64)})
    with pytest.raises(PlanError, match=message):
        check_plan(d, bad)


def test_check_plan_last_layer_and_stream():
    d = demand([1, 1], next_layer=None, phase="decode")
    with pytest.raises(PlanError, match="last MoE layer"):
        check_plan(d, Plan.from_loads(d, load_now=[1, 0], prefetch=[0]))
    with pytest.raises(PlanError, match="stream_next_layer"):
        check_plan(d, Plan.from_loads(d, load_now=[1, 0], stream_next_layer=True))


def test_unloaded_slots_count_only_when_not_computed():
    # expert 1 (resident, idle) unloaded frees a slot for the load; expert 0 (resident, computed now) does not
    d = demand([4, 0, 3], resident=[0, 1], free_slots=0)
    check_plan(d, Plan.from_loads(d, load_now=[2], unload=[1]))
    with pytest.raises(PlanError, match="needs 1 slots"):
        check_plan(d, Plan.from_loads(d, load_now=[2], unload=[0]))


# ---- registry and every planner against check_plan --------------------------------------------------------


def test_registry():
    assert set(POLICIES) == {"gpu", "static", "ondemand", "greedy", "pdscope", "fate"}
    for name in POLICIES:
        planner = make_planner(name)
        assert planner.name == name and isinstance(planner, Planner)
    assert isinstance(make_planner("pdscope"), ObservingPlanner)
    assert not isinstance(make_planner("ondemand"), ObservingPlanner)
    assert make_planner("greedy", prefetch_depth=5).prefetch_depth == 5
    with pytest.raises(ValueError, match="unknown policy 'lru'.*pdscope"):
        make_planner("lru")
    with pytest.raises(TypeError, match="policy 'fate'"):
        make_planner("fate", depth=3)


def test_capabilities_say_what_the_engine_provides():
    """The engine reads capabilities, not names: each declares what it needs, and the defaults are off."""
    assert {n for n, p in POLICIES.items() if p.planner.reads_next_scores} == {"fate", "pdscope"}
    assert {n for n, p in POLICIES.items() if p.planner.predictor_scores} == {"pdscope"}
    assert {n for n, p in POLICIES.items() if p.planner.keeps_all_resident} == {"gpu"}
    assert {n for n, p in POLICIES.items() if p.planner.decodes_on_device} == {"gpu", "ondemand", "pdscope",
                                                                                "static"}
    assert {n for n, p in POLICIES.items() if p.planner.decode_host_experts} == {"pdscope", "static"}
    assert {n for n, p in POLICIES.items() if not p.planner.decode_copies} == {"static"}
    assert set(COMPARED) == set(POLICIES) - {"gpu"} and PLAIN not in POLICIES
    # hot tables: static always holds the whole pool; greedy and pdscope only with counts given
    assert POLICIES["static"].planner.hot_slots(100, 8, True, False) == 100
    assert POLICIES["greedy"].planner.hot_slots(100, 8, True, False) is None
    assert POLICIES["greedy"].planner.hot_slots(100, 8, True, True) == 25
    assert POLICIES["pdscope"].planner.hot_slots(100, 8, True, True) == 84  # less two whole layers of 8
    assert POLICIES["pdscope"].planner.hot_slots(100, 8, False, True) == 25
    assert POLICIES["ondemand"].planner.hot_slots(100, 8, True, True) is None
    assert all(p.description for p in POLICIES.values())


@st.composite
def demands(draw):
    e = draw(st.integers(1, 24))
    tokens = np.array(draw(st.lists(st.integers(0, 300), min_size=e, max_size=e)))
    resident = np.array(draw(st.lists(st.booleans(), min_size=e, max_size=e)))
    last = draw(st.booleans())
    scores = None if last or draw(st.booleans()) else np.array(
        draw(st.lists(st.floats(0, 1), min_size=e, max_size=e)))
    next_resident = None if last else np.array(draw(st.lists(st.booleans(), min_size=e, max_size=e)))
    total = draw(st.integers(0, 2 * e))
    return LayerDemand(layer=draw(st.integers(0, 30)), phase=draw(st.sampled_from(["prefill", "decode"])),
                       tokens_per_expert=tokens, resident=resident, next_layer=None if last else 1,
                       next_scores=scores, next_resident=next_resident, free_slots=draw(st.integers(0, total)),
                       total_slots=total)


@st.composite
def cost_tables(draw):
    pos = st.floats(1e-6, 1e-2)
    gpu = draw(pos)
    return linear_costs(cpu=draw(pos), gpu=gpu, launch=gpu * draw(st.floats(0, 1)), t_io=draw(pos),
                        alpha=draw(st.floats(0, 1e-3)), attn=draw(st.floats(0, 1e-2)))


@settings(max_examples=150, deadline=None)
@given(d=demands(), c=cost_tables(), name=st.sampled_from(sorted(POLICIES)))
def test_every_planner_plan_is_valid(d, c, name):
    if name == "gpu":  # the gpu policy relies on the engine keeping every expert resident
        d = LayerDemand(**{**d.__dict__, "resident": np.ones(d.num_experts, bool), "free_slots": 0,
                           "total_slots": d.num_experts})
    planner = make_planner(name, hot_per_layer=2) if name == "static" else make_planner(name)
    plan = planner.plan(d, c)
    check_plan(d, plan)
    act = d.activated
    assert plan.gpu.size + plan.cpu.size == np.count_nonzero(act)
