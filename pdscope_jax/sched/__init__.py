"""Planners: per MoE layer and step, decide which experts run on the GPU or the CPU, what to load, prefetch and
unload. Pure Python over small numpy arrays; no jax, no device arrays (so they are tested without a model).

Public API: the policy registry (`POLICIES`, `COMPARED`, `PLAIN`, `make_planner`, `planner_class`,
`check_policy`, `UnknownPolicyError`;
registry.py); `LayerDemand`, `Plan`, `Planner`, `ObservingPlanner`, `Capabilities`, `check_plan`, `PlanError`,
`HotExperts` (plan.py); `CostTable`, `CostTableError`, `costs_dir`, `find_cost_table`, `load_cost_table`
(costs.py); `activation_counts`, `HotTableError` (hot.py); `AdaptSched`, `Decision` (adaptsched.py); the quality
rule, `PrecisionRule` and its checks (precision.py: which copies travel as int4).
"""

from pdscope_jax.sched.adaptsched import AdaptSched, Decision
from pdscope_jax.sched.baselines import FatePlanner, GpuPlanner, GreedyPlanner, OnDemandPlanner, StaticPlanner
from pdscope_jax.sched.costs import CostTable, CostTableError, costs_dir, find_cost_table, load_cost_table
from pdscope_jax.sched.hot import HotTableError, activation_counts
from pdscope_jax.sched.plan import (Capabilities, HotExperts, LayerDemand, ObservingPlanner, Plan, Planner,
                                    PlanError, check_plan)
from pdscope_jax.sched.precision import PrecisionRule
from pdscope_jax.sched.registry import (COMPARED, PLAIN, POLICIES, Policy, UnknownPolicyError, check_policy,
                                        make_planner, planner_class)

__all__ = [
    "POLICIES", "COMPARED", "PLAIN", "Policy", "make_planner", "planner_class", "check_policy",
    "UnknownPolicyError", "Capabilities", "HotExperts",
    "LayerDemand", "Plan", "Planner", "ObservingPlanner", "PlanError", "check_plan",
    "CostTable", "CostTableError", "costs_dir", "find_cost_table", "load_cost_table", "activation_counts",
    "HotTableError", "AdaptSched", "Decision", "PrecisionRule", "GpuPlanner", "StaticPlanner", "OnDemandPlanner",
    "GreedyPlanner", "FatePlanner",
]
