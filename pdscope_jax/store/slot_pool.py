"""The one global pool of expert slots on the accelerator, and the table of who lives in which slot.

Contract: `SlotPool(num_slots, ..., quant=None)` allocates gate_up [S, D, 2F] and down [S, F, D] on the
accelerator once (quantized experts: QuantizedWeights of those shapes, `quant.formats`);
they are never reallocated (slot writes donate and replace them in place, see `ExpertStore.commit`). The
table maps (layer, expert) -> slot; `slot_of(layer)` gives the [E] int32 map that `combine_experts` takes
(-1: not in a slot). Slots are handed out free-first, then from the caller's `prefer`red slots, then least
recently used, never taking a slot from a protected layer (the layer being computed), so:
- prefill: streaming layer l+1 while layer l computes takes E slots other than layer l's; with S >= 2E these
  are the two full-layer buffers (`can_double_buffer`): the engine prefers the slots of experts beyond each other
  layer's `even_share` (`over_share`), so every layer keeps an even share resident for decode and the next
  prefill, and the rest of the pool (hot or cached experts within the share) is not streamed again;
- decode: the same slots are an LRU expert cache; whatever prefill left resident seeds it.
`set_table` replaces the whole table with one kept elsewhere (device decode keeps it on the accelerator).
`open_decode_bank(n, pieces=False)` allocates n more slots, numbered S..S+n-1, for device decode alone (the budget's
`decode_slots`, in memory prefill's activations and staging hold), as one array pair or, with `pieces`, pairs of E
slots (the shape of a staged layer, whose freed memory they fit; also where the allocator has no free block for the
one array, or allocating it runs out of memory: what it made is freed first); `banks` is then ((gate_up, down) of
the pool, (gate_up, down) of each piece); `close_decode_bank()` frees it, and whoever kept experts in it forgets
them (the host table covers the pool's S slots only). `reallocate_if_lost()` allocates the arrays again where a
failed program deleted them. An expert counts as resident from the moment its slot is reserved (its copy staged):
the engine commits the copy into the slot before any program of that layer reads the pool. `low` [S] marks the slots
whose expert was copied from the host's int4 copy (`allocate(..., low=)`; `low_of(layer)`), until the slot is
reassigned. The pool holds no host memory and moves no weights itself.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np

from pdscope_jax.quant.formats import zeros


class SlotPool:
    def __init__(self, num_slots: int, moe_layers: tuple[int, ...], num_experts: int, d: int, f: int, dtype,
                 device: jax.Device, quant: str | None = None):
        self.num_slots = int(num_slots)
        self.num_experts = num_experts
        # S == 0 keeps one dummy slot so programs keep a fixed signature; no expert is ever mapped to it.
        self.gate_up, self.down = _allocate(max(self.num_slots, 1), d, f, dtype, quant, device)  # [S,D,2F], [S,F,D]
        self.owner_layer = np.full(self.num_slots, -1, np.int64)  # [S]
        self.owner_expert = np.full(self.num_slots, -1, np.int64)  # [S]
        self.last_use = np.zeros(self.num_slots, np.int64)  # [S] LRU clock value of the last use
        self.low = np.zeros(self.num_slots, bool)  # [S] holds an expert copied from its int4 copy
        self._slot_of = {layer: np.full(num_experts, -1, np.int32) for layer in moe_layers}
        self._clock = 0
        self.evictions = 0
        self._bank: tuple = ()  # the decode bank's pieces, (gate_up, down) each, while open
        self._device, self._shapes = device, (d, f, dtype, quant)

    @property
    def banks(self) -> tuple:
        """((gate_up, down) of the pool,) and, while the decode bank is open, (gate_up, down) of each piece."""
        return ((self.gate_up, self.down),) + self._bank

    @banks.setter
    def banks(self, banks: tuple) -> None:  # a program's donated-and-returned banks
        (self.gate_up, self.down), *rest = banks
        if rest:
            self._bank = tuple(tuple(piece) for piece in rest)

    @property
    def decode_slots(self) -> int:
        """Slots of the open decode bank, its pieces together (0: closed)."""
        return sum(slot_count(gate_up) for gate_up, _ in self._bank)

    def open_decode_bank(self, slots: int, pieces: bool = False) -> None:
        """Allocate `slots` more slots on the pool's device: one array pair, or with `pieces` pairs of E slots each
        (a layer's experts, the last piece the rest); pieces too where the device's allocator says no free block
        holds the one gate_up array, or where allocating the one array runs out of memory (RESOURCE_EXHAUSTED; the
        decode programs then compile for the pieces). Allocated before it returns. No-op for 0, or when open."""
        if slots > 0 and not self._bank:
            unfit = None if pieces else self._why_not_in_one(slots)  # the allocator asked only where it matters
            if unfit:
                _warn_pieces(unfit)
            pieces = pieces or unfit is not None
            try:
                self._bank = self._allocate_bank(slots, pieces)
                return
            except jax.errors.JaxRuntimeError as err:
                if pieces or "RESOURCE_EXHAUSTED" not in str(err):
                    raise
                why = f"its one array could not be allocated ({str(err).splitlines()[0][:160]})"
            _warn_pieces(why)  # out of the handler: the error's traceback, and all it holds, is gone
            self._bank = self._allocate_bank(slots, True)

    def _allocate_bank(self, slots: int, pieces: bool) -> tuple:
        """The bank's (gate_up, down) pairs, allocated and waited on; where that fails, every array it made is freed
        before the error goes on (the traceback would keep them, and the pieces tried next would find no room)."""
        size = self.num_experts if pieces else slots
        bank = []
        try:
            for start in range(0, slots, size):
                bank.append(_allocate(min(size, slots - start), *self._shapes, self._device))
            # a failed allocation raises by here, where the bank can still open in pieces, not in the first program
            # that reads it (the fill's)
            return tuple(jax.block_until_ready(bank))
        except jax.errors.JaxRuntimeError:
            _free(bank)
            raise

    def _why_not_in_one(self, slots: int) -> str | None:
        """Why the allocator cannot hand out a bank of `slots` slots' gate_up in one block; None where it can (or
        does not say: assumed so)."""
        largest = _largest_free(self._device)
        whole = slots * sum(leaf.nbytes for leaf in jax.tree.leaves(self.gate_up)) // slot_count(self.gate_up)
        if largest is None or whole <= largest:
            return None
        return f"no free block of the device's allocator holds its {whole / 1e9:.2f} GB array (largest " \
               f"{largest / 1e9:.2f} GB)"

    def close_decode_bank(self) -> None:
        self._bank = ()  # the arrays' last references: their memory returns to the allocator

    @property
    def can_double_buffer(self) -> bool:
        """Two whole layers fit: prefill can stream layer l+1 while layer l computes."""
        return self.num_slots >= 2 * self.num_experts

    @property
    def even_share(self) -> int:
        """Experts a layer keeps when prefill streams through two whole-layer buffers and every other MoE layer
        keeps as many: (S - 2E) // (layers - 2) (every expert with at most two MoE layers; 0 without the buffers)."""
        layers = len(self._slot_of)
        if not self.can_double_buffer:
            return 0
        return self.num_experts if layers <= 2 else min(self.num_experts,
                                                         (self.num_slots - 2 * self.num_experts) // (layers - 2))

    def over_share(self, share: int, exclude: tuple[int, ...], wanted=None) -> np.ndarray:
        """Slots holding experts beyond `share` in their layer (layers in `exclude` left out): each such layer's
        least wanted residents, by `wanted(layer)` [E] scores (higher kept; None: all alike), ties the higher ids."""
        out = []
        for layer, slot_of in self._slot_of.items():
            resident = np.flatnonzero(slot_of >= 0)
            if layer in exclude or resident.size <= share:
                continue
            scores = np.zeros(slot_of.size) if wanted is None else np.asarray(wanted(layer), np.float64)
            order = np.lexsort((-resident, scores[resident]))
            out.append(slot_of[resident[order[: resident.size - share]]])
        return np.concatenate(out).astype(np.int64) if out else np.zeros(0, np.int64)

    def slot_of(self, layer: int) -> np.ndarray:
        """[E] int32: each expert's slot, -1 when not resident. A copy."""
        return self._slot_of[layer].copy()

    def resident(self, layer: int) -> np.ndarray:
        return self._slot_of[layer] >= 0  # [E] bool

    def low_of(self, layer: int) -> np.ndarray:
        """[E] bool: experts of `layer` resident in a slot their int4 copy was loaded into."""
        slots = self._slot_of[layer]
        return (slots >= 0) & self.low[np.maximum(slots, 0)] if self.num_slots else np.zeros(slots.size, bool)

    def touch(self, layer: int, experts: np.ndarray) -> None:
        """Mark experts of `layer` as used now (LRU)."""
        self._clock += 1
        slots = self._slot_of[layer][np.asarray(experts, np.int64)]
        self.last_use[slots[slots >= 0]] = self._clock

    def free_slots(self, protect: tuple[int, ...] = ()) -> int:
        """Slots that can be (re)assigned without evicting an expert of a protected layer."""
        return self.num_slots - sum(int(np.count_nonzero(self.owner_layer == layer)) for layer in set(protect))

    def allocate(self, layer: int, experts: np.ndarray, protect: tuple[int, ...] = (),
                 prefer: np.ndarray | None = None, low=False) -> np.ndarray:
        """Assign slots to `experts` of `layer` (none may be resident yet): free slots first, then the slots in
        `prefer`, then LRU victims, never a slot of a layer in `protect` (the target layer's other experts are
        evictable unless it is protected too). `low` (bool, or [n] bool): their copies come from the int4 copy.

        Returns the slots [n] in the order of `experts`. Raises ValueError when not enough slots are free.
        """
        experts = np.asarray(experts, np.int64)
        if experts.size == 0:
            return np.zeros(0, np.int32)
        if np.any(self._slot_of[layer][experts] >= 0):
            raise ValueError(f"layer {layer}: experts {experts[self._slot_of[layer][experts] >= 0]} already resident")
        candidates = np.flatnonzero(~np.isin(self.owner_layer, protect))
        if candidates.size < experts.size:
            raise ValueError(f"layer {layer}: {experts.size} slots needed, {candidates.size} can be freed "
                             f"(pool of {self.num_slots}, protected layers {protect})")
        rank = np.where(self.owner_layer[candidates] < 0, 0, 2)  # free, then preferred, then the rest
        if prefer is not None:
            rank[(rank == 2) & np.isin(candidates, prefer)] = 1
        order = np.lexsort((self.last_use[candidates], rank))
        slots = candidates[order[: experts.size]]
        for slot in slots[self.owner_layer[slots] >= 0]:
            self._slot_of[int(self.owner_layer[slot])][self.owner_expert[slot]] = -1
            self.evictions += 1
        self._clock += 1
        self.owner_layer[slots], self.owner_expert[slots] = layer, experts
        self.last_use[slots] = self._clock
        self.low[slots] = low
        self._slot_of[layer][experts] = slots
        return slots.astype(np.int32)

    def set_table(self, owner_layer: np.ndarray, owner_expert: np.ndarray, last_use: np.ndarray, clock: int) -> None:
        """Replace the table with one kept elsewhere (`engine.device_decode` keeps it on the accelerator in
        decode): each slot's owner (-1: free) and LRU clock; the expert -> slot maps follow from the owners."""
        owner_layer, owner_expert = np.asarray(owner_layer, np.int64), np.asarray(owner_expert, np.int64)
        # a slot keeps its low mark while it keeps its expert: device decode copies the stored precision alone
        self.low &= (owner_layer == self.owner_layer) & (owner_expert == self.owner_expert)
        self.owner_layer, self.owner_expert = owner_layer, owner_expert
        self.last_use = np.asarray(last_use, np.int64)
        for layer, slot_of in self._slot_of.items():
            slot_of[:] = -1
            mine = np.flatnonzero(self.owner_layer == layer)
            slot_of[self.owner_expert[mine]] = mine
        self._clock = max(self._clock, int(clock))

    def reallocate_if_lost(self) -> bool:
        """Allocate gate_up and down again, zeroed, where a failed program they were donated to deleted them (the
        table is the caller's to reset: their experts are gone) -> whether they had been deleted."""
        if not any(a.is_deleted() for a in jax.tree.leaves((self.gate_up, self.down))):
            return False
        self.gate_up = self.down = None  # the deleted arrays' last references, before the new ones are allocated
        self.gate_up, self.down = _allocate(max(self.num_slots, 1), *self._shapes, self._device)
        return True

    def release(self, layer: int, experts: np.ndarray) -> None:
        """Free the slots of `experts` of `layer` (host copies always exist, so this moves nothing)."""
        experts = np.asarray(experts, np.int64)
        slots = self._slot_of[layer][experts]
        slots = slots[slots >= 0]
        self.owner_layer[slots], self.owner_expert[slots] = -1, -1
        self.last_use[slots] = 0
        self.low[slots] = False
        self._slot_of[layer][experts] = -1


def slot_count(gate_up) -> int:
    """Slots of a bank's gate_up (an array or a quantized pytree) [S, ...]."""
    return jax.tree.leaves(gate_up)[0].shape[0]


def _warn_pieces(why: str) -> None:
    """Say that the decode bank opens in pieces instead of its one array, why, and the setting that avoids it
    (from `open_decode_bank`: warned where that was called)."""
    warnings.warn(f"decode bank: {why}: allocated in pieces of a layer's experts instead; `decode_bank_pieces=True` "
                  "compiles for them from the start", stacklevel=3)


def _largest_free(device: jax.Device) -> int | None:
    """The largest block `device`'s allocator could hand out now: its largest free block, or what it may still
    grow by where that is more (None where it does not say both, as on the CPU)."""
    stats = device.memory_stats() or {}
    if not {"largest_free_block_bytes", "pool_bytes", "bytes_limit"} <= stats.keys():
        return None
    return max(int(stats["largest_free_block_bytes"]), int(stats["bytes_limit"]) - int(stats["pool_bytes"]))


def _allocate(slots: int, d: int, f: int, dtype, quant: str | None, device: jax.Device) -> tuple:
    """Zeroed gate_up [slots, D, 2F] and down [slots, F, D] on `device` (quantized: QuantizedWeights). Where down
    cannot be allocated, gate_up is freed before the error goes on."""
    sharding = jax.sharding.SingleDeviceSharding(device, memory_kind="device")

    def zeroed(rows: int, cols: int):
        if quant is None:
            return jax.device_put(jnp.zeros((slots, rows, cols), dtype), sharding)
        # experts stored quantized: each slot holds integers and scales (QuantizedWeights)
        return jax.device_put(zeros((slots,), rows, cols, quant, dtype), sharding)

    gate_up = zeroed(d, 2 * f)
    try:
        return gate_up, zeroed(f, d)
    except jax.errors.JaxRuntimeError:
        _free(gate_up)
        raise


def _free(arrays) -> None:
    """Free the device memory of every array in `arrays` (any pytree) now, whoever still refers to them."""
    for array in jax.tree.leaves(arrays):
        if not array.is_deleted():
            array.delete()
