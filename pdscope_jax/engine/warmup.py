"""Compiling, before timing, the programs whose use depends on routing (which warm-up's dummy tokens may not hit).

Contract (each runs its programs on zeros or on slots it frees again; the caller resets the pool afterwards):
- `precompile_combine(programs, step_shapes, devices, dtype, hidden, min_rows)`: `moe_combine` for each
  (batch, tokens, padded rows) seen with every mix of parts (GPU only, CPU only, both, neither), the CPU part
  whole (few rows) or compacted to each size it can take, with `take_rows` for those sizes.
- `precompile_slot_writes(pool, store, layer, num_experts)`: the commits of staged copies (power-of-two sizes up
  to the one a whole layer pads to, of experts' arrays and of whole stacks) and the pull-and-commit loads (each
  count up to `FUSED_MAX`), of base copies and, where the store keeps them, of int4 copies.
- `precompile_bank_writes(pool, store, layer, group, slots, pieces=False)`: `store.write_bank` into each shape of
  piece of a decode bank of `slots` rows (`SlotPool.open_decode_bank`; opened for this when closed, closed again)
  for every size a count up to min(group, its rows) pads to: decode's bank fill writes groups of at most `group`
  experts (`engine.bank_fill`), whose counts follow the real prompt's routing, not warm-up's.
"""

from __future__ import annotations

import jax
import numpy as np

from pdscope_jax.engine.cpu_experts import DENSE_MAX_ROWS, compact_sizes
from pdscope_jax.runtime import Devices
from pdscope_jax.store.expert_store import FUSED_MAX, ExpertStore
from pdscope_jax.store.slot_pool import SlotPool, slot_count


def precompile_combine(programs: dict, step_shapes, devices: Devices, dtype, hidden: int, min_rows: int) -> None:
    accel = devices.accel

    def zeros(shape, kind=dtype):
        return jax.device_put(np.zeros(shape, kind), accel)

    for b, t, rows in sorted(step_shapes):
        x, shared, y_gpu = zeros((b, t, hidden)), zeros((b * t, hidden)), zeros((rows, hidden), np.float32)
        if rows <= DENSE_MAX_ROWS:
            cpu_parts = [(zeros((rows, hidden), np.float32), None)]
        else:
            cpu_parts = [(zeros((size, hidden), np.float32), zeros(size, np.int32))
                         for size in compact_sizes(rows, min_rows)]
            for _, take in cpu_parts:
                programs["take_rows"](zeros((rows, hidden)), take)  # h's dtype
        programs["moe_combine"](x, shared, y_gpu, None, None)
        programs["moe_combine"](x, shared, None, None, None)
        for y_cpu, take in cpu_parts:
            programs["moe_combine"](x, shared, None, y_cpu, take)
            programs["moe_combine"](x, shared, y_gpu, y_cpu, take)


def _padded_counts(limit: int, whole_from: int | None = None) -> list[int]:
    """Counts that reach every size a commit of 1..limit experts pads to (powers of two): 1, 2, 4, ..., then limit
    itself (its padded size is the next power of two); none for limit 0. `whole_from`: the least count staged as a
    whole stack (`ExpertStore.whole_from`), so the counts on both sides of it are added (each kind of commit at
    every size it can take)."""
    counts, size = [], 1
    while size < limit:
        counts.append(size)
        size *= 2
    edges = [] if whole_from is None else [n for n in (whole_from - 1, whole_from) if 1 <= n < limit]
    return sorted(set(counts + edges)) + [limit] if limit else []


def precompile_slot_writes(pool: SlotPool, store: ExpertStore, layer: int, num_experts: int) -> None:
    limit = min(num_experts, pool.num_slots)
    for low in (False, True) if store.has_low else (False,):
        for count in _padded_counts(limit, None if low else store.whole_from(layer)):
            experts = np.arange(count)
            pool.release(layer, experts)
            kinds = np.full(experts.size, low)
            store.commit(pool, store.stage(layer, experts, kinds), pool.allocate(layer, experts, low=kinds))
        for size in range(1, min(FUSED_MAX, limit) + 1):
            experts = np.arange(size)
            pool.release(layer, experts)
            kinds = np.full(size, low)
            store.write(pool, layer, experts, pool.allocate(layer, experts, low=kinds), kinds)


def precompile_bank_writes(pool: SlotPool, store: ExpertStore, layer: int, group: int, slots: int,
                           pieces: bool = False) -> None:
    if slots <= 0:
        return
    opened = pool.decode_slots == 0
    pool.open_decode_bank(slots, pieces)
    pooled, *bank = pool.banks
    shapes = set()
    for i, piece in enumerate(bank):
        rows_in_piece = slot_count(piece[0])
        if rows_in_piece in shapes:  # a piece of a shape already written: the same programs
            continue
        shapes.add(rows_in_piece)
        for count in _padded_counts(min(group, rows_in_piece)):
            rows = np.arange(count)
            bank[i] = store.write_bank(bank[i], layer, rows, rows)  # experts 0..n-1 into rows 0..n-1
    pool.banks = (pooled, *bank)
    if opened:
        pool.close_decode_bank()
