"""Precision as a planning decision (`sched.precision`): the rule's inputs, the copies every planner marks low,
AdaptSched planning with the cheaper transfer, `check_plan` on low copies, the cost table's precision axis (JSON
with and without it) and the quality checks."""

import dataclasses

import numpy as np
import pytest

from pdscope_jax.sched import AdaptSched, CostTable, CostTableError, LayerDemand, PlanError, check_plan, make_planner
from pdscope_jax.sched.precision import PrecisionRule, quality_problems, relative_peaks, rule_for

MIXED, INT4 = PrecisionRule("mixed", 1.0), PrecisionRule("int4")


def costs(cpu=10.0, t_io=0.1, ratio=0.25) -> CostTable:
    """t_cpu(t) = cpu * t; t_gpu(m experts) = 0.3 + 0.2 m; an int4 copy moves in `ratio` of a base one's time."""
    return CostTable(token_buckets=(1, 1000), cpu_expert_seconds=(cpu, 1000 * cpu), gpu_expert_seconds=(0.5, 0.5),
                     t_io=t_io, alpha=0.01, attn_prefill_seconds=(3.0, 3.0), attn_decode_seconds=(3.0, 3.0),
                     gpu_launch_seconds=0.3).with_precision("int4", bytes_ratio=ratio)


# Decode at batch 1 on 8 experts: experts 1-4 routed (relative weights 2.0, 1.2, 0.5, 0.3), none resident; the
# next layer's scores put 0.9, 0.15 and 0.1 on experts 5-7 (mean of the top 4 positive = 0.383: relative 2.35,
# 0.39, 0.26). Transfers are cheap against the CPU, so AdaptSched loads this layer's misses and prefetches the
# two hottest predicted (mode d keeps the next layer's CPU side the longer); fate prefetches all three.
TOKENS = [0, 1, 1, 1, 1, 0, 0, 0]
PEAKS = np.array([0, 2.0, 1.2, 0.5, 0.3, 0, 0, 0])
SCORES = np.array([0, 0, 0, 0, 0, 0.9, 0.15, 0.1])


def demand(rule, tokens=TOKENS, peaks=PEAKS, scores=SCORES, phase="decode", free_slots=20) -> LayerDemand:
    e = len(tokens)
    return LayerDemand(layer=0, phase=phase, tokens_per_expert=np.asarray(tokens), resident=np.zeros(e, bool),
                       next_layer=1, next_scores=scores, next_resident=np.zeros(e, bool), free_slots=free_slots,
                       total_slots=free_slots, precision=rule, peak_weight=None if rule is None else peaks)


def test_relative_peaks_are_each_experts_largest_weight_over_its_tokens_mean_pick():
    w = np.array([[0.6, 0.2, 0.1, 0.1], [0.4, 0.3, 0.2, 0.1]])  # each row's mean pick: 0.25
    ids = np.array([[0, 1, 2, 3], [1, 0, 4, 5]])
    np.testing.assert_allclose(relative_peaks(w, ids, 7), [2.4, 1.6, 0.4, 0.4, 0.8, 0.4, 0.0])


@pytest.mark.parametrize("policy", ["pdscope", "ondemand", "fate"])
def test_mixed_copies_the_light_experts_low_and_the_heavy_ones_at_the_stored_precision(policy):
    d = demand(MIXED)
    plan = make_planner(policy).plan(d, costs())
    check_plan(d, plan)
    assert set(plan.load_now) == {1, 2, 3, 4}
    assert set(plan.load_low) == {3, 4}  # relative weights 0.5 and 0.3 < 1; 2.0 and 1.2 load at the stored one
    if policy != "ondemand":  # ondemand prefetches nothing
        assert {5, 6} <= set(plan.prefetch) and set(plan.prefetch_low) == set(plan.prefetch) & {6, 7}


def test_int4_copies_everything_low_and_no_rule_copies_nothing_low():
    for rule, low in ((INT4, True), (None, False)):
        d = demand(rule)
        plan = AdaptSched().plan(d, costs())
        check_plan(d, plan)
        assert plan.load_now.size and plan.prefetch.size
        assert set(plan.load_low) == (set(plan.load_now) if low else set())
        assert set(plan.prefetch_low) == (set(plan.prefetch) if low else set())


def test_adaptsched_plans_with_the_cheaper_transfer_of_int4_copies():
    """Prefill, 7 misses of 1..20 tokens, cpu 1 s a token, a copy 2 s: at the stored precision AdaptSched keeps the
    lightest misses on the CPU; with every copy int4 (0.5 s) it loads more of them."""
    tokens, peaks = [0, 1, 2, 3, 5, 8, 13, 20], np.zeros(8)
    loads = {}
    for rule in (None, INT4):
        d = demand(rule, tokens, peaks, None, phase="prefill")
        plan = AdaptSched().plan(d, costs(cpu=1.0, t_io=2.0))
        check_plan(d, plan)
        loads[rule] = plan.load_now.size
    assert loads[INT4] > loads[None] > 0


@pytest.mark.parametrize("change, message", [
    (dict(load_low=np.array([5])), "load_low not in load_now"),
    (dict(stream_low=True), "stream_low without stream_next_layer"),
])
def test_check_plan_refuses_low_copies_that_are_not_a_subset(change, message):
    d = demand(MIXED)
    plan = AdaptSched().plan(d, costs())
    with pytest.raises(PlanError, match=message):
        check_plan(d, dataclasses.replace(plan, **change))


def test_check_plan_refuses_low_copies_the_quality_does_not_allow_and_int4_copies_left_high():
    d = demand(None)
    plan = AdaptSched().plan(d, costs())
    with pytest.raises(PlanError, match="the quality allows none"):
        check_plan(d, dataclasses.replace(plan, load_low=plan.load_now[:1]))
    d = demand(INT4)
    plan = AdaptSched().plan(d, costs())
    with pytest.raises(PlanError, match="quality 'int4' copies every expert low"):
        check_plan(d, dataclasses.replace(plan, prefetch_low=plan.prefetch[:0]))


def test_cost_table_round_trips_with_and_without_the_precision_axis(tmp_path):
    table = CostTable.analytic(expert_bytes=1e6, flops_per_token=1e6, pcie_GBps=25, cpu_GFLOPs=100, gpu_TFLOPs=100)
    assert "precisions" not in table.to_dict()  # an old table's JSON, unchanged
    assert CostTable.from_json(table.to_json()) == table
    with pytest.raises(CostTableError, match="no transfer time for 'int4'"):
        table.transfer_ratio("int4")
    scaled = table.with_precision("int4", bytes_ratio=0.25)
    assert scaled.transfer_ratio("int4") == pytest.approx(0.25)
    assert scaled.to_dict()["precisions"]["int4"]["source"] == "bytes"
    measured = table.with_precision("int4", t_io=1e-5, cpu_expert_seconds=table.cpu_expert_seconds)
    for t in (scaled, measured):
        t.save(tmp_path / "t.json")
        assert CostTable.load(tmp_path / "t.json") == t == CostTable.from_json(t.to_json())
    assert measured.with_precision("int4", bytes_ratio=9.0) is measured  # kept as measured


@pytest.mark.parametrize("entry, message", [({"t_io": -1.0}, "precisions.int4.t_io must be finite and > 0"),
                                            ({"t_io": 1.0, "cpu_expert_seconds": [1.0]}, "has 1 values for"),
                                            ({"t_io": 1.0, "bogus": 2}, "unknown keys")])
def test_a_malformed_precision_axis_is_refused(entry, message):
    d = CostTable.analytic(expert_bytes=1e6, flops_per_token=1e6, pcie_GBps=25, cpu_GFLOPs=100,
                           gpu_TFLOPs=100).to_dict()
    with pytest.raises(CostTableError, match=message):
        CostTable.from_dict({**d, "precisions": {"int4": entry}})


@pytest.mark.parametrize("quality, base, problem", [
    (None, None, None), ("int8", "int8", None), ("int4", "int4", None), ("mixed", None, None),
    ("mixed", "int8", None), ("int4", None, None),
    ("int8", None, "pass quantize='int8'"), ("int8", "int4", "stored in int4"),
    ("mixed", "int4", "stores every expert in int4 already"), ("int2", None, "'int2' is not known")])
def test_quality_problems_and_which_runs_load_low_copies(quality, base, problem):
    problems = quality_problems(quality, base)
    assert (problem is None and not problems) or (problem is not None and problem in problems[0])
    loads_low = quality in ("mixed", "int4") and base != "int4"
    assert (rule_for(quality, base) is not None) == (loads_low and problem is None)
