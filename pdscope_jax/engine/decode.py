"""The decode step executors and the choice between them.

Contract: `choose(engine, batch, steps)` -> the executor class for a generate's `steps` decode steps:
`DeviceDecode` when the engine runs on one accelerator, the planner's capability `decodes_on_device` holds,
RuntimeConfig's `device_decode`, `async_io` and `batched_gpu` are on, no copy may load from the int4 copies (the
engine's `precision` is None, or the planner never copies in decode: the decode program copies the stored precision
alone), the pool can serve a layer's distinct experts (`device_decode.fits`) and the planner copies misses or the
host can compute them (`engine.host_split`), and no warm-up's trial of both for this batch size found the host loop
faster (`engine.decode_trials`, `engine.decode_trial`: planners that choose their decode mode); else `HostDecode`.
The choice depends on nothing that changes between steps, so it holds for the whole decode (the device executor
keeps the pool's table on the accelerator from its first step to its last).
Both take (engine, token [B] (the first new token, on the accelerator), cache, t (prompt length), sampling (the
`generation.sampling.SamplingState` on the accelerator, donated step by step), count (the steps to come, or
None), streamed (its tokens are handed out as they come: `OffloadRunner.steps`)); `step(n)` runs decode step n
(sampling at step n); `tokens` holds the host copies (`Sampled`, numpy arrays that own their memory:
`host_copy`) of the steps fetched and not yet taken, in order (the device executor's lag two steps behind); the
caller pops what it has taken, so a long decode keeps nothing per step; `finish()` -> the rest, and adds what it
counted to the decode statistics. `decode_experts(engine, host, batch)`: what the step copies from (pinned
stacks, or their in-place device views with decode_zero_copy).
- `HostDecode`: `HostLoop.step` (per layer: route -> plan -> execute -> record), then `next_token`.
- `DeviceDecode`: one `device_decode.decode_step` program per step: no planner call, no host round trip. It
  commits staged copies, waits for prefill's queued work (`handoff_seconds`), opens the pool's decode bank (the
  engine's `decode_slots`, closed again by `finish()`, so the next prefill has its memory back), uploads the
  pool's table, and fetches each token two steps behind its step, so the host never waits for the step it just
  dispatched; where the pool holds every routed expert (`device_decode.EVERY_RESIDENT`) it first loads those
  not resident (`_fill_pool`), and where its steps copy nothing it fills the decode bank (`_fill_bank`); both
  count in `seconds`, bytes and `experts_placed`. With `chunk_steps` above 1 and the run's `count` of steps given,
  the first step of each chunk runs that many steps in one program (`device_decode.decode_chunk`) and the others
  run nothing; tokens then arrive a chunk late (a streamed run's last steps short of a chunk: a program each).
  Steps with a bridge or a host part chunk in a program whose calls run as issued (`engine._decode_chunk_issued`),
  steps with XLA's host part only when asked. Its steps count in `device_steps`, `seconds`, hits (copies ahead used
  included), bytes, prefetch use, prediction recall (where it copies ahead), gpu_experts and cpu_experts (misses
  the host computed), not in the time splits. For a
  batch's ragged rows (`engine.batching`): t may be int32 [B] (each row's input position), `steps` int32 [B]
  (each row's sampling step at the first step), `active` [B] bool (the rest route to no expert and count as no
  token).
"""

from __future__ import annotations

import time

import jax
import numpy as np

from pdscope_jax.engine import bank_fill, device_decode, pool_table
from pdscope_jax.models.experts import sources_take_kernel
from pdscope_jax.runtime import allocator_peak


def choose(engine, batch: int, steps: int):
    rc = engine.runtime
    picks = layer_picks(engine.config, batch)
    on_device = (steps > 0 and len(engine.shards) == 1 and rc.device_decode and rc.async_io and rc.batched_gpu
                 and (engine.precision is None or not engine.planner.decode_copies)
                 and engine.planner.decodes_on_device
                 and device_decode.fits(engine.pool.num_slots + engine.decode_slots, picks)
                 and (engine.planner.decode_copies or engine.decode_host(batch) is not None))
    if on_device and batch in engine.decode_trials:  # the planner chose by timing both (`engine.decode_trial`)
        return engine.decode_trials[batch].executor
    return DeviceDecode if on_device else HostDecode


def decode_experts(engine, host, batch: int = 1) -> tuple:
    """Per MoE layer, the experts the device step copies its misses from: the store's device-memory views
    (`device_decode.DeviceViews`: misses read in place, with no conditional where `device_decode.reads_in_place`)
    where RuntimeConfig.decode_zero_copy asks for them (None: where `reads_in_place(host)`), every layer has them,
    no XLA host part computes from them and, on a GPU, the matvec kernel takes a step of `batch` rows (else XLA
    would read every pick from host memory); else its pinned stacks, or per-expert arrays where it keeps none."""
    store, moe = engine.store, engine._moe_layers
    setting = engine.runtime.decode_zero_copy
    if (device_decode.reads_in_place(host) if setting is None else setting) and not xla_host_part(host):
        views = tuple(store.layer_device_views(layer) for layer in moe)
        if all(v is not None for v in views) and _kernel_reads(engine, views[0], batch):
            return tuple(device_decode.DeviceViews(*v) for v in views)
    return tuple(store.layer_stacks(layer) or store.layer_experts(layer) for layer in moe)


def _kernel_reads(engine, views, batch: int) -> bool:
    """Whether a step of `batch` rows reads its picks from the pool's banks and the views by the matvec kernel
    (always true off a GPU, where the views are device memory like any other)."""
    if engine.devices.accel.platform != "gpu":
        return True
    return sources_take_kernel(layer_picks(engine.config, batch) * batch, (*engine.pool.banks, tuple(views)))


def layer_picks(cfg, batch: int) -> int:
    """The most distinct experts a MoE layer of a `batch`-row step picks."""
    return min(batch * cfg.num_experts_per_tok, cfg.num_experts)


AUTO_CHUNK = 32  # steps a program on a GPU where RuntimeConfig.decode_chunk is None (docs/MEASUREMENTS.md)
STREAM_CHUNK = 8  # the same for a streamed run: its tokens arrive a chunk late, and a stop wastes the chunk's rest


def chunk_steps(engine, host, count, streamed: bool = False) -> int:
    """Steps per device decode program for a run of `count` steps (None: not known: 1) under the split `host`
    (`engine.decode_host`): RuntimeConfig.decode_chunk where given; else, on a GPU where a step has no host part or
    has the CUDA bridge, `STREAM_CHUNK` for a `streamed` run (`OffloadRunner.steps`) and `AUTO_CHUNK` for the
    others; 1 elsewhere (off a GPU, and where XLA's host part computes the misses)."""
    if not count:
        return 1
    chunk = engine.runtime.decode_chunk
    if chunk is None:
        if xla_host_part(host) or engine.devices.accel.platform != "gpu":
            return 1
        return STREAM_CHUNK if streamed else AUTO_CHUNK
    return chunk


def bridged(host) -> bool:
    """Whether steps under the split `host` call the bridge or have a host part: their chunks run as issued."""
    return host is not None and (host.bridge is not None or host.computes)


def xla_host_part(host) -> bool:
    """Whether XLA ops, not the bridge, compute part of the misses of steps under the split `host`."""
    return host is not None and host.bridge is None and host.computes


class HostDecode:
    def __init__(self, engine, token, cache: list, t: int, sampling, count=None, streamed=False):
        self.engine, self.token, self.cache, self.t = engine, token, cache, t
        self.sampling = sampling
        self.tokens: list = []

    def step(self, n: int) -> None:
        e, b, accel = self.engine, self.token.shape[0], self.engine.devices.accel
        positions = jax.device_put(np.full((b, 1), self.t + n - 1, np.int32), accel)
        x, self.cache = e._loop.step(self.token[:, None], positions, self.cache, "decode", np.ones(b, bool))
        picked, self.sampling = e._programs["next_token"](e._graph, e._state, x, 0, self.sampling, n)
        self.token = picked.token
        self.tokens.append(host_copy(picked))  # a host copy, so nothing on the accelerator grows with the output

    def finish(self) -> list:
        return self.tokens


class DeviceDecode:
    def __init__(self, engine, token, cache: list, t, sampling, steps=None, active=None, count=None, streamed=False):
        e = self.engine = engine
        e._transfers.commit_all()  # nothing staged stays behind the table's upload
        stats = e.phase_stats["decode"]
        waited = time.perf_counter()
        jax.block_until_ready((e.pool.gate_up, e.pool.down))  # prefill's queued work apart from the steps'
        stats.handoff_seconds += time.perf_counter() - waited
        accel, b = e.devices.accel, token.shape[0]
        moe = e._moe_layers
        e.pool.open_decode_bank(e.decode_slots, e.runtime.decode_bank_pieces)
        self.host = e.decode_host(b)
        self.start = time.perf_counter()  # decode's time from here: the bank's fill, then the steps
        if self.host is not None and self.host.every_resident:
            self._fill_pool()
        bank = self._fill_bank() if self.host is not None and not self.host.copies else []
        self.table = pool_table.upload(e.pool, moe, decode_bonus(e, b), accel, bank)
        self.experts = decode_experts(e, self.host, b)
        self.graphs = tuple(layer.graph for layer in e._layers)
        self.state_tree, self.state_leaves = device_decode.flat_states((layer.state for layer in e._layers), e._state)
        self.token, self.caches = token, tuple(cache)
        self.positions = jax.device_put(np.broadcast_to(np.asarray(t, np.int32).reshape(-1, 1), (b, 1)), accel)
        # the step counter lives on the accelerator
        self.step_no = jax.device_put(np.int32(1) if steps is None else np.asarray(steps, np.int32), accel)
        self.active = None if active is None else jax.device_put(np.asarray(active, bool), accel)
        self.real_rows = b if active is None else int(np.sum(active))
        self.sampling = sampling
        self.in_flight, self.tokens = [], []
        self.steps_run = 0
        self.chunk, self.count, self.streamed = chunk_steps(e, self.host, count, streamed), count, streamed
        self.chunk_left = 0  # steps of the chunk in flight still to be called: they run nothing

    def _fill_pool(self) -> None:
        """Load, once, every routed expert not resident into the pool that can hold them all (no slot is taken
        from a resident expert), so that no step misses."""
        e, pool = self.engine, self.engine.pool
        moved_before, placed = e.store.bytes_moved, 0
        for layer in e._moe_layers:
            missing = np.flatnonzero(pool.slot_of(layer) < 0)
            if missing.size:
                e.store.write(pool, layer, missing, pool.allocate(layer, missing))
                placed += missing.size
        stats = e.phase_stats["decode"]
        stats.experts_placed += placed
        stats.bytes_moved += e.store.bytes_moved - moved_before

    def _fill_bank(self) -> list[tuple[int, int]]:
        """A step that copies nothing leaves the decode bank as it opened, empty: fill it now, once, with the
        experts `pool_table.bank_fill` names (each layer's most routed first: the hot table's counts, else the run's,
        ties by id), its staged copies bounded by the budget (`engine.bank_fill`) -> those (position, expert)."""
        e, pool = self.engine, self.engine.pool
        if not pool.decode_slots:
            return []
        lead = e.shards[0]
        rank = np.stack([np.argsort(-e.routed_counts(lead, layer), kind="stable") for layer in e._moe_layers])
        pairs = pool_table.bank_fill(pool, e._moe_layers, rank, pool.decode_slots)
        moved_before, (pooled, *bank) = e.store.bytes_moved, pool.banks
        writes = []
        for m, layer in enumerate(e._moe_layers):
            rows = [row for row, (position, _) in enumerate(pairs) if position == m]
            writes.append((layer, [pairs[row][1] for row in rows], rows))
        pool.banks = (pooled, *bank_fill.fill(e.store, tuple(bank), writes, e.budget.decode_fill_group))
        stats = e.phase_stats["decode"]
        stats.experts_placed += len(pairs)
        stats.bytes_moved += e.store.bytes_moved - moved_before
        return pairs

    def step(self, n: int) -> None:
        if self.chunk > 1:
            self._chunk_step(n)
            return
        self.in_flight.append(self._one_step())
        if len(self.in_flight) > 2:
            self.tokens.append(host_copy(self.in_flight.pop(0)))

    def _one_step(self):
        """Dispatch one step's program -> its picks (their host copies started)."""
        e, pool = self.engine, self.engine.pool
        (picked, self.sampling, self.positions, self.step_no, self.caches, pool.banks,
         self.table) = e._decode_step(self.graphs, e._graph, e._moe_layers, self.host, self.state_tree,
                                      self.state_leaves, self.experts,
                                      self.token, self.positions, self.caches, self.sampling, self.step_no,
                                      pool.banks, self.table, self.active)
        self.token = picked.token
        self.steps_run += 1
        for leaf in jax.tree.leaves(picked):
            leaf.copy_to_host_async()
        return picked

    def _chunk_step(self, n: int) -> None:
        """Step n of a decode run in programs of `chunk` steps: the first step of a chunk dispatches the whole
        chunk (`device_decode.decode_chunk`), then hands out what ran before it; the others run nothing. The last
        chunk is as long as the steps left, except in a streamed run, whose count changes from run to run and is
        not warmed up: there the steps left run a program each, so any count runs the same two programs."""
        if self.chunk_left:
            self.chunk_left -= 1
            return
        size = min(self.chunk, self.count - n + 1)
        stacked = not (self.streamed and size < self.chunk)
        picked = self._one_chunk(size) if stacked else self._one_step()
        self.chunk_left = size - 1 if stacked else 0
        self.tokens += self._unstacked()  # what ran before, done or nearly
        self.in_flight.append((picked, stacked))

    def _one_chunk(self, size: int):
        """Dispatch a program of `size` steps -> their picks, stacked (their host copies started)."""
        e, pool = self.engine, self.engine.pool
        program = e._decode_chunk_issued if bridged(self.host) else e._decode_chunk
        (picked, self.sampling, self.positions, self.step_no, self.caches, pool.banks,
         self.table) = program(size, self.graphs, e._graph, e._moe_layers, self.host, self.state_tree,
                               self.state_leaves, self.experts, self.token, self.positions, self.caches,
                               self.sampling, self.step_no, pool.banks, self.table, self.active)
        self.token = picked.token[-1]
        self.steps_run += size
        for leaf in jax.tree.leaves(picked):
            leaf.copy_to_host_async()
        return picked

    def _unstacked(self) -> list:
        """Host copies of what is in flight (chunks, and steps of a program each), one Sampled a step (and none
        left in flight)."""
        out = []
        for picked, stacked in self.in_flight:
            steps = host_copy(picked)
            out += [jax.tree.map(lambda a, i=i: a[i], steps) for i in range(len(steps.token))] if stacked else [steps]
        self.in_flight = []
        return out

    def finish(self) -> list:
        e, tokens = self.engine, self.tokens
        tokens += self._unstacked() if self.chunk > 1 else [host_copy(picked) for picked in self.in_flight]
        self.in_flight = []
        seconds = time.perf_counter() - self.start
        moe = e._moe_layers
        counts = pool_table.download(self.table, e.pool, moe)
        e.device_peak_bytes = allocator_peak(e.devices.accel, e.device_peak_bytes)  # the decode's, bank included
        e.pool.close_decode_bank()
        for layer, routed in zip(moe, np.asarray(self.table.routed)):
            e.activation_counts["decode"][layer] += routed
        # copied when routed: neither resident, nor copied ahead, nor computed by the host
        misses = counts["activated"] - counts["hits"] - counts["used_ahead"] - counts["on_host"]
        # every routed expert has one size: the bytes are those of as many copies of one expert
        nbytes = e.store.count_moved(moe[0], np.zeros(misses + counts["copied_ahead"], np.int64))
        stats = e.phase_stats["decode"]
        stats.steps += self.steps_run
        stats.device_steps += self.steps_run
        stats.tokens += self.real_rows * self.steps_run
        stats.seconds += seconds
        stats.activated += counts["activated"]
        stats.hits += counts["hits"] + counts["used_ahead"]  # as the host loop counts: resident or in flight
        stats.experts_loaded_now += misses
        stats.experts_prefetched += counts["copied_ahead"]
        stats.prefetch_used += counts["used_ahead"]
        stats.predicted_hits += counts["predicted_hits"]
        stats.predicted_total += counts["predicted_total"]
        stats.gpu_experts += counts["activated"] - counts["on_host"]
        stats.cpu_experts += counts["on_host"]
        stats.bytes_moved += nbytes
        return tokens


def host_copy(picked):
    """`picked`'s arrays as numpy arrays that own their memory. On the CPU backend `jax.device_get` returns views
    of the device buffers, and every view kept pins its PjRt buffer and runtime records (several KB each, and
    worse in the fragmented malloc arenas of XLA's threads): the tokens a long decode keeps grew host RSS by
    tens of KB per step."""
    return jax.tree.map(lambda a: np.array(a, copy=True), jax.device_get(picked))


def decode_bonus(engine, batch: int) -> np.ndarray | None:
    """[Lm, E] clock ticks each expert's popularity adds to its worth in the device-side cache (see
    `device_decode`): for a planner with the `decode_popularity` capability and a hot table, its activations over
    its layer's mean (1 for an expert of average popularity) times the pool's turnover, the ticks in which a
    step's misses could replace every slot (slots / distinct experts a layer can pick); None (LRU) otherwise."""
    hot = engine._hot_counts
    if not engine.planner.decode_popularity or not hot:
        return None
    cfg = engine.config
    table = np.stack([np.asarray(hot[layer], np.float64) for layer in engine._moe_layers])
    over_mean = table / np.maximum(table.mean(axis=1, keepdims=True), 1e-12)
    slots = engine.pool.num_slots + engine.pool.decode_slots
    turnover = slots / layer_picks(cfg, batch)
    return np.round(over_mean * turnover).astype(np.int32)
