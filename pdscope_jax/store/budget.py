"""Byte accounting of everything the offload engine keeps on the accelerator.

Contract: `plan_budget(...)` splits `RuntimeConfig.gpu_memory` into non-expert weights (exact, from their shapes),
the KV cache (exact, for `max_batch` x `max_seq_len`), activations of the largest step (`largest_step`; the caller's
measured figure, `engine.activations`, else the upper estimate `activation_bytes`), transfer staging (the device
copies of staged experts before they are written into their slots: while one layer's copies wait for their slot
write, the next layer's are issued, so two layers) and what is left for the routed-expert slot pool, capped by
`expert_pool`. The pool is a whole number of slots, one slot per expert (gate_up [D,2F] + down [F,D]; quantized:
their integers and scales).
Decode needs neither prefill's activations nor staging: what they hold beyond a decode step's own activations
(`decode_activation_bytes`) is the decode bank, `decode_slots` more slots that exist only while decode runs
(`SlotPool.open_decode_bank`), beside the staging of its fill (`FILL_GROUPS_IN_FLIGHT` groups of
`decode_fill_group` experts: `engine.bank_fill`); `expert_pool` caps the pool and the bank together, and neither
phase's total (`planned`, `planned_decode`) exceeds the budget. When the fixed parts do not fit, it raises
`BudgetError` with every number, before anything is allocated. It never touches a device.
"""

from __future__ import annotations

import dataclasses

from pdscope_jax.config import ModelConfig
from pdscope_jax.errors import InputError
from pdscope_jax.models.experts import GATHER_MAX_ASSIGNMENTS, grouped_tiles
from pdscope_jax.runtime import RuntimeConfig, format_size


FILL_GROUPS_IN_FLIGHT = 2  # groups of the decode bank's fill staged at once: one written while the next crosses
FILL_GROUP_BYTES = 128 * 2**20  # a group's most bytes: over 2 ms of the link, time enough to stage the next
DECODE_MARGIN = 1.25  # a decode step's small carried arrays and the allocator's fragmentation


class BudgetError(InputError):
    """The accelerator budget cannot hold the parts that must live there."""


@dataclasses.dataclass(frozen=True)
class Budget:
    total: int  # RuntimeConfig.gpu_memory
    non_expert: int  # embedding, attention, norms, routers, shared experts, dense MLPs, lm_head
    kv_cache: int
    activations: int
    staging: int  # device copies of staged experts awaiting their slot write (two layers)
    slot_bytes: int  # one expert in a slot
    slots: int  # S: slots in the global pool
    pool_cap: int | None  # RuntimeConfig.expert_pool
    decode_activations: int = 0  # activations of the largest decode step
    activations_measured: bool = False  # `activations` is a measured figure, not `activation_bytes`
    decode_slots: int = 0  # slots of the decode bank: decode only, in prefill's activations and staging
    decode_fill_group: int = 0  # experts a group of the bank's fill stages at once (`fill_group`)

    @property
    def fixed(self) -> int:
        return self.non_expert + self.kv_cache + self.activations + self.staging

    @property
    def pool(self) -> int:
        return self.slots * self.slot_bytes

    @property
    def planned(self) -> int:
        """Everything the engine accounts for on the accelerator in prefill; never above `total`."""
        return self.fixed + self.pool

    @property
    def decode_bank(self) -> int:
        return self.decode_slots * self.slot_bytes

    @property
    def decode_fill_staging(self) -> int:
        """The device copies the bank's fill holds at once beside the bank (`FILL_GROUPS_IN_FLIGHT` groups)."""
        return FILL_GROUPS_IN_FLIGHT * self.decode_fill_group * self.slot_bytes

    @property
    def planned_decode(self) -> int:
        """Everything the engine accounts for on the accelerator in decode; never above `total`."""
        return (self.non_expert + self.kv_cache + self.decode_activations + self.pool + self.decode_bank
                + self.decode_fill_staging)

    def lines(self) -> list[tuple[str, int]]:
        return [("non-expert weights", self.non_expert), ("KV cache", self.kv_cache),
                (f"activations ({'measured' if self.activations_measured else 'estimate'})", self.activations),
                ("transfer staging", self.staging),
                (f"expert slot pool ({self.slots} slots x {format_size(self.slot_bytes)})", self.pool),
                (f"decode bank, in prefill's activations and staging ({self.decode_slots} slots)", self.decode_bank),
                (f"decode bank's fill staging ({FILL_GROUPS_IN_FLIGHT} x {self.decode_fill_group} experts)",
                 self.decode_fill_staging),
                ("budget", self.total)]

    def describe(self) -> str:
        return "; ".join(f"{name} {format_size(value)}" for name, value in self.lines())


def activation_bytes(cfg: ModelConfig, rc: RuntimeConfig, itemsize: int) -> int:
    """Upper estimate of the live temporaries of the largest step (one layer at a time, plus the logits).

    The largest step is a whole prompt of `max_seq_len` tokens at batch 1, or `max_batch` sequences times a
    `prefill_chunk` of tokens otherwise; attention scores span up to `max_seq_len` keys.
    """
    return _step_activation_bytes(cfg, rc, itemsize, *largest_step(rc))


def largest_step(rc: RuntimeConfig) -> tuple[int, int]:
    """(sequences, tokens each) of the largest prefill step: a whole prompt of `max_seq_len` tokens at batch 1,
    else `max_batch` sequences of a `prefill_chunk`."""
    b = rc.max_batch
    return b, rc.max_seq_len if b == 1 else min(rc.prefill_chunk, rc.max_seq_len)


def decode_activation_bytes(cfg: ModelConfig, rc: RuntimeConfig, itemsize: int, kv_cache_bytes: int = 0) -> int:
    """Upper estimate of a decode step's live temporaries: `max_batch` rows of one token over `max_seq_len` keys,
    with the expert copies a device decode step holds (a layer's misses pulled and the next layer's copied ahead:
    two copies per distinct pick, where the host loop gathers one per assignment), plus a second KV cache
    (`kv_cache_bytes`), which a chunk's loop may hold beside the one it carries; times `DECODE_MARGIN`."""
    b, k = rc.max_batch, cfg.num_experts_per_tok
    pulled = 2 * min(b * k, cfg.num_experts)
    return int(DECODE_MARGIN * (_step_activation_bytes(cfg, rc, itemsize, b, 1, copies=pulled) + kv_cache_bytes))


def _step_activation_bytes(cfg: ModelConfig, rc: RuntimeConfig, itemsize: int, b: int, tq: int,
                           copies: int | None = None) -> int:
    """`copies`: whole expert copies the step's experts hold at once (None: one per assignment, as
    `combine_experts` gathers them where it takes that path)."""
    n, tk = b * tq, rc.max_seq_len  # tokens in the step, keys attended
    d, f, k, e = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts_per_tok, cfg.num_experts
    heads = cfg.num_heads
    attn_dim = (cfg.head_dim + cfg.v_head_dim) if cfg.uses_mla else 2 * cfg.num_kv_heads * cfg.head_dim // heads
    hidden = 8 * n * d * 4  # residual, normed input, attention output, MoE parts (float32 bound)
    scores = 2 * b * heads * tq * tk * 4  # scores and probabilities, float32
    keys = b * tk * heads * attn_dim * 4  # MLA re-expands keys/values from the latent
    router = 3 * n * e * 4
    # a gathered expert copy: its stored bytes, and a dequantized copy in the compute dtype when quantized
    copy = cfg.expert_param_count() * itemsize + (cfg.expert_bytes(itemsize) if cfg.expert_quant else 0)
    # sorted combine: gathered rows; the tiled path (taken past GATHER_MAX_ASSIGNMENTS) pads them to whole tiles
    # and may gather each tile's weights
    tile, tiles, batched = grouped_tiles(n * k, e + 1, cfg.expert_param_count() * itemsize)
    tiled = n * k > GATHER_MAX_ASSIGNMENTS
    tile_weights = tiles * copy if tiled and batched else 0
    rows = max(n * k, tiles * tile) if tiled else n * k
    experts = rows * (d * itemsize + 2 * f * 4 + f * itemsize + 2 * d * 4)
    mlp = 3 * n * max(cfg.intermediate_size, f * max(cfg.num_shared_experts, 1)) * 4
    logits = min(n, 256) * cfg.vocab_size * 4  # logits are produced in slices of at most 256 rows
    # With few tokens, combine_experts gathers one weight copy per (token, expert) assignment.
    gathered = (0 if tiled else n * k) if copies is None else copies
    return int(1.1 * (hidden + scores + keys + router + experts + mlp + logits) + gathered * copy + tile_weights)


def plan_budget(cfg: ModelConfig, rc: RuntimeConfig, *, non_expert_bytes: int, kv_cache_bytes: int,
                itemsize: int, activations: int | None = None) -> Budget:
    """Fixed parts first, the slot pool from what is left (see the module docstring); `activations`: a measured
    figure for the largest step (None: `activation_bytes`)."""
    slot_bytes = cfg.expert_bytes(itemsize)
    staging = 2 * slot_bytes * cfg.num_experts
    measured = activations is not None
    activations = activation_bytes(cfg, rc, itemsize) if activations is None else int(activations)
    budget = Budget(total=rc.gpu_memory, non_expert=non_expert_bytes, kv_cache=kv_cache_bytes,
                    activations=activations, staging=staging, slot_bytes=slot_bytes, slots=0,
                    pool_cap=rc.expert_pool, activations_measured=measured,
                    decode_activations=min(activations, decode_activation_bytes(cfg, rc, itemsize, kv_cache_bytes)))
    if budget.fixed > budget.total:
        raise BudgetError(
            f"gpu_memory {format_size(rc.gpu_memory)} cannot hold what must live on the accelerator: "
            f"{budget.describe()}; fixed parts need {format_size(budget.fixed)}. Raise gpu_memory, or lower "
            f"max_batch ({rc.max_batch}) / max_seq_len ({rc.max_seq_len}) / prefill_chunk ({rc.prefill_chunk})."
        )
    left = budget.total - budget.fixed
    if rc.expert_pool is not None:
        left = min(left, rc.expert_pool)
    experts = len(cfg.moe_layers) * cfg.num_experts
    slots = min(left // slot_bytes, experts)
    if not rc.decode_bank:
        return dataclasses.replace(budget, slots=int(slots))
    room = budget.activations + budget.staging - budget.decode_activations  # what decode leaves of prefill's parts
    bank_cap = experts - slots
    if rc.expert_pool is not None:
        bank_cap = min(bank_cap, (rc.expert_pool - slots * slot_bytes) // slot_bytes)
    bank = decode_bank_slots(room // slot_bytes, len(cfg.moe_layers), bank_cap, slot_bytes)
    return dataclasses.replace(budget, slots=int(slots), decode_slots=bank,
                               decode_fill_group=fill_group(bank, len(cfg.moe_layers), slot_bytes))


def fill_group(bank: int, layers: int, slot_bytes: int) -> int:
    """Experts the fill of a bank of `bank` slots stages at once: a layer's share (rounded up), at most
    `FILL_GROUP_BYTES` of them (at least one expert)."""
    return min(-(-bank // layers), max(1, FILL_GROUP_BYTES // slot_bytes))


def decode_bank_slots(room: int, layers: int, cap: int, slot_bytes: int) -> int:
    """The most decode bank slots, at most `cap`, that fit in `room` slots beside their fill's staging."""
    widest = fill_group(cap, layers, slot_bytes)  # no bank of at most `cap` slots has a larger group
    bank = max(0, min(cap, room - FILL_GROUPS_IN_FLIGHT * widest))
    while bank < cap and bank + 1 + FILL_GROUPS_IN_FLIGHT * fill_group(bank + 1, layers, slot_bytes) <= room:
        bank += 1
    return int(bank)
