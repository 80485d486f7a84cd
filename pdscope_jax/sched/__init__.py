"""Planners: per MoE layer and step, decide which experts run on the GPU or the CPU, what to load, prefetch and
unload. Pure Python over small numpy arrays; no jax, no device arrays (so they are tested without a model).

Public API: `make_planner(name, **options)` for the policies in `PLANNERS` (gpu, static, ondemand, greedy,
pdscope = AdaptSched, fate); `LayerDemand`, `Plan`, `Planner`, `ObservingPlanner`, `check_plan`, `PlanError`,
`HotExperts` (plan.py); `CostTable`, `CostTableError`, `costs_dir`, `find_cost_table`, `load_cost_table`
(costs.py); `activation_counts`, `HotTableError` (hot.py); `AdaptSched`, `Decision` (adaptsched.py).
"""

from pdscope_jax.sched.adaptsched import AdaptSched, Decision
from pdscope_jax.sched.baselines import FatePlanner, GpuPlanner, GreedyPlanner, OnDemandPlanner, StaticPlanner
from pdscope_jax.sched.costs import CostTable, CostTableError, costs_dir, find_cost_table, load_cost_table
from pdscope_jax.sched.hot import HotTableError, activation_counts
from pdscope_jax.sched.plan import (HotExperts, LayerDemand, ObservingPlanner, Plan, Planner, PlanError,
                                    check_plan)

PLANNERS = {
    "gpu": GpuPlanner,
    "static": StaticPlanner,
    "ondemand": OnDemandPlanner,
    "greedy": GreedyPlanner,
    "pdscope": AdaptSched,
    "fate": FatePlanner,
}


def make_planner(name: str, **options) -> Planner:
    """A new planner for policy `name` with its constructor options (`static`: hot_per_layer, activation_counts;
    `greedy`: prefetch_depth, hot_per_layer, activation_counts; `fate`: top_k; `pdscope`: r_hit_prior, r_hit_window, hot_per_layer,
    activation_counts)."""
    try:
        cls = PLANNERS[name]
    except KeyError:
        raise ValueError(f"unknown planner {name!r}; known: {', '.join(PLANNERS)}") from None
    try:
        return cls(**options)
    except TypeError as e:
        raise TypeError(f"planner {name!r}: {e}") from e


__all__ = [
    "PLANNERS", "make_planner", "HotExperts", "LayerDemand", "Plan", "Planner", "ObservingPlanner", "PlanError",
    "check_plan",
    "CostTable", "CostTableError", "costs_dir", "find_cost_table", "load_cost_table", "activation_counts",
    "HotTableError", "AdaptSched", "Decision", "GpuPlanner", "StaticPlanner", "OnDemandPlanner",
    "GreedyPlanner", "FatePlanner",
]
