"""sched.across.balance: per-accelerator plans of one layer evened out against the shared CPU under the cost table
(DeepSeek-V2-Lite's analytic figures: a copy 0.37 ms, a 1-token CPU expert 0.60 ms), every result a valid plan."""

import numpy as np

from pdscope_jax.sched import CostTable, LayerDemand, Plan, check_plan
from pdscope_jax.sched.across import balance, layer_time

COSTS = CostTable.analytic(expert_bytes=17.3e6, flops_per_token=6 * 2048 * 1408, pcie_GBps=50.0, cpu_GFLOPs=2000.0,
                           gpu_TFLOPs=400.0, cpu_mem_GBps=30.0)


def _demand(tokens, resident=(), free_slots=4):
    tokens = np.asarray(tokens)
    mask = np.zeros(tokens.size, bool)
    mask[list(resident)] = True
    return LayerDemand(layer=1, phase="decode", tokens_per_expert=tokens, resident=mask, next_layer=None,
                       next_scores=None, next_resident=None, free_slots=free_slots, total_slots=8)


def _plan(demand, load_now=(), cpu=()):
    load_now = np.asarray(load_now, np.int64)
    gpu = np.union1d(np.flatnonzero(demand.activated & demand.resident), load_now)
    return Plan(gpu=gpu, load_now=load_now, cpu=np.asarray(sorted(cpu), np.int64), prefetch=np.zeros(0, np.int64),
                unload=np.zeros(0, np.int64))


def _valid(demands, plans):
    for d, p in zip(demands, plans):
        check_plan(d, p)


def test_a_cpu_both_accelerators_lean_on_takes_less_and_the_links_load_the_rest():
    demands = [_demand([1, 1, 0, 0]), _demand([1, 1, 0, 0])]
    plans = [_plan(demands[0], cpu=(0, 1)), _plan(demands[1], cpu=(0, 1))]  # 4 CPU experts: 2.4 ms
    before = layer_time(demands, plans, COSTS)
    balanced, moves = balance(demands, plans, COSTS)
    _valid(demands, balanced)
    assert moves == 3 and layer_time(demands, balanced, COSTS) < 0.4 * before
    assert sum(p.cpu.size for p in balanced) == 1 and sorted(p.load_now.size for p in balanced) == [1, 2]


def test_the_busiest_link_hands_an_expert_to_an_idle_cpu():
    demands = [_demand([3, 1, 2, 4], free_slots=8), _demand([0, 0, 0, 0])]
    plans = [_plan(demands[0], load_now=(0, 1, 2, 3)), _plan(demands[1])]
    balanced, moves = balance(demands, plans, COSTS)
    _valid(demands, balanced)
    assert moves == 1 and balanced[0].cpu.tolist() == [1]  # the expert with the fewest tokens
    assert balanced[0].load_now.tolist() == [0, 2, 3] and balanced[1] is plans[1]
    assert layer_time(demands, balanced, COSTS) < layer_time(demands, plans, COSTS)


def test_plans_nothing_can_improve_are_kept():
    demands = [_demand([1, 1, 0, 0], resident=(0, 1)), _demand([0, 1, 1, 0], resident=(1, 2))]
    plans = [_plan(d) for d in demands]  # every activated expert resident: no copy, no CPU
    balanced, moves = balance(demands, plans, COSTS)
    assert moves == 0 and all(b is p for b, p in zip(balanced, plans))


def test_a_cpu_expert_is_loaded_only_into_a_slot_the_plan_leaves_free():
    demands = [_demand([1, 1, 0, 0], free_slots=0), _demand([1, 1, 0, 0], free_slots=1)]
    plans = [_plan(demands[0], cpu=(0, 1)), _plan(demands[1], cpu=(0, 1))]
    balanced, moves = balance(demands, plans, COSTS)
    _valid(demands, balanced)
    assert balanced[0] is plans[0]  # no free slot: its CPU experts stay
    assert moves == 1 and balanced[1].load_now.size == 1 and balanced[1].cpu.size == 1
