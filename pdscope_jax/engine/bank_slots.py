"""The device decode step's banks: the slot pool and, while decode runs, its decode bank, slots numbered over them
one after the other (`engine.pool_table`), read and written inside the step's program.

Contract (banks: a tuple of (gate_up [S_i, D, 2F], down [S_i, F, D]) stacks, arrays or QuantizedWeights):
- `take(banks, slots [U]) -> (gate_ups [U, ...], downs [U, ...])`: a gathered copy of the slots' experts.
- `put(banks, target [U], parts) -> banks`: row u of parts written to slot target[u] (past every bank: dropped;
  targets distinct). `put_from(banks, target [R], views, experts [R]) -> banks`: expert experts[r] of the host
  views (gate_up [E, ...], down [E, ...], device-memory aliases of the page-locked stacks) copied into slot
  target[r] by `kernels.row_copy`, which neither copies nor reads a row whose target lies past every bank.
- `bank_of(banks, at [U]) -> (bank index, slot in it)`; `read_in_banks(rows [U, N, D], banks, slots [U])`: the
  picks' expert outputs [U, N, D], each slot's weights read where they lie (`models.experts`), in its own bank.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pdscope_jax.kernels import row_copy
from pdscope_jax.models.experts import gather_sources, slots_experts_ffn, sources_experts_ffn
from pdscope_jax.store.slot_pool import slot_count


def take(banks, slots):
    """(gate_ups, downs) [U, ...] of `slots` [U] numbered over the banks one after the other: every bank gathered
    and the right one selected (`models.experts.gather_sources`), one more read of the picks' bytes per extra bank,
    which a layer's copies cost far more than."""
    return gather_sources(banks, *bank_of(banks, slots))


def put(banks, target, parts):
    """The banks with row u of `parts` written to slot target[u]; a target past every bank is dropped. Targets
    must be distinct."""
    out, base = [], 0
    for bank in banks:
        n = slot_count(bank[0])
        mine = (target >= base) & (target < base + n)
        local = jnp.where(mine, target - base, n + jnp.arange(target.shape[0]))  # out of range: dropped
        out.append(jax.tree.map(lambda pool, part: pool.at[local].set(part, mode="drop", unique_indices=True),
                                bank, parts))
        base += n
    return tuple(out)


def read_in_banks(rows, banks, slots):
    """The picks' expert outputs [U, N, D] for rows [U, N, D] and slots [U] numbered over the banks, each read in
    its own bank (no gathered copy)."""
    if len(banks) == 1:
        return slots_experts_ffn(rows, *banks[0], slots)
    return sources_experts_ffn(rows, banks, *bank_of(banks, slots))


def bank_of(banks, at):
    """(bank index, slot in it) of slots `at` numbered over the banks one after the other (past them all: the
    last bank's numbering, unused)."""
    src, local, base = jnp.zeros_like(at), at, 0
    for i, bank in enumerate(banks):
        n = slot_count(bank[0])
        inside = (at >= base) & (at < base + n)
        src, local = jnp.where(inside, i, src), jnp.where(inside, at - base, local)
        base += n
    return src, local


def put_from(banks, target, views, experts):
    """The banks with expert experts[u] of the host `views` copied into slot target[u] (numbered over the banks);
    a target past every bank copies nothing and reads nothing."""
    out, base = [], 0
    for bank in banks:
        n = slot_count(bank[0])
        local = jnp.where((target >= base) & (target < base + n), target - base, -1)
        out.append(tuple(row_copy.copy_rows(tuple(bank), tuple(views), experts, local)))
        base += n
    return tuple(out)
