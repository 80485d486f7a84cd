"""The slot pool's table on the accelerator while decode runs as one program per step (`engine.device_decode`):
which expert each slot holds, how much each is worth keeping, and what the steps counted.

Contract:
- `PoolTable`: `slot_of` [Lm, E] (-1: not resident), `owner` [S] (MoE position * E + expert; -1: free), `keep`
  [S] (worth keeping; -1: free), `bonus` [Lm, E] >= 0 (ticks an expert's popularity adds to its worth; zeros:
  LRU), `clock` [] (one tick per MoE layer), `counts` [len(COUNTS)], `routed` [Lm, E] (rows routed), all int32;
  S numbers the slots of the pool's banks (`SlotPool.banks`) one after the other.
- `upload(pool, moe_layers, bonus, device, bank=())` -> the table of the pool as its host bookkeeping says, on
  `device`: a resident's `keep` is its last use (the pool's LRU clock) plus its bonus; `bank` [(MoE position,
  expert)] is what the decode bank's rows 0, 1, ... hold (as if used now); every other slot is free.
- `bank_fill(pool, moe_layers, rank, rows)` -> what to place in a decode bank of `rows` slots that the steps
  would leave empty (they copy nothing): the layers in turn, each layer's absent experts in `rank` order.
- `download(table, pool, moe_layers)` writes the table back into the pool's host bookkeeping (residents of slots
  past the pool's, the bank's, are forgotten) -> {name in COUNTS: count since upload}.
COUNTS: experts activated, hits, evictions, misses computed by the host, experts copied a layer ahead, misses
served by those copies, and the next layer's activated experts predicted, of how many (`HostExperts.ahead`).
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from pdscope_jax.store.slot_pool import SlotPool, slot_count

COUNTS = ("activated", "hits", "evictions", "on_host", "copied_ahead", "used_ahead", "predicted_hits",
          "predicted_total")


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PoolTable:
    slot_of: jax.Array  # [Lm, E] int32
    owner: jax.Array  # [S] int32
    keep: jax.Array  # [S] int32
    bonus: jax.Array  # [Lm, E] int32
    clock: jax.Array  # [] int32
    counts: jax.Array  # [len(COUNTS)] int32
    routed: jax.Array  # [Lm, E] int32: rows routed to each expert


def upload(pool: SlotPool, moe_layers: tuple[int, ...], bonus: np.ndarray | None,
           device: jax.Device, bank: list[tuple[int, int]] = ()) -> PoolTable:
    """The table of the pool's banks (`SlotPool.banks`) on `device`; `bonus` [Lm, E] non-negative int32 (None:
    zeros, LRU; see the module docstring). A resident's `keep` is its last use (the pool's LRU clock) plus its
    bonus; `bank` [(MoE position, expert)]: what the decode bank's rows 0, 1, ... hold (`bank_fill`), as if used
    now; every other slot the host table does not cover (the bank's, a pool of no slots' dummy) is free."""
    e = pool.num_experts
    position = {layer: m for m, layer in enumerate(moe_layers)}
    slot_of = np.stack([pool.slot_of(layer) for layer in moe_layers]).astype(np.int32)
    owner = np.where(pool.owner_layer >= 0,
                     np.array([position.get(int(l), 0) for l in pool.owner_layer]) * e + pool.owner_expert, -1)
    bonus = np.zeros(slot_of.shape, np.int32) if bonus is None else np.asarray(bonus, np.int32)
    keep = np.where(owner >= 0, pool.last_use + bonus.reshape(-1)[np.maximum(owner, 0)], -1)
    free = sum(slot_count(gate_up) for gate_up, _ in pool.banks) - owner.size
    owner, keep = np.pad(owner, (0, free), constant_values=-1), np.pad(keep, (0, free), constant_values=-1)
    clock = int(pool.last_use.max(initial=0))
    for row, (m, expert) in enumerate(bank):
        at = pool.num_slots + row
        slot_of[m, expert], owner[at], keep[at] = at, m * e + expert, clock + bonus[m, expert]
    table = PoolTable(slot_of, owner.astype(np.int32), keep.astype(np.int32), bonus, np.int32(clock),
                      np.zeros(len(COUNTS), np.int32), np.zeros(slot_of.shape, np.int32))
    return jax.device_put(table, device)


def bank_fill(pool: SlotPool, moe_layers: tuple[int, ...], rank: np.ndarray | None,
              rows: int) -> list[tuple[int, int]]:
    """What to place in a decode bank of `rows` slots for a step that copies nothing (`HostExperts.copies`
    false: the bank would stay empty): (MoE position, expert) pairs, the layers in turn, each layer's experts not
    resident in its order of `rank` [Lm, E] (most wanted first; None: by id), so every layer gains about as many."""
    e = pool.num_experts
    order = np.tile(np.arange(e), (len(moe_layers), 1)) if rank is None else np.asarray(rank)
    wanted = [[int(x) for x in order[m] if pool.slot_of(layer)[x] < 0] for m, layer in enumerate(moe_layers)]
    pairs = [(m, experts[i]) for i in range(e) for m, experts in enumerate(wanted) if i < len(experts)]
    return pairs[:rows]


def download(table: PoolTable, pool: SlotPool, moe_layers: tuple[int, ...]) -> dict[str, int]:
    """Write the table back into `pool`'s host bookkeeping (each resident's last use: its `keep` less its
    bonus; residents of slots past the pool's are forgotten). -> {name: count since upload} for `COUNTS`."""
    e, s = pool.num_experts, pool.num_slots
    owner, keep = np.asarray(table.owner)[:s], np.asarray(table.keep)[:s].astype(np.int64)
    clock = int(table.clock)
    last_use = keep - np.asarray(table.bonus).reshape(-1)[np.maximum(owner, 0)]
    pool.set_table(np.where(owner >= 0, np.asarray(moe_layers)[np.maximum(owner, 0) // e], -1),
                   np.where(owner >= 0, owner % e, -1), np.where(owner >= 0, last_use, 0), clock)
    counts = dict(zip(COUNTS, (int(v) for v in np.asarray(table.counts))))
    pool.evictions += counts["evictions"]
    return counts

