"""The one policy registry: each policy name, its planner class, a one-line description, and what the engine
must provide for it (read from the planner's capability attributes, never from its name).

Contract:
- `POLICIES: {name: Policy}` in the order users see them; `make_planner(name, **options)` builds a planner
  (`UnknownPolicyError`, an `errors.InputError` and so a ValueError, naming the known policies for an unknown
  name; TypeError naming the policy for a bad option).
- `PLAIN` is the name of the reference run (the whole model resident, no planner); `COMPARED` the policies a
  side-by-side run shows by default (every offloading policy but `gpu`, which needs the whole model to fit).
- Capabilities, class attributes of every planner (defaults in `Capabilities`):
  `reads_next_scores` the engine fills `LayerDemand.next_scores`; `predictor_scores` those scores come from a
  PhasePer predictor when one is given (else from the next layer's gate on this layer's MoE input);
  `keeps_all_resident` every expert stays in the pool (the budget must hold them all);
  `decodes_on_device` its decode plan keeps every activated expert on the accelerator, so decode may run as one
  accelerator program per step; `decode_popularity` that program weighs cached experts by the hot table;
  `decode_host_experts` that program may have the host's CPU compute part of a layer's misses
  (`engine.host_split`); `decode_copies` False: it never copies a miss in decode (so it runs on the device only
  where the host computes them); `balances_accelerators` over several accelerators, each layer's plans are
  evened out against the shared CPU (`sched.across`); `chooses_decode_mode` where both decode executors can run a
  batch, warm-up times them and decode runs the faster (`engine.decode_trial`; RuntimeConfig `decode_trial` steps);
  `hot_slots(pool_slots, num_experts, layer_buffers_fit, have_table)` how many pool slots its hot-expert table
  gets (None: it has none).
"""

from __future__ import annotations

import dataclasses

from pdscope_jax.errors import InputError
from pdscope_jax.sched.adaptsched import AdaptSched
from pdscope_jax.sched.baselines import FatePlanner, GpuPlanner, GreedyPlanner, OnDemandPlanner, StaticPlanner
from pdscope_jax.sched.plan import Planner

PLAIN = "plain"


class UnknownPolicyError(InputError):
    """A policy name that is not in `POLICIES`."""


def check_policy(name) -> None:
    """Raise UnknownPolicyError naming the known policies unless `name` is one of them."""
    if not isinstance(name, str) or name not in POLICIES:
        raise UnknownPolicyError(f"unknown policy {name!r}; known: {', '.join(POLICIES)}")


@dataclasses.dataclass(frozen=True)
class Policy:
    name: str
    planner: type
    description: str


POLICIES: dict[str, Policy] = {p.name: p for p in (
    Policy("gpu", GpuPlanner, "every expert resident on the GPU (needs the whole model to fit)"),
    Policy("static", StaticPlanner, "a fixed hot set per layer on the GPU, the rest on the CPU, no transfers "
                                    "(KTransformers-like)"),
    Policy("ondemand", OnDemandPlanner, "load every missing activated expert when its layer runs; prefill "
                                        "streams whole layers"),
    Policy("greedy", GreedyPlanner, "per layer, load the hottest missing experts while the GPU side finishes "
                                    "first; same-id prefetch (HybriMoE-like)"),
    Policy("fate", FatePlanner, "on-demand loads plus prefetch of the next layer's gate top-k (Fate)"),
    Policy("pdscope", AdaptSched, "PDScope: phase-adaptive cross-layer scheduling (AdaptSched) with PhasePer "
                                  "predictions"),
)}
COMPARED = tuple(name for name, p in POLICIES.items() if not p.planner.keeps_all_resident)


def make_planner(name: str, **options) -> Planner:
    """A new planner for policy `name` with its constructor options (`static`: hot_per_layer, activation_counts;
    `greedy`: prefetch_depth, hot_per_layer, activation_counts; `fate`: top_k; `pdscope`: r_hit_prior,
    r_hit_window, hot_per_layer, activation_counts)."""
    check_policy(name)
    cls = POLICIES[name].planner
    try:
        return cls(**options)
    except TypeError as e:
        raise TypeError(f"policy {name!r}: {e}") from e


def planner_class(name: str) -> type:
    """The planner class of policy `name` (its capabilities without building one); ValueError when unknown."""
    check_policy(name)
    return POLICIES[name].planner
