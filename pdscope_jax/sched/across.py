"""AdaptSched across accelerators: one MoE layer's per-accelerator plans, evened out against the one host CPU.

Contract: `balance(demands, plans, costs) -> (plans, moves)`, one demand and plan per accelerator (each in its own
expert numbering) and the cost table they share (a link per accelerator, one CPU for all). The layer's modeled
time is `layer_time`: max over accelerators of link + GPU (the transfer of its `load_now`, its batched GPU experts),
and the CPU, the sum of every accelerator's CPU experts (they queue on the one CPU). Greedy moves, each kept only
where it lowers that time:
- the slowest accelerator's loaded expert with the fewest tokens is computed by the CPU instead (one copy fewer
  on its link);
- while the CPU is the slowest, the CPU expert with the most tokens is loaded by its accelerator instead, where
  that accelerator has a slot its plan leaves free (`LayerDemand.free_slots` less its loads and prefetches; none
  while it streams the next layer).
Every move keeps `check_plan`'s invariants (the expert stays computed exactly once; loads at the stored precision);
prefetches, streams and unloads stay as planned. `moves` counts the moves made. Each accelerator's planner plans
as if the CPU were its own; this pass is what sees them all.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from pdscope_jax.sched.costs import CostTable
from pdscope_jax.sched.plan import LayerDemand, Plan

EPSILON = 1e-9  # seconds: a move must gain more than rounding


def layer_time(demands: list[LayerDemand], plans: list[Plan], costs: CostTable) -> float:
    return max(max(_device_time(d, p, costs) for d, p in zip(demands, plans)), _cpu_time(demands, plans, costs))


def balance(demands: list[LayerDemand], plans: list[Plan], costs: CostTable) -> tuple[list[Plan], int]:
    plans = list(plans)
    spare = [_spare_slots(d, p) for d, p in zip(demands, plans)]
    moves = 0
    for _ in range(sum(int(d.activated.sum()) for d in demands)):  # each move settles one expert for good
        best = layer_time(demands, plans, costs)
        moved = _to_cpu(demands, plans, costs, best) or _to_gpu(demands, plans, costs, best, spare)
        if moved is None:
            break
        k, plan = moved
        spare[k] -= plan.load_now.size - plans[k].load_now.size
        plans[k] = plan
        moves += 1
    return plans, moves


def _to_cpu(demands, plans, costs, best):
    """The slowest accelerator's loaded expert with the fewest tokens moved to the CPU, if that lowers the time."""
    k = int(np.argmax([_device_time(d, p, costs) for d, p in zip(demands, plans)]))
    plan, tokens = plans[k], demands[k].tokens_per_expert
    if plan.load_now.size == 0:
        return None
    expert = plan.load_now[np.argmin(tokens[plan.load_now])]
    keep = plan.load_now != expert
    trial = dataclasses.replace(plan, gpu=plan.gpu[plan.gpu != expert], load_now=plan.load_now[keep],
                                cpu=np.sort(np.append(plan.cpu, expert)),
                                load_low=plan.load_low[plan.load_low != expert])
    return _if_faster(demands, plans, costs, best, k, trial)


def _to_gpu(demands, plans, costs, best, spare):
    """While the CPU is slowest: its expert with the most tokens loaded by its accelerator, where a slot is spare."""
    if _cpu_time(demands, plans, costs) + EPSILON < best:
        return None
    candidates = [(demands[k].tokens_per_expert[e], k, e) for k, p in enumerate(plans) if spare[k] > 0 for e in p.cpu]
    if not candidates:
        return None
    _, k, expert = max(candidates)
    plan = plans[k]
    trial = dataclasses.replace(plan, cpu=plan.cpu[plan.cpu != expert], gpu=np.sort(np.append(plan.gpu, expert)),
                                load_now=np.append(plan.load_now, expert))
    return _if_faster(demands, plans, costs, best, k, trial)


def _if_faster(demands, plans, costs, best, k, trial):
    """(k, trial) when accelerator k's plan replaced by `trial` lowers the layer's time, else None."""
    tried = plans[:k] + [trial] + plans[k + 1:]
    return (k, trial) if layer_time(demands, tried, costs) < best - EPSILON else None


def _device_time(demand: LayerDemand, plan: Plan, costs: CostTable) -> float:
    return float(costs.t_transfer(plan.load_now.size)) + costs.t_gpu(demand.tokens_per_expert[plan.gpu])


def _cpu_time(demands, plans, costs) -> float:
    return sum(costs.t_cpu(d.tokens_per_expert[p.cpu]) for d, p in zip(demands, plans))


def _spare_slots(demand: LayerDemand, plan: Plan) -> int:
    if plan.stream_next_layer:
        return 0
    return max(0, demand.free_slots - plan.load_now.size - plan.prefetch.size)
