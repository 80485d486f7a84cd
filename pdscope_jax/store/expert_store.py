"""The expert store: the only code that moves routed-expert weights; nothing writes their host copy once made.

Contract:
- Host copy, once: `add_layer(layer, gate_up [E,D,2F], down [E,F,D])` copies a layer (numpy, or a jax array
  anywhere) into the accelerator's `pinned_host` memory, one array per expert and weight, keeping no reference.
- CPU view, no second copy: CPU-backend arrays alias the pinned bytes, verified per expert (address and bytes); else
  a CPU copy, reported by `host_bytes_per_model_byte` (1.0: all alias, 2.0: none). `cpu_view="copy"` forces copies.
- Who allocates: `host_alloc="jax"` (device_put into pinned_host) or `"driver"` (a buffer per layer stack page-locked
  through the CUDA driver, imported zero-copy: `store.page_locked`); `"auto"`: the driver on a GPU, else jax.
  `expect_stacks(sizes)` page-locks the stacks to come on threads; `loaded()` ends that.
- Layer stacks: `layer_stacks(layer)` -> pinned (gate_up, down) [E, ...] for programs that index experts on the
  device: free with the driver, else only with `stacks=True` (a second pinned copy). `layer_device_views(layer)`
  -> the driver's stacks as device-memory aliases a program reads over PCIe, or None.
- Moving, in two steps so copies overlap compute: `stage(layer, experts) -> Staged` issues ONE batched `device_put`
  and returns at once: of the experts' arrays, or of the layer's whole stack where that costs less (`moves_whole`:
  each copy has a fixed cost, and small experts have many arrays). `commit(pool, staged, slots)` writes them into
  their slots with ONE program donating the pool, compiled per power-of-two count (padding writes idempotently or
  nowhere). `count_staged` counts the bytes a stage moves, `count_moved` the experts' own; the caller's thread
  counts (`bytes_moved`), staging may run on another. `write(pool, layer, experts, slots) -> Written` loads now:
  up to `FUSED_MAX` experts in ONE pull-and-commit program, more by stage + commit. `write_bank` does the same
  into a decode bank.
- Native readers: `host_addresses(layer)` -> where a layer's bf16, int8 or int4 experts lie (`cpu_ffn.HostWeights`,
  `store.host_addresses`).
- Int4 copies (`store.low_copies`): `add_low_layer` pins a layer's too (`low_bytes`); `stage`, `write`, `count_moved`
  take `low` ([n] bool) to move them, turned into the pool's format as they are written (one program per kind).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from pdscope_jax.kernels import row_copy
from pdscope_jax.kernels.cpu_ffn import HostWeights
from pdscope_jax.runtime import Devices
from pdscope_jax.store import page_locked
from pdscope_jax.store.host_addresses import host_view, host_weights
from pdscope_jax.store.low_copies import to_slot
from pdscope_jax.store.slot_pool import SlotPool


FUSED_MAX = 8  # `write` moves at most this many experts in one pull-and-commit program
# What `moves_whole` weighs: one host-to-device copy's own cost beside its bytes, and the link's rate (measured on
# the benchmark node: docs/MEASUREMENTS.md)
COPY_SECONDS = 50e-6
LINK_BYTES_PER_SECOND = 50e9
DEVICE = jax.memory.Space.Device
EXACT_PULLS = 8  # `pull_traced` copies exactly the misses up to this many (batch 1: top-k <= 8 in every preset)


def _commit_slots(pool_gu, pool_dn, gus, dns, slots, low=False):
    """pool_gu [S,D,2F], pool_dn [S,F,D]; gus/dns: n device arrays [D,2F]/[F,D]; slots [n] int32. Arrays or
    QuantizedWeights (each of their parts is written); `low`: int4 copies, turned into the pool's format first."""
    if low:
        gus, dns = [to_slot(gu, pool_gu) for gu in gus], [to_slot(dn, pool_dn) for dn in dns]
    for i, (gu, dn) in enumerate(zip(gus, dns)):
        def put(pool, part):
            return jax.lax.dynamic_update_slice(pool, part[None], (slots[i], 0, 0))
        pool_gu, pool_dn = jax.tree.map(put, pool_gu, gu), jax.tree.map(put, pool_dn, dn)
    return pool_gu, pool_dn


def _pull_into_slots(pool_gu, pool_dn, gus, dns, slots, low=False):
    """As `_commit_slots`, with gus/dns in pinned host memory: the program copies them to device memory itself.
    -> (pool_gu, pool_dn, slots): the slots come back as the small output a waiter can block on."""
    gus = [jax.device_put(a, DEVICE) for a in gus]
    dns = [jax.device_put(a, DEVICE) for a in dns]
    return (*_commit_slots(pool_gu, pool_dn, gus, dns, slots, low), slots + 0)


@dataclasses.dataclass(frozen=True)
class Written:
    """What `ExpertStore.write` did: bytes moved, and an array ready when the experts are in their slots."""

    nbytes: int
    done: jax.Array


@dataclasses.dataclass(frozen=True)
class Staged:
    """Experts of one layer in flight to (or already in) accelerator device memory, not yet in their slots."""

    layer: int
    experts: np.ndarray  # [n] expert ids
    gate_ups: tuple[jax.Array, ...]  # n x [D, 2F] on the accelerator
    downs: tuple[jax.Array, ...]  # n x [F, D]
    nbytes: int
    low: np.ndarray | None = None  # [n] bool: int4 copies (None: none)
    stack: tuple | None = None  # the layer's whole (gate_up, down) [E, ...] when it moved whole (no per-expert arrays)

    @property
    def arrays(self) -> list[jax.Array]:
        """Every array the copy writes on the accelerator (ready when the copy is)."""
        return jax.tree.leaves((self.gate_ups, self.downs, self.stack))


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


class ExpertStore:
    def __init__(self, devices: Devices, cpu_view: str = "alias", host_alloc: str = "auto", stacks: bool = False):
        if cpu_view not in ("alias", "copy"):
            raise ValueError(f"cpu_view must be 'alias' or 'copy', got {cpu_view!r}")
        if host_alloc not in ("auto", "jax", "driver"):
            raise ValueError(f"host_alloc must be 'auto', 'jax' or 'driver', got {host_alloc!r}")
        on_gpu = devices.accel.platform == "gpu"
        if host_alloc == "auto":
            host_alloc = "driver" if on_gpu and page_locked.driver_ready() else "jax"
        if host_alloc == "driver" and not (on_gpu and page_locked.driver_ready()):
            raise ValueError("host_alloc='driver' page-locks memory through the CUDA driver (libcuda.so.1) for a GPU "
                             f"accelerator; this one is {devices.accel.platform!r}: use host_alloc='jax'")
        self.devices = devices
        self.cpu_view = cpu_view
        self.host_alloc = host_alloc
        self.stacks = stacks or host_alloc == "driver"
        self._stacks: dict[int, tuple[jax.Array, jax.Array]] = {}  # layer -> (gate_up, down) stacks, pinned
        self._stack_parts: dict[int, tuple] = {}  # layer -> per stack (its tree structure, its PinnedStacks)
        self.stack_copy_bytes = 0  # bytes of stacks that are a second copy (host_alloc='jax')
        self._alias_checked = False  # one CPU alias's values compared in full with its pinned array
        self._page_locked: list = []  # host_alloc='driver': the PinnedStacks every view points into
        self._maker = page_locked.BufferMaker(devices.accel.local_hardware_id) if host_alloc == "driver" else None
        self._pinned = jax.sharding.SingleDeviceSharding(devices.accel, memory_kind="pinned_host")
        self._device = jax.sharding.SingleDeviceSharding(devices.accel, memory_kind="device")
        self._host: dict[int, tuple[list[jax.Array], list[jax.Array]]] = {}  # layer -> (gate_ups, downs) pinned
        self._cpu: dict[int, tuple[list[jax.Array], list[jax.Array]]] = {}  # layer -> CPU-backend arrays
        self.host_bytes = 0  # pinned bytes (the model's experts, once)
        self.cpu_copy_bytes = 0  # bytes of CPU copies made where a view could not alias
        self.bytes_moved = 0  # host -> accelerator bytes staged since construction (preloads included)
        self._low: dict[int, tuple[list[jax.Array], list[jax.Array]]] = {}  # layer -> int4 copies, pinned
        self.low_bytes = 0  # pinned bytes of the int4 copies
        self._commit = {low: jax.jit(functools.partial(_commit_slots, low=low), donate_argnums=(0, 1))
                        for low in (False, True)}
        self._pull = {low: jax.jit(functools.partial(_pull_into_slots, low=low), donate_argnums=(0, 1))
                      for low in (False, True)}
        # a whole stack's rows into slots (-1: padding, copied nowhere), the pool (or bank) donated
        self._commit_whole = jax.jit(row_copy.copy_rows, donate_argnums=0)
        self._commit_sizes: set[tuple[int, bool | str]] = set()
        self._pull_sizes: set[tuple[int, bool]] = set()

    # ---- building --------------------------------------------------------------------------------------
    def add_layer(self, layer: int, gate_up, down) -> None:
        """Take layer `layer`'s stacked experts gate_up [E,D,2F], down [E,F,D] into pinned memory, per expert (and
        as whole-layer stacks: see `layer_stacks`)."""
        host, cpu, stacks, pinned_parts = ([], []), ([], []), [], []
        for part, stack in enumerate((gate_up, down)):
            views = None
            if self.host_alloc == "driver":  # one buffer per layer stack: its experts alias it
                whole, experts, views, parts = self._page_locked_parts(stack)
                stacks.append(whole)
                pinned_parts.append(parts)
            else:  # a device array goes straight to pinned memory (device-to-host), numpy by a host copy
                experts = [jax.device_put(stack[e], self._pinned) for e in range(stack.shape[0])]
                jax.block_until_ready(experts)
                if self.stacks:
                    whole = jax.device_put(stack, self._pinned)
                    stacks.append(whole)
                    self.stack_copy_bytes += whole.nbytes
            for e, pinned in enumerate(experts):
                host[part].append(pinned)
                cpu[part].append(self._cpu_array(pinned, None if views is None else views[e]))
                self.host_bytes += pinned.nbytes
        self._host[layer], self._cpu[layer] = host, cpu
        if stacks:
            self._stacks[layer] = (stacks[0], stacks[1])
        if pinned_parts:
            self._stack_parts[layer] = tuple(pinned_parts)

    def add_low_layer(self, layer: int, gate_up, down) -> None:
        """Keep layer `layer`'s int4 copies (QuantizedWeight stacks, `low_copies.low_copy`) in pinned memory, per
        expert."""
        parts = []
        for stack in (gate_up, down):
            experts = [jax.device_put(stack[e], self._pinned) for e in range(stack.shape[0])]
            jax.block_until_ready(experts)
            self.low_bytes += sum(w.nbytes for w in experts)
            parts.append(experts)
        self._low[layer] = (parts[0], parts[1])

    @property
    def has_low(self) -> bool:
        """Whether the store keeps int4 copies (a quality that loads them)."""
        return bool(self._low)

    def expect_stacks(self, sizes) -> None:
        """The byte sizes of the layer stacks (and their scales) `add_layer` will take, in any order: with
        host_alloc='driver' they are page-locked on threads from now on, ahead of the layers that need them."""
        if self._maker is not None:
            self._maker.expect(sizes)

    def loaded(self) -> None:
        """Every layer is added: stop page-locking ahead (buffers expected and not taken are freed)."""
        if self._maker is not None:
            self._maker.close()
            self._maker = None

    def _page_locked_parts(self, stack):
        """Each array of `stack` (an array, or a QuantizedWeight's integers and scales) in one page-locked buffer
        (`page_locked.pin_stack`, made ahead where expected). -> (the stack, its E experts, their E numpy views), each
        in `stack`'s structure, and (the structure, its PinnedStacks) for `layer_device_views`."""
        leaves, structure = jax.tree.flatten(stack)
        parts = [page_locked.pin_stack(leaf, self.devices.accel,
                                       None if self._maker is None else self._maker.take(leaf.nbytes))
                 for leaf in leaves]
        self._page_locked.extend(parts)
        experts = range(parts[0].view.shape[0])
        return (structure.unflatten([p.whole for p in parts]),
                [structure.unflatten([p.experts[e] for p in parts]) for e in experts],
                [structure.unflatten([p.view[e] for p in parts]) for e in experts], (structure, parts))

    def _cpu_array(self, pinned, view):
        """The CPU-backend array (or QuantizedWeight) for one expert weight: each part a zero-copy alias of its
        pinned bytes where verified. `view`: None, or numpy views of the parts in `pinned`'s structure."""
        if view is None:
            return jax.tree.map(lambda part: self._cpu_part(part, None), pinned)
        return jax.tree.map(self._cpu_part, pinned, view)

    def _cpu_part(self, pinned: jax.Array, view: np.ndarray | None) -> jax.Array:
        if self.cpu_view == "alias":
            view = host_view(pinned) if view is None else view
            if view is not None and self._reads_same_bytes(pinned, view):
                on_cpu = jax.device_put(view, self.devices.cpu)
                if on_cpu.unsafe_buffer_pointer() == view.ctypes.data:
                    return on_cpu
        on_cpu = jax.device_put(np.asarray(pinned), self.devices.cpu)
        self.cpu_copy_bytes += on_cpu.nbytes
        return on_cpu

    def _reads_same_bytes(self, pinned: jax.Array, view: np.ndarray) -> bool:
        """Whether `view` is `pinned`'s memory: the same address, and the same values compared in full once per store
        (that the backend's address is the bytes themselves) and for every array whose address is unavailable.
        Not every array in full: that would read all experts twice more at every start."""
        try:
            same_address = pinned.unsafe_buffer_pointer() == view.ctypes.data
        except Exception:  # noqa: BLE001 (backends differ in what they refuse; compare the values instead)
            same_address = None
        if same_address is False:
            return False
        if same_address and self._alias_checked:
            return True
        same = np.array_equal(view, np.asarray(pinned))
        self._alias_checked = self._alias_checked or bool(same and same_address)
        return same

    # ---- queries ---------------------------------------------------------------------------------------
    @property
    def host_bytes_per_model_byte(self) -> float:
        """Host bytes held per byte of routed-expert weights: 1.0 when every CPU view aliases pinned memory."""
        extra = self.cpu_copy_bytes + self.stack_copy_bytes + self.low_bytes
        return (self.host_bytes + extra) / max(self.host_bytes, 1)

    @property
    def compiled_programs(self) -> int:
        """Commit and pull programs compiled: one per count, kind and target (the pool, or a decode bank)."""
        sizes = [getattr(fn, "_cache_size", None)
                 for fn in (*self._commit.values(), *self._pull.values(), self._commit_whole)]
        if all(sizes):  # jax's own count (private, present in 0.10-0.12)
            return sum(size() for size in sizes)
        return len(self._commit_sizes) + len(self._pull_sizes)  # the counts and kinds seen

    def _sources(self, layer: int, experts: np.ndarray, low: np.ndarray | None) -> tuple[list, list]:
        """(gate_ups, downs) of `experts` of `layer` in pinned memory: the int4 copy where `low` says so."""
        base, copies = self._host[layer], self._low.get(layer)
        low = np.zeros(len(experts), bool) if low is None else np.asarray(low, bool)
        picked = [(copies if is_low else base, e) for e, is_low in zip(np.asarray(experts, np.int64), low)]
        return [src[0][e] for src, e in picked], [src[1][e] for src, e in picked]

    def expert_nbytes(self, layer: int, experts: np.ndarray, low: np.ndarray | None = None) -> int:
        gus, dns = self._sources(layer, experts, low)
        return int(sum(gu.nbytes + dn.nbytes for gu, dn in zip(gus, dns)))

    def count_moved(self, layer: int, experts: np.ndarray, low: np.ndarray | None = None) -> int:
        """Add the bytes of `experts` of `layer` (int4 copies where `low`) to `bytes_moved` (on the caller's
        thread: `stage` may run on a helper thread and counts nothing). -> those bytes."""
        nbytes = self.expert_nbytes(layer, experts, low)
        self.bytes_moved += nbytes
        return nbytes

    def count_staged(self, layer: int, experts: np.ndarray, low: np.ndarray | None = None) -> int:
        """As `count_moved`, for the bytes `stage(layer, experts, low)` moves: the whole stack's where it moves
        whole. -> those bytes."""
        if not self.moves_whole(layer, len(experts), low):
            return self.count_moved(layer, experts, low)
        nbytes = self._stack_nbytes(layer)
        self.bytes_moved += nbytes
        return nbytes

    def _stack_nbytes(self, layer: int) -> int:
        return int(sum(leaf.nbytes for leaf in jax.tree.leaves(self._stacks[layer])))

    def moves_whole(self, layer: int, count: int, low: np.ndarray | None = None) -> bool:
        """Whether staging `count` experts of `layer` copies the layer's whole stack: the store keeps it, no int4
        copy is asked for, and `count` experts' arrays, one copy each, would cost more than every expert's bytes
        in one copy per array of the stack (`COPY_SECONDS`, `LINK_BYTES_PER_SECOND`)."""
        if count <= 0 or layer not in self._stacks or (low is not None and np.asarray(low, bool).any()):
            return False
        leaves = jax.tree.leaves(self._stacks[layer])
        total, arrays = self._stack_nbytes(layer), len(leaves)
        each = total / leaves[0].shape[0]
        one_by_one = count * (arrays * COPY_SECONDS + each / LINK_BYTES_PER_SECOND)
        return arrays * COPY_SECONDS + total / LINK_BYTES_PER_SECOND < one_by_one

    def whole_from(self, layer: int) -> int | None:
        """The least count `moves_whole` stages whole for `layer` (it does for every larger one), or None."""
        if layer not in self._stacks:
            return None
        experts = jax.tree.leaves(self._stacks[layer])[0].shape[0]
        return next((n for n in range(1, experts + 1) if self.moves_whole(layer, n)), None)

    def cpu_weights(self, layer: int, expert: int) -> tuple[jax.Array, jax.Array]:
        """(gate_up [D,2F], down [F,D]) of one expert on the CPU backend (aliasing the pinned copy when possible)."""
        gus, dns = self._cpu[layer]
        return gus[expert], dns[expert]

    def layer_stacks(self, layer: int) -> tuple[jax.Array, jax.Array] | None:
        """(gate_up [E,D,2F], down [E,F,D]) of a layer in pinned_host memory, or None when not kept: a program can
        index them with an index it computed (`engine.device_decode`)."""
        return self._stacks.get(layer)

    def layer_device_views(self, layer: int) -> tuple | None:
        """(gate_up [E,D,2F], down [E,F,D]) of a layer as device-memory aliases of its page-locked stacks (a program
        reads an expert in place, over PCIe), or None where there are none."""
        if layer not in self._stack_parts:
            return None
        views = []
        for structure, parts in self._stack_parts[layer]:
            leaves = [p.device_view for p in parts]
            if any(leaf is None for leaf in leaves):
                return None
            views.append(structure.unflatten(leaves))
        return views[0], views[1]

    def layer_experts(self, layer: int) -> tuple[tuple[jax.Array, ...], tuple[jax.Array, ...]]:
        """(gate_ups, downs): a layer's E per-expert arrays in pinned_host memory."""
        gus, dns = self._host[layer]
        return tuple(gus), tuple(dns)

    def host_addresses(self, layer: int) -> HostWeights | None:
        """Where each expert's pinned bytes of `layer` lie, for native code that reads them in place
        (`store.host_addresses.host_weights`); None where the kernel cannot read them."""
        return host_weights(*self._host[layer])

    def host_weights(self, layer: int, expert: int) -> tuple[jax.Array, jax.Array]:
        """(gate_up, down) of one expert in pinned_host memory."""
        gus, dns = self._host[layer]
        return gus[expert], dns[expert]

    # ---- moving ----------------------------------------------------------------------------------------
    def stage(self, layer: int, experts: np.ndarray, low: np.ndarray | None = None, whole: bool = True) -> Staged:
        """Issue the host-to-device copy of `experts` of `layer` (int4 copies where `low`; one batched
        device_put, of the layer's whole stack where `whole` and `moves_whole`); returns at once. Safe to call from
        another thread: it counts nothing (`count_staged` does, on the caller's thread)."""
        experts = np.asarray(experts, np.int64)
        if whole and self.moves_whole(layer, experts.size, low):
            return Staged(layer, experts, (), (), self._stack_nbytes(layer),
                          stack=tuple(jax.device_put(self._stacks[layer], self._device)))
        srcs = self._sources(layer, experts, low)
        on_device = jax.device_put(srcs, self._device) if experts.size else ([], [])
        return Staged(layer, experts, tuple(on_device[0]), tuple(on_device[1]),
                      self.expert_nbytes(layer, experts, low), None if low is None else np.asarray(low, bool))

    def commit(self, pool: SlotPool, staged: Staged, slots: np.ndarray) -> None:
        """Copy staged experts into `slots` of `pool` (one donated program; ordered after earlier pool readers)."""
        pool.gate_up, pool.down = self._committed((pool.gate_up, pool.down), staged, slots)

    def write_bank(self, bank: tuple, layer: int, experts: np.ndarray, rows: np.ndarray) -> tuple:
        """`experts` of `layer` into `rows` of a decode bank (gate_up, down) (`SlotPool.banks`' second) -> the bank
        after (donated: one program, ordered after its earlier readers); the experts' own arrays are staged (never
        the whole stack: the bank's fill stages no more than it writes), and their bytes count as moved."""
        experts = np.asarray(experts, np.int64)
        self.count_moved(layer, experts)
        return self.commit_bank(bank, self.stage(layer, experts, whole=False), rows)

    def commit_bank(self, bank: tuple, staged: Staged, rows: np.ndarray) -> tuple:
        """`staged` written into `rows` of a decode bank -> the bank after (donated; one program)."""
        return self._committed(bank, staged, rows)

    def _committed(self, bank: tuple, staged: Staged, slots: np.ndarray) -> tuple:
        """(gate_up, down) of `bank` with the staged experts written into `slots` (donated; one program per kind
        of copy), padded to a power of two by repeating the last (an idempotent write), so few sizes compile;
        nothing staged: `bank` as it was. A whole stack staged: its rows copied, padded with rows copied nowhere."""
        if staged.stack is not None:
            n = staged.experts.size
            size = _pow2(n)
            self._commit_sizes.add((size, "whole"))
            rows = np.zeros(size, np.int32)
            rows[:n] = staged.experts
            slot_ids = np.full(size, -1, np.int32)
            slot_ids[:n] = slots
            return self._commit_whole(tuple(bank), staged.stack, rows, slot_ids)
        low = np.zeros(staged.experts.size, bool) if staged.low is None else staged.low
        for kind in (False, True):
            picked = np.flatnonzero(low == kind)
            n = picked.size
            if n == 0:
                continue
            size = _pow2(n)
            pad = picked[np.concatenate([np.arange(n), np.full(size - n, n - 1)])]
            slot_ids = np.asarray(slots, np.int32)[pad]  # host: the jitted commit places it beside the pool
            self._commit_sizes.add((size, kind))
            bank = self._commit[kind](*bank, tuple(staged.gate_ups[i] for i in pad),
                                      tuple(staged.downs[i] for i in pad), slot_ids)
        return bank

    def write(self, pool: SlotPool, layer: int, experts: np.ndarray, slots: np.ndarray,
              low: np.ndarray | None = None) -> Written:
        """`experts` of `layer` (int4 copies where `low`) into `slots` now (ordered after every earlier reader of
        the pool): one pull-and-commit program per kind of copy for up to FUSED_MAX experts, else stage + commit."""
        experts = np.asarray(experts, np.int64)
        slot_ids = np.asarray(slots, np.int32)
        if experts.size > FUSED_MAX:
            nbytes = self.count_staged(layer, experts, low)
            staged = self.stage(layer, experts, low)
            self.commit(pool, staged, slot_ids)
            return Written(nbytes, staged.arrays[-1])  # the copy's end; the commit follows in order
        nbytes = self.count_moved(layer, experts, low)
        low = np.zeros(experts.size, bool) if low is None else np.asarray(low, bool)
        done = None
        for kind in (False, True):
            picked = np.flatnonzero(low == kind)
            if picked.size:
                gus, dns = self._sources(layer, experts[picked], low[picked])
                pool.gate_up, pool.down, done = self._pull[kind](pool.gate_up, pool.down, tuple(gus), tuple(dns),
                                                                 slot_ids[picked])
                self._pull_sizes.add((picked.size, kind))
        return Written(nbytes, done)


def _copy_expert(gate_ups, downs, expert):
    """Expert `expert` (a traced index) of one layer, from per-expert pinned arrays into device memory."""
    def branch(j):
        return lambda: (jax.device_put(gate_ups[j], DEVICE), jax.device_put(downs[j], DEVICE))
    return jax.lax.switch(expert, [branch(j) for j in range(len(gate_ups))])


def pull_counts(u: int) -> list[int]:
    """How many experts the branches of `pull_traced` copy for U picks: every count up to EXACT_PULLS, then powers
    of two and U itself, so a program holds O(U) copies rather than O(U^2)."""
    counts = set(range(min(u, EXACT_PULLS) + 1)) | {u}
    counts |= {1 << k for k in range(u.bit_length()) if EXACT_PULLS < 1 << k < u}
    return sorted(counts)


def pull_traced(experts, order, n_miss, resident):
    """Inside a jitted program: the weights of the U experts of `order` (traced indices), the first n_miss (at
    least) copied from pinned host memory into device memory, every later one from `resident(at)` -> (gate_ups
    [n, D, 2F], downs [n, F, D]), the weights of order[at] (at: [n] positions) where they are resident. `experts` =
    (gate_up [E,D,2F], down [E,F,D]) layer stacks, or (gate_ups, downs) tuples of E per-expert arrays
    (`layer_stacks`, `layer_experts`). -> (gate_ups [U, D, 2F], downs [U, F, D]). From stacks, one branch per
    count in `pull_counts(U)` (the smallest >= n_miss runs) whose copies run at once; from per-expert arrays, a
    `lax.switch` over the E experts per miss, one copy after another. The rows come out whole, in one array per
    kind, so the caller multiplies them without selecting between copies and pool rows (a select, and the zeros
    it would choose from, would cost every resident layer)."""
    gate_ups, downs = experts
    u = order.shape[0]
    if not isinstance(gate_ups, (tuple, list)):  # stacks (arrays or QuantizedWeights)
        def pull(j):
            def copies():
                out = []
                for stack, kept in zip((gate_ups, downs), resident(jnp.arange(j, u))):
                    got = [jax.device_put(jax.tree.map(
                        lambda a, i=i: jax.lax.dynamic_index_in_dim(a, order[i], keepdims=False), stack), DEVICE)
                        for i in range(j)]
                    out.append(jax.tree.map(lambda k, *g: jnp.concatenate([jnp.stack(g), k]), kept, *got)
                               if got else kept)
                return tuple(out)
            return copies
        counts = pull_counts(u)
        return jax.lax.switch(jnp.searchsorted(jnp.array(counts), n_miss), [pull(j) for j in counts])

    def one(i):
        return jax.lax.cond(i < n_miss, lambda: _copy_expert(gate_ups, downs, order[i]),
                            lambda: jax.tree.map(lambda k: k[0], resident(i[None])))
    return jax.lax.map(one, jnp.arange(u))


def expert_paths(moe_layers: tuple[int, ...]) -> dict[int, tuple[str, str]]:
    """layer -> (gate_up path, down path) in the flat parameter dict (NNX state paths joined with '.')."""
    return {layer: (f"layers.{layer}.mlp.experts.gate_up", f"layers.{layer}.mlp.experts.down") for layer in moe_layers}


def is_expert_path(path: str) -> bool:
    return ".mlp.experts." in path
