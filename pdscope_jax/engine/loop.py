"""The host-planned step: one forward over the layers, and per MoE layer route -> plan -> execute -> record.

Contract: `HostLoop.step(ids [B, T], positions [B, T], cache, phase, valid [B*T] bool) -> (x [B, T, D], cache)`.
Token counts are padded to buckets (`RuntimeConfig.decode_buckets`; prefill's `runtime.prefill_rows`: its buckets,
capped at the KV cache's length), so the set of compiled programs is bounded; padded rows route but count in no
statistic. Per MoE layer (`moe_layer`, Algorithm 1):
  route    `Router.route`: attention, router, shared experts, next-layer scores; the routing to the host;
           then what it chose is counted (activation counts, the planner's observation, prefetch use, and how
           well the scores the layer before gave its planner predicted it: `stats.prediction_hits`);
  plan     a `LayerDemand` -> the planner's `Plan` (costs with the in-situ CPU calibration), checked; where the
           engine's `precision` rule loads int4 copies, the demand carries it and the routing's relative weights;
  execute  `PlanExecutor.execute`: loads, CPU experts, the next layer's transfers, GPU experts, the sum;
  record   the layer's `LayerTiming` waits for the end of the step (`settle`), so no layer waits for its own
           compute and the next layer's programs queue behind it.
With several accelerators (`engine.shards`) each shard plans its share of the layer from its view of the routing;
where the planner `balances_accelerators`, `sched.across.balance` evens the plans out against the one CPU (moves
counted in `accelerator_moves`); each shard dispatches its plan; then the CPU parts are joined and the shares'
sums added over the mesh (`MeshSum`).
The loop reads the runner's session (`shards` and their planners, `runtime`, `phase_stats`, `activation_counts`,
`timeline`) and owns only the step's unsettled timings, the scores planned with for layers not yet routed, and
the step shapes run (for warm-up).
"""

from __future__ import annotations

import time

import jax
import numpy as np

from pdscope_jax.engine.calibration import CpuCalibration
from pdscope_jax.engine.route import Routed, Router
from pdscope_jax.engine.stats import LayerTiming, prediction_hits
from pdscope_jax.runtime import allocator_peak, bucket, prefill_rows
from pdscope_jax.sched import LayerDemand, Plan, check_plan
from pdscope_jax.sched.across import balance
from pdscope_jax.sched.precision import relative_peaks


class HostLoop:
    def __init__(self, engine, router: Router, calibration: CpuCalibration):
        self.engine = engine
        self.router, self.calibration = router, calibration
        moe = engine._moe_layers
        self._next_moe = dict(zip(moe[:-1], moe[1:]))
        self._prev_moe = dict(zip(moe[1:], moe[:-1]))
        self._mark = engine._mark
        self.observing = False  # the planner learns from each layer's activated experts (set by set_policy)
        self.unsettled: list[LayerTiming] = []
        self.predicted: dict[int, np.ndarray] = {}  # MoE layer -> the [E] scores its predecessor planned with
        self.step_shapes: set[tuple[int, int, int]] = set()  # (batch, tokens, padded rows) of steps run

    def step(self, ids, positions, cache: list, phase: str, valid: np.ndarray):
        e = self.engine
        start = time.perf_counter()
        n = valid.size
        n_pad = bucket(n, e.runtime.decode_buckets) if phase == "decode" else prefill_rows(n, e.runtime, ids.shape[0])
        self.step_shapes.add((*ids.shape, n_pad))
        self.predicted.clear()  # a step that raised may have left some
        valid_pad = np.zeros(n_pad, bool)
        valid_pad[:n] = valid
        # the next-layer gate's row mask, on the accelerator once per step rather than once per layer
        valid_device = (jax.device_put(valid_pad.astype(np.float32), e.devices.accel) if self.router.wants_scores
                        else None)
        for shard in e.shards:
            transfers = shard.transfers
            if phase != "decode" and transfers.streams_prefill and shard.pool.can_double_buffer:
                first = e._moe_layers[0]  # streams behind the embedding and the layers before it
                transfers.stream(first, (), e.phase_stats[phase], e.runtime.async_io, transfers.stream_low)
        programs = e._programs
        x = programs["embed"](e._graph, e._state, ids)
        for i, layer in enumerate(e._layers):
            if layer.moe:
                x, cache[i] = self.moe_layer(i, x, positions, cache[i], phase, valid_pad, valid_device)
            else:
                x, cache[i] = programs["dense_layer"](layer.graph, layer.state, x, positions, cache[i])
        x.block_until_ready()
        self.settle()
        e.device_peak_bytes = allocator_peak(e.devices.accel, e.device_peak_bytes)
        stats = e.phase_stats[phase]
        stats.steps += 1
        stats.tokens += int(valid.sum())
        stats.seconds += time.perf_counter() - start
        return x, cache

    def moe_layer(self, i: int, x, positions, layer_cache, phase: str, valid: np.ndarray, valid_device):
        self._mark(phase, "layer_start", i)
        r = self.router.route(i, x, positions, layer_cache, phase, valid, valid_device)  # route
        self._count(i, phase, r)
        e, nxt = self.engine, self._next_moe.get(i)
        stats, rc = e.phase_stats[phase], e.runtime
        if r.next_scores is not None and nxt is not None:  # scored once the next layer has routed (`_count`)
            self.predicted[nxt] = r.next_scores
        if len(e.shards) == 1:
            shard = e.shards[0]
            plan = self._plan(shard, self._demand(shard, i, phase, r), r)  # plan
            x, timing = shard.executor.execute(i, nxt, phase, plan, r, stats, rc)  # execute
            self.unsettled.append(timing)  # record, at the end of the step
            return x, r.layer_cache
        # several accelerators: each plans its share; the plans are evened out against the shared CPU where the
        # planner asks; each dispatches; then the CPU parts are joined and the shares' sums added over the mesh
        views = [shard.view(r, i, nxt) for shard in e.shards]
        demands = [self._demand(shard, i, phase, view) for shard, view in zip(e.shards, views)]
        plans = [self._plan(shard, demand, view) for shard, demand, view in zip(e.shards, demands, views)]
        if e.planner.balances_accelerators:
            plans, moves = balance(demands, plans, self.calibration.costs_for(phase, r.padded_rows))
            stats.accelerator_moves += moves
            for demand, plan in zip(demands, plans):
                check_plan(demand, plan)
        dispatched = [shard.executor.dispatch(i, nxt, phase, plan, view, stats, rc)
                      for shard, plan, view in zip(e.shards, plans, views)]
        parts = []
        for shard, d in zip(e.shards, dispatched):
            (y_gpu, y_cpu, cpu_rows), timing = shard.executor.join(d)
            self.unsettled.append(timing)
            parts.append(shard.part(e._programs, r.shared.shape, y_gpu, y_cpu, cpu_rows))
        x = e._programs["moe_combine"](r.x, r.shared, e.mesh_sum(parts), None)
        self._mark(phase, "combined", i)
        return x, r.layer_cache

    def _count(self, i: int, phase: str, r: Routed) -> None:
        """What routing chose: activation counts, the planner's observation, prefetches used, and the hits of the
        prediction made for this layer at the layer before (where its planner had scores)."""
        e = self.engine
        stats = e.phase_stats[phase]
        e.activation_counts[phase][i] += r.tokens
        activated = np.flatnonzero(r.tokens)
        for shard in e.shards:
            mine = shard.local_ids(activated, i)
            if self.observing and i in self._prev_moe:
                shard.planner.observe(self._prev_moe[i], phase, mine)
            prefetched = shard.transfers.take_prefetched(i)
            if prefetched is not None:
                stats.prefetch_used += int(np.isin(prefetched, mine).sum())
        scores = self.predicted.pop(i, None)
        if scores is not None:
            hits, total = prediction_hits(scores, activated)
            stats.predicted_hits += hits
            stats.predicted_total += total

    def _demand(self, shard, i: int, phase: str, r: Routed) -> LayerDemand:
        """What layer i asks of the shard, from its view of the routing (`Shard.view`)."""
        e = self.engine
        nxt, pool = self._next_moe.get(i), shard.pool
        rule = e.precision
        peaks = None if rule is None else shard.local(relative_peaks(r.w_host, r.ids_host, e.config.num_experts), i)
        return LayerDemand(
            layer=i, phase=phase, tokens_per_expert=r.tokens, resident=pool.resident(i), next_layer=nxt,
            next_scores=None if nxt is None else r.next_scores,
            next_resident=None if nxt is None else pool.resident(nxt),
            free_slots=pool.free_slots(protect=(i,)), total_slots=pool.num_slots, num_tokens=r.rows.size,
            precision=rule, peak_weight=peaks)

    def _plan(self, shard, demand: LayerDemand, r: Routed) -> Plan:
        """The shard's planner's plan for `demand`, checked and counted."""
        e = self.engine
        i, phase, nxt = demand.layer, demand.phase, demand.next_layer
        resident = demand.resident
        start = time.perf_counter()
        plan = shard.planner.plan(demand, self.calibration.costs_for(phase, r.padded_rows))
        planner_seconds = time.perf_counter() - start
        check_plan(demand, plan)
        self._mark(phase, "planned", i)
        if phase == "prefill" and nxt is not None:  # the next prefill streams its first layer too
            shard.transfers.streams_prefill, shard.transfers.stream_low = plan.stream_next_layer, plan.stream_low
        stats = e.phase_stats[phase]
        stats.planner_seconds += planner_seconds
        stats.planner_calls += 1
        stats.activated += int(demand.activated.sum())
        stats.hits += int((demand.activated & resident).sum())
        return plan

    def settle(self) -> None:
        """Add the step's timed layers to the statistics (`LayerTiming.settle_into`), their done-times to the
        timeline, and their CPU times to the calibration."""
        for t in self.unsettled:
            done = {name: future.result() for name, future in t.ready.items()}
            for name, at in {"cpu": t.cpu_end, **done}.items():  # the helper's stamp of the CPU part is exact
                if at is not None:
                    self._mark(t.phase, f"{name}_done", t.layer, at)
            if "cpu" in done and t.cpu_predicted > 0:
                self.calibration.observe(t, done["cpu"])
            t.settle_into(self.engine.phase_stats[t.phase], done)
        self.unsettled.clear()
