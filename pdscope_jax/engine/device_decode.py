"""Decode as ONE accelerator program per step: the program routes each MoE layer, takes every activated expert from the
slot pool, copies misses from pinned host memory itself or has the host's CPU compute them, and keeps the pool a cache
of the ones it copies (why: docs/MEASUREMENTS.md).

With a `HostExperts` split a layer's misses beyond its copy share go to the host while the copies and the GPU's experts
run (`kernels.host_experts`: the CUDA bridge, no Python callback); planners opt in through `decodes_on_device`,
`decode_host_experts` and `decode_copies` (`engine.decode.choose`). Contract:
- Pool table: `engine.pool_table.PoolTable` on the accelerator (uploaded before the first step, written back after).
- Residency (GreedyDual, popularity as the cost): an expert used at clock c is worth c + its bonus; a hit refreshes its
  slot's `keep`; a layer's misses, most worth first, are paired with the slots least worth keeping (its hits excluded)
  and take them when worth more (always under LRU), else are used once and not kept; at most `kept_rows(picks)` of a
  layer's misses (most worth first) are kept; a miss the host computes is never kept.
- `decode_step(graphs, model_graph, moe_layers, host, state_tree, state_leaves, experts, token, positions, caches,
  sampling, step, banks, table, active=None) -> (Sampled, sampling', positions + 1, step + 1, caches, banks, table)`:
  one model step on token [B] at positions [B, 1] (rows not `active` [B] route to no expert: a batch's free rows);
  `state_tree`, `state_leaves` = `flat_states(states, model_state)`, the layers' and the model's parameters as one
  tuple of arrays; `experts[m]`: the m-th MoE layer's experts in pinned host memory, whole-layer stacks (gate_up
  [E,D,2F], down [E,F,D]) or tuples of E per-expert arrays; `banks`: `SlotPool.banks` (the pool, and the decode bank
  while open; the table numbers their slots one after the other). `host`: None (every miss copied) or the
  `HostExperts` split; with its copies ahead each layer hands the next its `Ahead`. A step that copies nothing from
  one bank (a pool of every expert) multiplies the picks' slots where they lie (`bank_slots.read_in_banks`). Sampling is
  `programs.next_token`'s (`generation.sampling.sample`, settings traced). `build_decode_step()` jits it (graphs,
  model graph, MoE layers, host and state tree static; caches, sampling state, banks and table donated). Its layers
  are nested jitted programs with the MoE position a traced value: layers of one kind trace once.
- `decode_chunk(n, ...)`: `n` steps of `decode_step` in one program (a scan; same arguments after n, the same
  outputs with each step's Sampled stacked [n, ...]); `build_decode_chunk(compiler_options)` jits it (n static too),
  for steps with no bridge (its calls must run as issued) as XLA command buffers.
- `fits(slots, picks)`: more slots than a layer's `picks` distinct experts, so a miss always finds a non-hit victim.
Numbers equal the host-driven loop's within float tolerance (same route program and expert function); each row's routed
sum is the plain model's (`models.experts.combine_experts`): expert outputs in the model's dtype, weighted and summed in
float32 (in k order where the plain model gathers, at most GATHER_MAX_ASSIGNMENTS assignments), rounded once.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pdscope_jax.generation.sampling import sample
from pdscope_jax.kernels import host_experts
from pdscope_jax.models.experts import GATHER_MAX_ASSIGNMENTS, sources_experts_ffn, stacked_experts_ffn, weighted_sum
from pdscope_jax.engine import bank_slots
from pdscope_jax.engine.programs import dense_layer, moe_route, next_layer_picks
from pdscope_jax.engine.pool_table import PoolTable
from pdscope_jax.engine.smallest import smallest
from pdscope_jax.store.expert_store import pull_traced

PROTECTED = np.iinfo(np.int32).max  # `keep` of this layer's hit slots while it places its misses
F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class HostExperts:
    """How a step's misses split between copies and the host's CPU (a static argument of the step):
    `copy_share` of a layer's misses (rounded), the most worth keeping, are copied, and with `fill_free` at
    least as many as there are free slots (a copy into a free slot evicts nothing and serves later steps); the
    rest are computed by the host through `bridge` (`kernels.host_experts`), or by XLA ops on the pinned
    weights where it is None. With `bridge_copies` the bridge's worker makes the copies (DMA), so the step has
    no conditional per layer and its launching thread runs ahead of the GPU; else the program copies them. With
    `ahead` as well, each layer also predicts the next MoE layer's experts (its router on this layer's MoE input,
    Fate's predictor) and the worker copies those not resident after this layer's copies; a miss of the next
    layer among them is then neither copied again nor computed by the host. `EVERY_RESIDENT`: the pool holds
    every routed expert for the whole decode (filled as it starts): no miss, so nothing is copied or computed by
    the host, and the step has no copies and no conditional."""
    copy_share: float
    bridge: host_experts.Bridge | None = None
    fill_free: bool = True
    bridge_copies: bool = False
    ahead: bool = False
    every_resident: bool = False

    @property
    def computes(self) -> bool:
        """Whether the host may compute any miss (a share of 1 copies every one)."""
        return self.copy_share < 1 and not self.every_resident

    @property
    def copies(self) -> bool:
        """Whether any miss may be copied."""
        return (self.copy_share > 0 or self.fill_free) and not self.every_resident

    @property
    def copies_ahead(self) -> bool:
        """Whether the bridge's worker copies predicted experts a layer ahead."""
        return self.ahead and self.bridge_copies and self.copies and self.bridge is not None


EVERY_RESIDENT = HostExperts(0.0, fill_free=False, every_resident=True)


class Ahead(NamedTuple):
    """What a layer predicted for the next one: `predicted` [P] the experts its router picks for these rows
    (ascending, -1 pads), `ids` [P] those of them copied ahead (not resident then; else -1), `rows` their copies
    (gate_ups [P, D, 2F], downs [P, F, D]; row p holds expert ids[p] where ids[p] >= 0)."""
    predicted: jax.Array
    ids: jax.Array
    rows: tuple


class DeviceViews(NamedTuple):
    """A MoE layer's experts as device-memory views of their page-locked host stacks (gate_up [E, D, 2F], down
    [E, F, D]; `ExpertStore.layer_device_views`): a kernel reads an expert from them in place, over PCIe."""
    gate_up: object
    down: object


def _host_begin(host: HostExperts, m, h, ids, coef, picks):
    """Start the host's experts of MoE position m; -> (h, picks) to compute the GPU's part from, and what
    `_host_end` needs."""
    if host.bridge is not None:
        h, picks = host_experts.begin(host.bridge, m, h, ids, coef, picks)
        return h, picks, None
    return h, picks, (h, ids, coef)


def _bridge_pull(host: HostExperts, m, h, ids, coef, picks, copy_ids, take, ahead=None, next_ids=None):
    """The bridge's begin with its copies: the host starts its experts (ids, coef; none where it computes
    none), its worker copies row u by DMA where copy_ids[u] >= 0 (expert copy_ids[u]) or from `ahead.rows` where
    copy_ids[u] <= -2 (row -2 - copy_ids[u]), then the next layer's `next_ids` a layer ahead.
    -> (h, picks, (gate_ups [U, D, 2F], downs [U, F, D]), next rows or None) with row u the copy where
    copy_ids[u] != -1, else take()'s row u (the pool's)."""
    if not host.computes:
        ids, coef = ids[:0], coef[:0]
    rows_before = None if ahead is None else ahead.rows
    h, picks, gate_ups, downs, *next_rows = host_experts.begin(host.bridge, m, h, ids, coef, picks, copy_ids,
                                                               next_ids, rows_before)
    fetched = host_experts.fetched(host.bridge, gate_ups, downs, rows_before)
    u = copy_ids.shape[0]
    rows = jnp.where(copy_ids != -1, u, jnp.arange(u))  # out of range: the copy stays
    pulled = tuple(jax.tree.map(lambda got, kept: got.at[rows].set(kept, mode="drop", unique_indices=True),
                                part, pooled) for part, pooled in zip(fetched, take()))
    return h, picks, pulled, tuple(next_rows) if next_rows else None


def _distinct(ids, num_experts: int, masked: bool = False):
    """The distinct experts of ids [N, K], ascending, -1 padding the end to min(N * K, num_experts); `masked`: ids
    may hold -1 (rows routed nowhere), which count as padding."""
    if ids.shape[0] == 1 and not masked:  # one row's top-k are distinct: sorting them is their unique (one kernel)
        return jnp.sort(ids.reshape(-1))
    if masked:  # -1 sorts first in a unique: past every expert instead, then back to -1
        out = jnp.unique(jnp.where(ids < 0, num_experts, ids).reshape(-1), size=min(ids.size, num_experts),
                         fill_value=num_experts)
        return jnp.where(out >= num_experts, -1, out)
    return jnp.unique(ids.reshape(-1), size=min(ids.size, num_experts), fill_value=-1)


def _predict(router, m, h, table, active=None):
    """MoE position m + 1's router (graph, state) on this layer's MoE input h [N, D] (rows `active`, all when None):
    -> (predicted [P], the predicted experts not resident now, else -1 [P])."""
    ids, num_experts = next_layer_picks(*router, h)
    if active is not None:
        ids = jnp.where(active[:, None], ids, -1)
    predicted = _distinct(ids, num_experts, masked=active is not None)
    absent = (predicted >= 0) & (table.slot_of[m + 1, jnp.maximum(predicted, 0)] < 0)
    return predicted, jnp.where(absent, predicted, -1)


def _host_end(host: HostExperts, pending, dep, experts):
    """The host's part [N, D] float32, after `dep` (the GPU's part)."""
    if host.bridge is not None:
        return host_experts.end(host.bridge, dep, dep.shape[0], dep.shape[1])
    h, ids, coef = pending
    u = ids.shape[0]
    gate_ups, downs = pull_traced(experts, jnp.maximum(ids, 0), u, lambda at: _no_rows(experts, at.shape[0]))
    outputs = stacked_experts_ffn(jnp.broadcast_to(h, (u, *h.shape)), gate_ups, downs)  # [U, N, D]
    return _weighted_picks(ids >= 0, coef, outputs)


def _routed_sum(weights, chose, use, outputs):
    """The routed sum [N, D] float32 of the picks' outputs [U, N, D] (in the model's dtype) for the picks `use` [U]
    (not the host's, not pads), each row's routing weights [N, K] as `chose` [U, N, K] assigns them, in the plain
    model's order (`models.experts.combine_experts`)."""
    if weights.size <= GATHER_MAX_ASSIGNMENTS:  # the plain model's path for so few: its sum, in k order
        pick_of = jnp.argmax(chose, axis=0)  # [N, K]: the pick each (row, k) chose
        rows = jnp.arange(weights.shape[0])[:, None]
        return weighted_sum(outputs[pick_of, rows], weights, jnp.any(chose & use[:, None, None], axis=0))
    # the plain model's sorted path adds each row's experts in ascending order, as this sum does
    return _weighted_picks(use, jnp.sum(jnp.where(chose, weights[None], 0.0), axis=2), outputs)


def _weighted_picks(use, coef, outputs):
    """sum over picks u with use[u] of coef[u, n] * outputs[u, n] in float32, in pick order -> [N, D]."""
    return jnp.sum(jnp.where(use[:, None, None], coef[:, :, None] * outputs.astype(F32), 0.0), axis=0)


def _no_rows(experts, n: int):
    """Zeros of n experts' weights in `experts`' structure (pull_traced's resident rows; none is read)."""
    gate_ups, downs = experts
    per_expert = isinstance(gate_ups, (tuple, list))

    def zeros(a):
        return jnp.zeros((n, *(a.shape if per_expert else a.shape[1:])), a.dtype)
    return tuple(jax.tree.map(zeros, part[0] if per_expert else part) for part in (gate_ups, downs))


def kept_rows(picks: int) -> int:
    """The most misses of a layer of `picks` distinct experts that may enter the pool in one step (at least one):
    writing into the pool reads every candidate row's weights, kept or not, so the candidates are few."""
    return max(1, (picks + 1) // 2)


def fits(slots: int, picks: int) -> bool:
    """Whether `slots` can serve a layer of `picks` distinct experts (see the module docstring)."""
    return slots > picks


def _layer_picks(m, ids, table, active, by_worth: bool):
    """MoE position m's distinct picks of ids [N, K] (rows not `active` route nowhere) and what the table says of
    them. -> (ids, picks [U] (a pad repeats the first pick), valid, slots (-1: not resident), miss, worth, clock);
    with `by_worth` misses first, most worth first (the order they are copied and kept in), else one row's top-k
    as they come."""
    if active is not None:
        ids = jnp.where(active[:, None], ids, -1)
    one_row = ids.shape[0] == 1 and active is None
    if one_row:
        picks = ids.reshape(-1)  # one row's top-k are distinct: its picks, in the order they come
    else:
        picks = _distinct(ids, table.slot_of.shape[1], masked=active is not None)
    valid = picks >= 0
    picks = jnp.where(valid, picks, picks[0])  # a pad repeats the first pick, with no weight and no count
    slots = table.slot_of[m, picks]
    miss = valid & (slots < 0)
    clock = table.clock + 1
    worth = clock + table.bonus[m, picks]
    if by_worth and one_row:  # by worth, then ascending: the general path's order, in one sort
        _, picks, valid, miss, slots, worth = jax.lax.sort(
            (jnp.where(miss, -worth, PROTECTED), picks, valid, miss, slots, worth), num_keys=2)
    elif by_worth:
        order = jnp.argsort(jnp.where(miss, -worth, PROTECTED), stable=True)
        picks, valid, miss, slots, worth = (a[order] for a in (picks, valid, miss, slots, worth))
    return ids, picks, valid, slots, miss, worth, clock


def _routed_experts(m, h, weights, ids, experts, banks, table, host=None, router=None, ahead=None, active=None,
                    before_host=None):
    """The routed output [N, D] f32 of MoE layer position m for rows h [N, D] routed to ids [N, K] with weights
    (see the module docstring); `router`: the next MoE layer's (graph, state) where this layer copies ahead for
    it (`HostExperts.copies_ahead`), `ahead`: what the layer before copied ahead for this one (`Ahead`, or None);
    `active` [N] bool: rows not active route nowhere (no pick, no count; their output is meaningless).
    `before_host`: arrays the GPU computes before it waits for the host's part (the layer's shared experts: the GPU
    is idle while it waits, and XLA would otherwise schedule them after the wait).
    -> (y, banks, table, this layer's `Ahead` or None). Straight-line code, no loop over the picks (a
    loop costs a kernel chain per pick and copies of the pool): the layer's misses are copied at once and every
    pick's weights come out of that copy's program as one array (hits read from their slots) before any slot is
    written, every distinct expert runs in one batched call, and the misses, most worth first, are paired with
    the slots least worth keeping (a hit slot never among them)."""
    if host is not None and host.every_resident and ids.shape[0] == 1 and active is None:
        return (*_one_row_every_resident(m, h, weights, ids, banks, table), None)
    if isinstance(experts, DeviceViews) and reads_in_place(host):
        return (*_routed_in_place(m, h, weights, ids, experts, banks, table, active), None)
    num_slots = table.keep.shape[0]
    copies_nothing = host is not None and not host.copies  # every row from the pool, with no conditional
    ids, picks, valid, slots, miss, worth, clock = _layer_picks(m, ids, table, active, by_worth=not copies_nothing)
    resident = jnp.maximum(slots, 0)  # after the misses: hits (and pads) from their slots
    chose = (ids[None] == picks[:, None, None]) & valid[:, None, None]  # [U, N, K]: row n chose pick u
    coeff = jnp.sum(jnp.where(chose, weights[None], 0.0), axis=2)  # [U, N]
    n_miss = jnp.sum(miss, dtype=jnp.int32)
    pulled, next_ahead = None, None
    early = jnp.zeros_like(miss)  # misses the layer before copied ahead
    ahead_counts = [0, 0, 0, 0]  # copied_ahead, used_ahead, predicted_hits, predicted_total
    if ahead is not None:
        match = picks[:, None] == ahead.ids[None, :]  # [U, P]; a -1 (nothing copied) matches no pick
        early = miss & jnp.any(match, axis=1)
        early_rows = jnp.where(early, -2 - jnp.argmax(match, axis=1), -1)  # -2 - a: row a of the copies ahead
        predicted = jnp.any(picks[:, None] == ahead.predicted[None, :], axis=1) & valid
        ahead_counts[1:] = [jnp.sum(early), jnp.sum(predicted), jnp.sum(valid)]
    if host is None:
        copied, on_cpu = miss, jnp.zeros_like(miss)
    else:  # the misses most worth keeping are copied, the rest computed by the host at the same time
        rest = miss & ~early
        n_rest = jnp.sum(rest, dtype=jnp.int32)
        n_copy = jnp.round(n_rest * host.copy_share).astype(jnp.int32)
        if host.fill_free:
            n_copy = jnp.maximum(n_copy, jnp.minimum(n_rest, jnp.sum(table.keep < 0, dtype=jnp.int32)))
        copied = rest & (jnp.cumsum(rest) <= n_copy)  # misses come first, most worth first
        on_cpu = rest & ~copied
        host_ids, host_coef = jnp.where(on_cpu, picks, -1), jnp.where(on_cpu[:, None], coeff, 0.0)
        pending = None
        if host.bridge_copies and host.copies:
            next_ids = None
            if router is not None:
                next_predicted, next_ids = _predict(router, m, h, table, active)
                ahead_counts[0] = jnp.sum(next_ids >= 0)
            copy_ids = jnp.where(copied, picks, early_rows if ahead is not None else -1)
            h, picks, pulled, next_rows = _bridge_pull(host, m, h, host_ids, host_coef, picks, copy_ids,
                                                       lambda: bank_slots.take(banks, resident), ahead, next_ids)
            if router is not None:
                next_ahead = Ahead(next_predicted, next_ids, next_rows)
            copied = copied | early
        elif host.computes:
            h, picks, pending = _host_begin(host, m, h, host_ids, host_coef, picks)
        n_miss = jnp.sum(copied, dtype=jnp.int32)
    rows = jnp.broadcast_to(h, (picks.shape[0], *h.shape))  # [U, N, D]: every pick sees every row
    if copies_nothing:  # the slots read where they lie, in whichever bank: no gathered copy
        outputs = bank_slots.read_in_banks(rows, banks, resident)
    else:
        if pulled is None:  # the program copies the misses itself
            pulled = pull_traced(experts, picks, n_miss, lambda at: bank_slots.take(banks, resident[at]))
        gate_ups, downs = pulled
        outputs = stacked_experts_ffn(rows, gate_ups, downs)  # [U, N, D] in the model's dtype
    y = _routed_sum(weights, chose, valid & ~on_cpu, outputs)
    if host is not None and host.computes:
        if before_host is not None:
            y, _ = jax.lax.optimization_barrier((y, before_host))
        y = y + _host_end(host, pending, y, experts)

    hit = valid & ~miss
    parked = jnp.where(hit, slots, num_slots)  # out of range: dropped
    routed = table.routed.at[m, picks].add(jnp.sum(chose, axis=(1, 2), dtype=jnp.int32))
    if copies_nothing:  # nothing enters the pool: no victims, no writes (each would read
        # every pick's weights), only the hits' worth changes
        slot_of, owner, evictions = table.slot_of, table.owner, 0
        keep = table.keep.at[parked].set(worth, mode="drop")
    else:
        slot_of, owner, keep, banks, evictions = _keep_copies(m, table, picks, worth, copied, parked,
                                                              (gate_ups, downs), banks)
    counts = table.counts + jnp.stack([jnp.sum(valid), jnp.sum(hit), evictions, jnp.sum(on_cpu), *ahead_counts]
                                      ).astype(jnp.int32)
    return y, banks, PoolTable(slot_of, owner, keep, table.bonus, clock, counts, routed), next_ahead


def _one_row_every_resident(m, h, weights, ids, banks, table):
    """`_routed_experts` of one row where the pool holds every expert (`EVERY_RESIDENT`), in the fewest kernels:
    the row's top-k are its picks, in k order, every one a hit, so no pick is matched to its k, nothing is counted
    by a reduction and the sum runs in k order over the outputs as they come. Same outputs, table and counts as
    the general path. -> (y [1, D] float32, banks, table)."""
    picks = ids[0]  # [K], distinct
    slots = table.slot_of[m, picks]
    rows = jnp.broadcast_to(h, (picks.shape[0], *h.shape))  # [K, 1, D]
    outputs = bank_slots.read_in_banks(rows, banks, slots)
    y = weighted_sum(jnp.swapaxes(outputs, 0, 1), weights, jnp.ones_like(weights, dtype=bool))
    clock = table.clock + 1
    k = picks.shape[0]
    counts = table.counts.at[:2].add(k)  # activated, hits
    return y, banks, PoolTable(table.slot_of, table.owner, table.keep.at[slots].set(clock + table.bonus[m, picks]),
                               table.bonus, clock, counts, table.routed.at[m, picks].add(1))


def _keep_copies(m, table, picks, worth, copied, parked, parts, banks):
    """The copied misses of MoE position m that are worth their victims take their slots (see the module
    docstring): the pool's table and banks after them. -> (slot_of, owner, keep, banks, evictions)."""
    slot_of, owner, keep, target, evictions = _victims(m, table, picks, worth, copied, parked)
    banks = bank_slots.put(banks, target, tuple(part[:target.shape[0]] for part in parts))
    return slot_of, owner, keep, banks, evictions


def _victims(m, table, picks, worth, copied, parked):
    """The table after the first `kept_rows` picks that are copied misses worth their victims take those slots.
    -> (slot_of, owner, keep, target [r]: each candidate's slot, past every slot where not kept, evictions)."""
    num_layers, num_experts = table.slot_of.shape
    num_slots = table.keep.shape[0]
    keep = table.keep.at[parked].set(PROTECTED, mode="drop")
    r = kept_rows(picks.shape[0])  # the candidates: the first r picks, the misses most worth keeping
    victims = smallest(keep, r)  # the slots least worth keeping, least first
    kept = copied[:r] & (worth[:r] > keep[victims])  # the i-th miss against the i-th victim
    target = jnp.where(kept, victims, num_slots + jnp.arange(r))  # distinct; out of range: dropped
    evicted = jnp.where(kept, table.owner[victims], -1)
    # one scatter each: the evicted experts' entries (resident) and the kept misses' (not) are distinct, and so are
    # the kept misses' slots (victims, never a hit's) and the hits' slots
    layers = jnp.concatenate([jnp.where(evicted >= 0, evicted // num_experts, num_layers),
                              jnp.where(kept, m, num_layers)])
    experts = jnp.concatenate([evicted % num_experts, picks[:r]])
    slot_of = table.slot_of.at[layers, experts].set(jnp.concatenate([jnp.full(r, -1, victims.dtype), victims]),
                                                    mode="drop")
    owner = table.owner.at[target].set(m * num_experts + picks[:r], mode="drop")
    keep = keep.at[jnp.concatenate([target, parked])].set(jnp.concatenate([worth[:r], worth]), mode="drop")
    return slot_of, owner, keep, target, jnp.sum(evicted >= 0)


def reads_in_place(host) -> bool:
    """Whether a step with `host` (None or a `HostExperts`) may take a layer's misses from `DeviceViews` by
    `_routed_in_place`: every miss is the GPU's (no host part, no bridge) and may be copied."""
    return host is None or (host.copies and not host.computes and host.bridge is None and not host.every_resident)


def _routed_in_place(m, h, weights, ids, views, banks, table, active=None):
    """`_routed_experts` reading misses where they lie, with no conditional: the misses worth keeping (the same as
    the copying path keeps) are first copied from host memory into their victims' slots by a kernel that skips the
    rest (`kernels.row_copy`), then one FFN call reads every pick where it is, a hit or a kept miss in its bank,
    any other miss in host memory over PCIe (`sources_experts_ffn`). Each miss's bytes cross PCIe once; the table,
    counts and outputs are those of the copying path. -> (y, banks, table)."""
    num_slots = table.keep.shape[0]
    ids, picks, valid, slots, miss, worth, clock = _layer_picks(m, ids, table, active, by_worth=True)
    chose = (ids[None] == picks[:, None, None]) & valid[:, None, None]  # [U, N, K]: row n chose pick u
    hit = valid & ~miss
    parked = jnp.where(hit, slots, num_slots)  # out of range: dropped
    slot_of, owner, keep, target, evictions = _victims(m, table, picks, worth, miss, parked)
    r = target.shape[0]
    banks = bank_slots.put_from(banks, target, views, picks[:r])
    kept_at = jnp.concatenate([target, jnp.full(picks.shape[0] - r, num_slots, target.dtype)])
    at = jnp.where(miss, kept_at, jnp.where(valid, slots, 0))  # past every slot: read from host memory
    src, local = bank_slots.bank_of(banks, at)
    src, local = jnp.where(at < num_slots, src, len(banks)), jnp.where(at < num_slots, local, picks)
    rows = jnp.broadcast_to(h, (picks.shape[0], *h.shape))  # [U, N, D]: every pick sees every row
    outputs = sources_experts_ffn(rows, (*banks, tuple(views)), src, local)  # [U, N, D] in the model's dtype
    y = _routed_sum(weights, chose, valid, outputs)
    routed = table.routed.at[m, picks].add(jnp.sum(chose, axis=(1, 2), dtype=jnp.int32))
    counts = table.counts + jnp.stack([jnp.sum(valid), jnp.sum(hit), evictions, 0, 0, 0, 0, 0]).astype(jnp.int32)
    return y, banks, PoolTable(slot_of, owner, keep, table.bonus, clock, counts, routed)


def flat_states(states, model_state) -> tuple:
    """(state_tree, state_leaves) of the layers' states and the model's (see the module docstring)."""
    leaves, tree = jax.tree.flatten((tuple(states), model_state))
    return tree, tuple(leaves)


def _layer_experts(m, h, weights, ids, experts, banks, table, host, router_graph, router_state, ahead, active,
                   before_host=None):
    """`_routed_experts`, the next layer's router passed as its graph (static) and its state (traced)."""
    router = None if router_graph is None else (router_graph, router_state)
    return _routed_experts(m, h, weights, ids, experts, banks, table, host, router, ahead, active, before_host)


# The step's layers as nested programs, the MoE position a traced value: a model's layers of one kind trace and lower
# once (a start reads the step from the persistent cache, but traces it first), and XLA inlines them into the step.
_dense_program = jax.jit(dense_layer, static_argnums=0)
_route_program = jax.jit(moe_route, static_argnums=(0, 5, 6))
_experts_program = jax.jit(_layer_experts, static_argnums=(7, 8))


def decode_step(graphs, model_graph, moe_layers, host, state_tree, state_leaves, experts, token, positions, caches,
                sampling, step, banks, table, active=None):
    states, model_state = jax.tree.unflatten(state_tree, state_leaves)
    model = nnx.merge(model_graph.graphdef, model_state)
    x = model.embed(token[:, None])  # [B, 1, D]
    rows = token.shape[0]
    caches = list(caches)
    ahead = None
    for i, (graph, state) in enumerate(zip(graphs, states)):
        if i not in moe_layers:
            x, caches[i] = _dense_program(graph, state, x, positions, caches[i])
            continue
        m = moe_layers.index(i)
        x, h, weights, ids, _, shared, caches[i] = _route_program(graph, state, x, positions, caches[i], rows, False)
        router_graph = router_state = None
        if host is not None and host.copies_ahead and m + 1 < len(moe_layers):
            router_graph, router_state = graphs[moe_layers[m + 1]], states[moe_layers[m + 1]]
        y, banks, table, ahead = _experts_program(np.int32(m), h, weights, ids, experts[m], banks, table, host,
                                                  router_graph, router_state, ahead, active, shared)
        x = x + (y.astype(x.dtype) + shared).reshape(x.shape)
    logits = model.logits(x)[:, 0]
    picked, sampling = sample(logits, sampling, step)
    return picked, sampling, positions + 1, step + 1, tuple(caches), banks, table


def decode_chunk(n, graphs, model_graph, moe_layers, host, state_tree, state_leaves, experts, token, positions, caches,
                 sampling, step, banks, table, active=None):
    def one(carry, _):
        token, positions, caches, sampling, step, banks, table = carry
        picked, sampling, positions, step, caches, banks, table = decode_step(
            graphs, model_graph, moe_layers, host, state_tree, state_leaves, experts, token, positions, caches,
            sampling, step, banks, table, active)
        return (picked.token, positions, caches, sampling, step, banks, table), picked

    carry, picked = jax.lax.scan(one, (token, positions, caches, sampling, step, banks, table), None, length=n)
    _, positions, caches, sampling, step, banks, table = carry
    return picked, sampling, positions, step, caches, banks, table


def build_decode_chunk(compiler_options=None):
    """`decode_chunk` jitted: n and `decode_step`'s statics static, its donations donated."""
    return jax.jit(decode_chunk, static_argnums=(0, 1, 2, 3, 4, 5), donate_argnums=(10, 11, 13, 14),
                   compiler_options=compiler_options or None)


def build_decode_step():
    """`decode_step` jitted: graphs, model graph, MoE layer indices, host split and state tree static; caches,
    sampling state, banks and table donated."""
    return jax.jit(decode_step, static_argnums=(0, 1, 2, 3, 4), donate_argnums=(9, 10, 12, 13))
