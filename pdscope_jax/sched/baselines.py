"""Phase-blind placement policies that PDScope is measured against, behind the same `Planner` interface.

Contract: each planner maps a `LayerDemand` and a `CostTable` to a `Plan` that passes `check_plan`, and ignores
the phase except where stated. None of them keeps a slot pool: eviction (LRU) is the slot pool's job, so their
`unload` is empty. Loads never exceed the slots the demand says exist (`free_slots`); when they would, the
hottest experts are loaded and the rest run on the CPU.

- `gpu`: everything on the GPU; the engine keeps every expert resident, so nothing is loaded in practice (a
  non-resident activated expert is loaded, without a cap: a missing slot is the engine's bug, and check_plan
  reports it).
- `static` (KTransformers-like): a fixed hot set per layer stays resident (`hot_experts(layer)` tells the
  engine what to preload); resident activated experts run on the GPU, the rest on the CPU; no transfers ever.
- `ondemand`: every activated non-resident expert is loaded now; in prefill it also asks to stream the next
  layer into the other full-layer buffer.
- `greedy` (HybriMoE-like): per layer, move the hottest missing experts to the GPU while the GPU side still
  finishes first, then prefetch the same expert ids (the current layer's hottest) for the next layer into the
  slots left: a layer-local heuristic with no predictor. With `hot_per_layer` (and `activation_counts`) it also
  has a hot-expert table the engine preloads (the ablation's "+h" step); the slot pool may evict it like any
  other resident expert.
- `fate`: on-demand loading plus prefetch of the top-k next-layer experts by `next_scores` (the engine fills
  them from the next layer's gate applied to the current hidden state).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from pdscope_jax.sched.costs import CostTable
from pdscope_jax.sched.plan import Capabilities, HotExperts, LayerDemand, Plan


class GpuPlanner(Capabilities):
    name = "gpu"
    keeps_all_resident = True
    decodes_on_device = True

    def plan(self, demand: LayerDemand, costs: CostTable) -> Plan:
        return Plan.from_loads(demand, load_now=demand.missing_cold_to_hot()[::-1])


class StaticPlanner(Capabilities):
    """Hot experts fixed on the GPU: `hot_experts(layer)` is the `HotExperts(hot_per_layer, activation_counts)`
    table, which the engine preloads; the planner itself only reads residency."""

    name = "static"
    decodes_on_device = True  # where the host computes the misses (it never copies one)
    decode_host_experts = True
    decode_copies = False

    @classmethod
    def hot_slots(cls, pool_slots: int, num_experts: int, layer_buffers_fit: bool, have_table: bool) -> int:
        return pool_slots  # no loads at run time: the whole pool holds hot experts, with or without counts

    def __init__(self, hot_per_layer: int = 0, activation_counts: Mapping[int, Sequence[float]] | None = None):
        self.hot_experts = HotExperts(hot_per_layer, activation_counts)

    def plan(self, demand: LayerDemand, costs: CostTable) -> Plan:
        return Plan.from_loads(demand)


def _hottest_that_fit(demand: LayerDemand, slots: int) -> np.ndarray:
    """The activated non-resident experts, hottest first, cut to `slots`."""
    return demand.missing_cold_to_hot()[::-1][:max(slots, 0)]


class OnDemandPlanner(Capabilities):
    name = "ondemand"
    decodes_on_device = True

    def plan(self, demand: LayerDemand, costs: CostTable) -> Plan:
        stream = demand.phase == "prefill" and demand.next_layer is not None
        return Plan.from_loads(demand, load_now=_hottest_that_fit(demand, demand.free_slots),
                               stream_next_layer=stream)


class GreedyPlanner(Capabilities):
    """Per-layer balance: with `m` hottest missing experts loaded, the GPU side finishes at
    `t_transfer(m) + t_gpu(resident activated + loaded)` and the CPU side at `t_cpu(the other missing ones)`;
    `m` grows while the GPU side stays strictly below the CPU side (so the move that would make the GPU the
    later side is not taken). Then the next-layer experts with the ids of this layer's `prefetch_depth` hottest
    activated experts are prefetched, those not resident there, into the slots left (no cross-layer predictor).
    The default depth of 2 under-fetches in prefill and speculates in decode, the behaviour the paper ascribes
    to layer-local greedy schedulers."""

    name = "greedy"

    @classmethod
    def hot_slots(cls, pool_slots: int, num_experts: int, layer_buffers_fit: bool, have_table: bool) -> int | None:
        return pool_slots // 4 if have_table else None  # the rest of the pool serves its loads

    def __init__(self, prefetch_depth: int = 2, hot_per_layer: int = 0,
                 activation_counts: Mapping[int, Sequence[float]] | None = None):
        if prefetch_depth < 0:
            raise ValueError(f"prefetch_depth must be >= 0, got {prefetch_depth}")
        self.prefetch_depth = prefetch_depth
        self.hot_experts = HotExperts(hot_per_layer, activation_counts)

    def loads(self, demand: LayerDemand, costs: CostTable) -> np.ndarray:
        """The balanced on-demand set, hottest first."""
        tok = demand.tokens_per_expert
        hot_first = _hottest_that_fit(demand, demand.free_slots)
        missing_tok = tok[demand.missing_cold_to_hot()[::-1]]  # hottest first
        m = np.arange(missing_tok.size + 1)
        gpu_side = costs.t_transfer(m) + costs.gpu_growing(costs.gpu_marginals(tok[demand.resident_activated()]),
                                                           costs.gpu_marginals(missing_tok))
        cpu_side = np.concatenate((np.cumsum(costs.cpu_times(missing_tok)[::-1])[::-1], [0.0]))
        balanced = (gpu_side < cpu_side)[1:hot_first.size + 1]  # entry j: is loading j+1 experts still balanced
        count = balanced.size if balanced.all() else int(np.argmin(balanced))
        return hot_first[:count]

    def plan(self, demand: LayerDemand, costs: CostTable) -> Plan:
        load_now = self.loads(demand, costs)
        tok = demand.tokens_per_expert
        act = np.flatnonzero(demand.activated)
        same_ids = act[np.lexsort((act, -tok[act]))][:self.prefetch_depth]
        same_ids = same_ids[demand.next_not_resident()[same_ids]]
        return Plan.from_loads(demand, load_now=load_now,
                               prefetch=same_ids[:max(demand.free_slots - load_now.size, 0)])


class FatePlanner(Capabilities):
    """On-demand loading plus prefetch of those of the `top_k` highest `next_scores` (the predicted activated
    set) that are not resident in the next layer yet, into the slots left. `top_k=None` uses the number of
    experts activated in the current layer (the model's top-k in single-sequence decode)."""

    name = "fate"
    reads_next_scores = True  # always from the next layer's gate: Fate's own predictor

    def __init__(self, top_k: int | None = None):
        if top_k is not None and top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {top_k}")
        self.top_k = top_k

    def plan(self, demand: LayerDemand, costs: CostTable) -> Plan:
        load_now = _hottest_that_fit(demand, demand.free_slots)
        prefetch = np.zeros(0, dtype=np.int64)
        if demand.next_scores is not None:
            k = self.top_k if self.top_k is not None else int(np.count_nonzero(demand.activated))
            scores = demand.next_scores
            ranked = np.flatnonzero(scores > 0)
            top = ranked[np.lexsort((ranked, -scores[ranked]))][:k]
            top = top[demand.next_not_resident()[top]]
            prefetch = top[:max(demand.free_slots - load_now.size, 0)]
        return Plan.from_loads(demand, load_now=load_now, prefetch=prefetch)
