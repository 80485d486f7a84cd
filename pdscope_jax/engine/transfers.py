"""Copies staged ahead of the layer that needs them: prefetches and whole-layer streams into the slot pool.

Contract: `Transfers(pool, store)` reserves slots now and has ONE stager thread issue each copy
(`ExpertStore.stage`), in issue order; the copy is committed into its slots when its layer runs (`commit`).
- `issue_next(i, nxt, plan, stats, async_io)`: after layer i's plan, stage layer nxt's experts: all of its
  non-resident ones when the plan streams the next layer and the pool holds two layers (`stream`), else the
  plan's prefetch (`stage_ahead`); from the int4 copies the plan marks (`stream_low`, `prefetch_low`). -> the
  staging (a Future of `Staged`), or None when nothing is in flight.
- `stream(layer, protect, stats, async_io)` takes the slots of experts beyond each other layer's even share first
  (`SlotPool.over_share`; which a layer keeps: the most `wanted`, the engine's routed counts), so after a prefill
  every layer keeps as many resident, for decode and for the next prefill, which streams only the rest.
- With `async_io` off every copy is waited for where it is issued, before any compute is dispatched, and all of
  its time counts as exposed transfer.
- `prefetched` {layer: experts staged for it before it routed} (popped by `take_prefetched` when it routes),
  `streams_prefill` (the last prefill streamed: the next prefill step streams its first MoE layer before the
  embedding, hiding that copy behind the layers before it; low when `stream_low`). `clear()` forgets all of it
  (a new policy).
Why a thread: `device_put` holds the thread that issues it, and a copy issued from a second thread overlaps
compute.
"""

from __future__ import annotations

import concurrent.futures
import time

import jax
import numpy as np

from pdscope_jax.engine.stats import PhaseStats, count_copies
from pdscope_jax.sched import Plan
from pdscope_jax.store.expert_store import ExpertStore, Staged
from pdscope_jax.store.slot_pool import SlotPool


class Transfers:
    def __init__(self, pool: SlotPool, store: ExpertStore):
        self.pool, self.store = pool, store
        # one worker keeps the copies in issue order
        self.stager = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="offload-stage")
        # layer -> (staging of its experts, issued on the stager thread; their slots)
        self.pending: dict[int, tuple[concurrent.futures.Future[Staged], np.ndarray]] = {}
        self.prefetched: dict[int, np.ndarray] = {}
        self.wanted = None  # MoE layer -> [E] scores: which experts a layer keeps of its share (None: by id)
        self.streams_prefill = self.stream_low = False

    def clear(self) -> None:
        self.pending.clear()
        self.prefetched.clear()
        self.streams_prefill = self.stream_low = False

    def take_prefetched(self, layer: int) -> np.ndarray | None:
        return self.prefetched.pop(layer, None)

    def commit(self, layer: int) -> None:
        """Copy the transfers staged for `layer` into their reserved slots."""
        if layer in self.pending:
            staging, slots = self.pending.pop(layer)
            self.store.commit(self.pool, staging.result(), slots)

    def commit_all(self) -> None:
        for layer in list(self.pending):
            self.commit(layer)

    def issue_next(self, i: int, nxt: int | None, plan: Plan, stats: PhaseStats, async_io: bool):
        if nxt is None:
            return None
        if plan.stream_next_layer and self.pool.can_double_buffer:
            return self.stream(nxt, (i,), stats, async_io, plan.stream_low)
        return self.stage_ahead(nxt, plan.prefetch, (i,), stats, async_io,
                                low=np.isin(plan.prefetch, plan.prefetch_low))

    def stream(self, layer: int, protect: tuple[int, ...], stats: PhaseStats, async_io: bool, low: bool = False):
        beyond = self.pool.over_share(self.pool.even_share, (*protect, layer), self.wanted)
        experts = np.flatnonzero(~self.pool.resident(layer))
        return self.stage_ahead(layer, experts, protect, stats, async_io, prefer=beyond,
                                low=np.full(experts.size, low))

    def stage_ahead(self, layer: int, experts: np.ndarray, protect: tuple[int, ...], stats: PhaseStats,
                    async_io: bool, prefer: np.ndarray | None = None, low: np.ndarray | None = None):
        """Reserve slots (`prefer`red ones first, see `SlotPool.allocate`) and have the stager thread issue the
        copy of `experts` of `layer` (int4 copies where `low` [n])."""
        if experts.size == 0:
            return None
        low = np.zeros(experts.size, bool) if low is None else low
        start = time.perf_counter()
        slots = self.pool.allocate(layer, experts, protect=protect, prefer=prefer, low=low)
        staging = self.stager.submit(self.store.stage, layer, experts, low if low.any() else None)
        count_copies(stats, self.store, layer, experts, low, self.store.count_staged(layer, experts, low))
        self.pending[layer] = (staging, slots)
        self.prefetched[layer] = experts
        stats.experts_prefetched += experts.size
        if async_io:
            return staging
        staged = staging.result()
        jax.block_until_ready(staged.arrays)
        waited = time.perf_counter() - start
        stats.transfer_seconds += waited
        stats.exposed_transfer_seconds += waited
        return None
