"""Carrying out one MoE layer's `Plan`: loads, CPU experts, the next layer's transfers, GPU experts, the sum.

Contract: `PlanExecutor(...).execute(i, nxt, phase, plan, r, stats, rc) -> (x [B, T, D], LayerTiming)`, in order:
commit the copies staged for layer i; free the unloaded slots it does not compute with; hand the CPU experts to
the CPU backend (dispatched only; with many rows only the rows they read travel, gathered on the accelerator);
issue the loads of `load_now` (`ExpertStore.write`, ordered before every later reader of the pool), so the CPU
experts compute while they copy; stage the next layer's transfers (`Transfers.issue_next`) before compute is
dispatched, so they overlap it; dispatch the GPU experts (one `gpu_experts` program over the pool with a
slot_of map, or one per expert with `batched_gpu` off); hand the GPU result and the copies to helper threads that
stamp when each is done (`LayerTiming.ready`); wait for the CPU part only; add the parts and the shared experts.
`dispatch` (up to the CPU part's end, nothing waited for) and `join` (the CPU part, the slots freed) are the two
halves, for an engine that runs several executors' shares of a layer at once (`engine.shards`). An executor may
own a share of the model's experts (`owned`: per MoE layer, their ids in the model): its pool, store and plans
number them from 0, the routing (`Routed`) keeps the model's ids.
With `async_io` off each copy is waited for where it is issued and the CPU experts start after the copies.
Copies the plan marks low (`load_low`, `prefetch_low`, `stream_low`) move the host's int4 copies, turned into the
pool's format as they are written (`store.low_copies`). Counts bytes, loads (by precision) and GPU experts
computed from low copies into `stats`; with `trace` a list, appends (phase, layer, ids of those GPU experts) per
layer. The rest of the layer's figures settle from the returned `LayerTiming`.
Marks "cpu_submitted", "loads_issued", "next_issued", "gpu_dispatched", "cpu_joined", "combined".
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import time

import jax
import numpy as np

from pdscope_jax.engine.cpu_experts import CpuExperts, compact_rows
from pdscope_jax.engine.route import Routed
from pdscope_jax.engine.stats import LayerTiming, PhaseStats, count_copies
from pdscope_jax.engine.transfers import Transfers
from pdscope_jax.runtime import Devices, RuntimeConfig
from pdscope_jax.sched import CostTable, Plan
from pdscope_jax.store.expert_store import Staged
from pdscope_jax.store.slot_pool import SlotPool


@dataclasses.dataclass
class Dispatched:
    """One layer's share of a plan in flight: its GPU part (y [Nb, D] f32, or None), its CPU part still running
    (`_run_cpu`'s pair, or None), and what `join` needs to settle it."""

    layer: int
    phase: str
    plan: Plan
    on_gpu: np.ndarray  # [E] the plan's GPU experts
    y_gpu: jax.Array | None
    cpu_part: tuple | None
    cpu_start: float
    start: float
    dispatched: float
    loads_end: float | None
    ready: dict
    cpu_predicted: float
    rows: int


class PlanExecutor:
    def __init__(self, programs: dict, pool: SlotPool, cpu_experts: CpuExperts, transfers: Transfers,
                 devices: Devices, costs: CostTable, mark, owned: dict | None = None, num_experts: int | None = None):
        self._programs, self.pool, self.cpu_experts, self.transfers = programs, pool, cpu_experts, transfers
        self.store = transfers.store
        self.devices, self.costs, self._mark = devices, costs, mark
        # the routing's expert ids are the model's; this executor's pool, store and plans number its share from 0
        self.owned = owned  # MoE layer -> the model's ids of the share's experts (None: every expert, in order)
        self.num_experts = pool.num_experts if num_experts is None else num_experts
        # stamps when a part running elsewhere is done (its thread waits, the host does not)
        self.waiter = concurrent.futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="offload-wait")
        self.trace: list | None = None  # (phase, layer, GPU experts computed from int4 copies), when a list

    def execute(self, i: int, nxt: int | None, phase: str, plan: Plan, r: Routed, stats: PhaseStats,
                rc: RuntimeConfig):
        (y_gpu, y_cpu, cpu_rows), timing = self.join(self.dispatch(i, nxt, phase, plan, r, stats, rc))
        x = self._programs["moe_combine"](r.x, r.shared, y_gpu, y_cpu, cpu_rows)
        self._mark(phase, "combined", i)
        return x, timing

    def dispatch(self, i: int, nxt: int | None, phase: str, plan: Plan, r: Routed, stats: PhaseStats,
                 rc: RuntimeConfig) -> Dispatched:
        """Everything of the layer's plan up to its CPU part's end, issued without waiting for it."""
        pool = self.pool
        on_gpu = np.zeros(pool.num_experts, bool)  # [E]
        on_gpu[plan.gpu] = True
        self.transfers.commit(i)
        pool.release(i, plan.unload[~on_gpu[plan.unload]])  # unloads this layer does not compute with: free now
        cpu_part, cpu_start = None, time.perf_counter()
        if plan.cpu.size and rc.async_io:  # the CPU experts run while the loads copy
            cpu_part = self._run_cpu(i, plan.cpu, r)
            self._mark(phase, "cpu_submitted", i)
        start = time.perf_counter()
        loads, loads_end = self._load_now(i, plan.load_now, np.isin(plan.load_now, plan.load_low), stats,
                                          rc.async_io)
        self._mark(phase, "loads_issued", i)
        staged_next = self.transfers.issue_next(i, nxt, plan, stats, rc.async_io)  # before compute: overlaps it
        self._mark(phase, "next_issued", i)
        dispatched = time.perf_counter()
        if plan.cpu.size and not rc.async_io:  # synchronous I/O: nothing overlapped the copies
            cpu_part, cpu_start = self._run_cpu(i, plan.cpu, r), dispatched
        self._count_low(phase, i, plan.gpu, stats)
        y_gpu = self._run_gpu(i, plan.gpu, on_gpu, r, rc.batched_gpu)
        self._mark(phase, "gpu_dispatched", i)
        # helper threads stamp when each part is done (from now, not after the CPU part: exact GPU times)
        ready = {name: self.waiter.submit(ready_at, arrays) for name, arrays in
                 (("gpu", y_gpu), ("load", loads)) if arrays is not None}
        if staged_next is not None:
            ready["transfer"] = self.waiter.submit(staged_ready_at, staged_next)
        if cpu_part is not None:
            ready["cpu"] = self.waiter.submit(ready_at, cpu_part[0])
        return Dispatched(i, phase, plan, on_gpu, y_gpu, cpu_part, cpu_start, start, dispatched, loads_end, ready,
                          self.costs.t_cpu(r.tokens[plan.cpu]), r.padded_rows)

    def join(self, d: Dispatched) -> tuple[tuple, LayerTiming]:
        """Wait for the CPU part of a dispatched layer and free what the plan unloads. -> ((y_gpu, y_cpu on the
        accelerator, its rows or None), the layer's LayerTiming)."""
        i, plan = d.layer, d.plan
        (y_cpu, cpu_rows), cpu_end = self._join_cpu(d.cpu_part)
        self._mark(d.phase, "cpu_joined", i)
        self.pool.release(i, plan.unload[d.on_gpu[plan.unload]])  # after compute in dispatch order: safe to reuse
        self.pool.touch(i, plan.gpu)
        return (d.y_gpu, y_cpu, cpu_rows), LayerTiming(i, d.phase, plan.gpu.size, plan.cpu.size, d.start,
                                                       d.dispatched, d.cpu_start, cpu_end, d.loads_end, d.ready,
                                                       d.cpu_predicted, d.rows)

    def _load_now(self, i: int, experts: np.ndarray, low: np.ndarray, stats: PhaseStats, async_io: bool
                  ) -> tuple[jax.Array | None, float | None]:
        """Issue the load of `experts` of layer i into slots (int4 copies where `low` [n]). -> (an array ready
        when the load is done, None) or, with `async_io` off, where the copy is waited for here, (None,
        perf_counter when it was done); (None, None) when nothing was loaded."""
        if experts.size == 0:
            return None, None
        slots = self.pool.allocate(i, experts, protect=(i,), low=low)
        written = self.store.write(self.pool, i, experts, slots, low if low.any() else None)
        count_copies(stats, self.store, i, experts, low, written.nbytes)
        stats.experts_loaded_now += experts.size
        if not async_io:
            written.done.block_until_ready()
            return None, time.perf_counter()
        return written.done, None

    def _count_low(self, phase: str, i: int, experts: np.ndarray, stats: PhaseStats) -> None:
        """Count (and trace) layer i's GPU `experts` that compute from a slot holding an int4 copy."""
        low = experts[self.pool.low_of(i)[experts]]
        stats.gpu_experts_low += low.size
        if self.trace is not None:
            self.trace.append((phase, i, self._model_ids(i, low)))

    def _run_gpu(self, i: int, experts: np.ndarray, on_gpu: np.ndarray, r: Routed, batched: bool):
        """Dispatch layer i's GPU `experts` over the slot pool (on_gpu [E] marks them). -> y [Nb, D], or None."""
        if experts.size == 0:
            return None
        pool = self.pool
        mine = pool.slot_of(i)  # [E of this share]
        mine[~on_gpu] = -1
        slot_of = np.full(self.num_experts, -1, np.int32)  # [E]: the routing's ids are the model's
        slot_of[self._model_ids(i, np.arange(mine.size))] = mine
        # batched: one program for every GPU expert; else one program per expert (the ablation's baseline)
        parts = [slot_of] if batched else [_only(slot_of, e) for e in self._model_ids(i, experts)]
        y_gpu = None
        for part in parts:
            y = self._programs["gpu_experts"](r.h, r.w, r.ids, pool.gate_up, pool.down, part)  # part: host [E]
            y_gpu = y if y_gpu is None else y_gpu + y
        return y_gpu

    def _run_cpu(self, i: int, experts: np.ndarray, r: Routed) -> tuple[jax.Array, jax.Array | None]:
        """Dispatch layer i's CPU `experts` on the CPU backend (returns at once). -> (y f32 there, rows): y [Nb, D]
        and rows None when h came to the host with the routing (few rows), else only the rows the experts read
        (`cpu_experts.compact_rows`, gathered on the accelerator): y [R, D] for rows [R] on the accelerator."""
        groups = [(int(e), rows, w) for e, (_, rows, w) in
                  zip(experts, _groups(self._model_ids(i, experts), r.rows, r.w_host, r.ids_host))]
        if r.h_host is not None:
            return self.cpu_experts.dispatch(i, jax.device_put(r.h_host, self.devices.cpu), groups), None
        take, groups = compact_rows(groups, r.h.shape[0], self.cpu_experts.min_rows)
        take = jax.device_put(take, self.devices.accel)
        h_cpu = jax.device_put(self._programs["take_rows"](r.h, take), self.devices.cpu)
        return self.cpu_experts.dispatch(i, h_cpu, groups), take

    def _model_ids(self, i: int, experts: np.ndarray) -> np.ndarray:
        """The model's ids of layer i's `experts` of this executor's share."""
        return experts if self.owned is None else self.owned[i][experts]

    def _join_cpu(self, part: tuple[jax.Array, jax.Array | None] | None
                  ) -> tuple[tuple[jax.Array | None, jax.Array | None], float | None]:
        """Wait for the CPU part. -> ((y on the accelerator, its rows or None), perf_counter when the CPU was
        done), or ((None, None), None) without one."""
        if part is None:
            return (None, None), None
        acc, rows = part
        acc.block_until_ready()
        done = time.perf_counter()
        return (jax.device_put(acc, self.devices.accel), rows), done


def _only(slot_of: np.ndarray, expert: int) -> np.ndarray:
    """slot_of [E] with every expert but `expert` mapped to -1."""
    out = np.full_like(slot_of, -1)
    out[expert] = slot_of[expert]
    return out


def _groups(experts: np.ndarray, rows: np.ndarray, w: np.ndarray, ids: np.ndarray
            ) -> list[tuple[int, np.ndarray, np.ndarray]]:
    """Per expert: (expert, rows of h routed to it, their routing weights); w, ids [Nv, K] belong to `rows` [Nv]."""
    flat = ids.reshape(-1)
    order = np.argsort(flat, kind="stable")
    bounds = np.searchsorted(flat[order], np.stack([experts, experts + 1]))  # [2, n]
    k = ids.shape[1]
    out = []
    for e, lo, hi in zip(experts, bounds[0], bounds[1]):
        picks = order[lo:hi]
        out.append((int(e), rows[picks // k], w.reshape(-1)[picks]))
    return out


def staged_ready_at(staging: concurrent.futures.Future[Staged]) -> float:
    staged = staging.result()
    return ready_at(staged.arrays)


def ready_at(arrays) -> float:
    jax.block_until_ready(arrays)
    return time.perf_counter()
