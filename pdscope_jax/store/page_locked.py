"""Page-locked host buffers through the CUDA driver, imported zero-copy into JAX as `pinned_host` arrays.

Contract:
- `driver_ready() -> bool`: libcuda loads and initialises (a CUDA GPU machine); nothing else here works without it.
- `HostBuffer(nbytes, ordinal, huge_pages=True, populate_threads=8)`: nbytes of anonymous memory, 2 MiB aligned
  (transparent huge pages asked for with madvise), placed on the GPU's NUMA node where the host has several
  (`store.numa`; `numa_node`, None elsewhere), faulted in by `populate_threads` threads, then page-locked for
  every CUDA context and mapped into the GPU's address space (`cuMemHostRegister`, portable and device-mapped).
  `address`, `nbytes`, `view` (a uint8 numpy view);
  `release()` unlocks it (idempotent; also on collection, except at interpreter exit); the mapping lives as long
  as the object.
- `import_array(buffer, offset, shape, dtype, accel) -> jax.Array`: a `pinned_host` array of GPU `accel` over the
  buffer's bytes from `offset`, through dlpack (`DlpackView`, kDLCUDAHost), no copy; it keeps the buffer alive.
- `device_alias(buffer, offset, shape, dtype, accel) -> jax.Array | None`: the same bytes as a *device* array of
  `accel` (dlpack, kDLCUDA, at the address the driver maps them to): a program reads it in place over PCIe, a read
  inside a kernel like any other, with no copy program. None where the driver or JAX refuses.
- `fill_from_device(buffer, src)`: one device-to-host DMA of the GPU array's bytes into the buffer; returns when done.
- `pin_stack(src, accel, buffer=None) -> PinnedStack`: src ([E, ...], a GPU jax array or numpy) copied into a
  buffer of exactly its bytes (given, or made now) -> `whole` (the stack) and `experts` (its E slices), pinned_host
  arrays of `accel` aliasing the buffer, and `view`, numpy over the same bytes; `device_view`: `whole` as
  `device_alias` gives it (made once).
- `BufferMaker(ordinal, threads=None)`: `expect([nbytes, ...])` starts making buffers of those sizes on its threads
  (default `page_lock_threads()`: PDSCOPE_PAGE_LOCK_THREADS, else `PAGE_LOCK_THREADS`), in order; `take(nbytes)`
  returns the oldest expected one of that size (waiting for it) or makes one now. The store uses it to page-lock
  the next layers' memory while the current one is drawn and copied (a start's critical path).
Why not torch's pinned allocator (docs/MEASUREMENTS.md): it rounds blocks up to powers of two, and importing torch
costs every start seconds.
"""

from __future__ import annotations

import atexit
import collections
import concurrent.futures
import ctypes
import dataclasses
import functools
import mmap
import os
import threading

import jax
import numpy as np

from pdscope_jax import cuda_driver
from pdscope_jax.store import numa

HUGE_PAGE = 2 << 20
_REGISTER_PORTABLE = 0x01  # CU_MEMHOSTREGISTER_PORTABLE: locked for every context, not only the current one
_REGISTER_DEVICEMAP = 0x02  # CU_MEMHOSTREGISTER_DEVICEMAP: mapped into the GPU's address space (`device_alias`)
_MADV_HUGEPAGE, _MADV_POPULATE_WRITE = 14, 23
DL_CPU, DL_CUDA, DL_CUDA_HOST = 1, 2, 3  # DLPack device types
_DL_CODES = {"i": 0, "u": 1, "f": 2}  # DLPack type codes by numpy kind
_DL_BFLOAT = 4


class _Driver:
    """The few CUDA driver calls used here, on one device's primary context (the one XLA computes in)."""

    _lock = threading.Lock()
    _contexts: dict[int, ctypes.c_void_p] = {}

    @classmethod
    def enter(cls, ordinal: int):
        """The driver, with `ordinal`'s primary context current on this thread."""
        lib = cuda_driver.driver()
        with cls._lock:
            if ordinal not in cls._contexts:
                device, context = ctypes.c_int(), ctypes.c_void_p()
                cuda_driver.check(lib, lib.cuDeviceGet(ctypes.byref(device), ordinal), "cuDeviceGet")
                cuda_driver.check(lib, lib.cuDevicePrimaryCtxRetain(ctypes.byref(context), device),
                                  "cuDevicePrimaryCtxRetain")
                cls._contexts[ordinal] = context
        cuda_driver.check(lib, lib.cuCtxSetCurrent(cls._contexts[ordinal]), "cuCtxSetCurrent")
        return lib


def driver_ready() -> bool:
    try:
        cuda_driver.driver()
    except (OSError, RuntimeError, AttributeError):
        return False
    return True


_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


class HostBuffer:
    def __init__(self, nbytes: int, ordinal: int, huge_pages: bool = True, populate_threads: int = 8):
        self.nbytes, self.ordinal = int(nbytes), ordinal
        # private anonymous memory (Python's default, shared, is shmem: no huge pages); the slack aligns to 2 MiB
        self._map = mmap.mmap(-1, self.nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        base = ctypes.addressof(ctypes.c_char.from_buffer(self._map))
        start = -base % HUGE_PAGE
        self.address = base + start
        self.view = np.frombuffer(self._map, np.uint8, self.nbytes, start)
        if huge_pages and self.nbytes:
            _libc.madvise(self.address, _round_up(self.nbytes, HUGE_PAGE), _MADV_HUGEPAGE)  # a hint: may be refused
        # on a host of several NUMA nodes, the pages come from the GPU's (asked before they are faulted in)
        self.numa_node = numa.gpu_node(ordinal) if self.nbytes else None
        if self.numa_node is not None and not numa.prefer(self.address, self.nbytes, self.numa_node):
            self.numa_node = None
        _populate(self.address, self.view, populate_threads)
        self.registered = False
        if self.nbytes:
            lib = _Driver.enter(ordinal)
            flags = _REGISTER_PORTABLE | _REGISTER_DEVICEMAP
            cuda_driver.check(lib, lib.cuMemHostRegister_v2(self.address, self.nbytes, flags), "cuMemHostRegister")
            self.registered = True

    def release(self) -> None:
        """Unlock the pages (the bytes stay readable while this object lives). Not at interpreter exit: the
        driver unlocks everything as the process ends, faster than buffer by buffer."""
        if self.registered and not _exiting:
            self.registered = False
            lib = _Driver.enter(self.ordinal)
            lib.cuCtxSynchronize()  # no copy still reads them
            lib.cuMemHostUnregister(self.address)

    def __del__(self):
        try:
            self.release()
        except Exception:  # noqa: BLE001 (at interpreter exit the driver may be gone; the OS unlocks the pages)
            pass


_exiting = False


@atexit.register
def _at_exit() -> None:
    global _exiting
    _exiting = True


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _populate(address: int, view: np.ndarray, threads: int) -> None:
    """Fault every page in, from `threads` threads: MADV_POPULATE_WRITE (Linux >= 5.14), else a write per page.
    0 threads: leave it to the registration."""
    if view.size == 0 or threads == 0:
        return
    bounds = np.linspace(0, view.size, max(threads, 1) + 1).astype(np.int64) // 4096 * 4096
    bounds[-1] = view.size

    def fault(i: int) -> None:  # ctypes and numpy's fill release the GIL: the threads fault in parallel
        lo, hi = int(bounds[i]), int(bounds[i + 1])
        if hi > lo and _libc.madvise(address + lo, hi - lo, _MADV_POPULATE_WRITE) != 0:
            view[lo:hi:4096] = 0  # older kernels: one write per page (the pages are zero already)

    if threads <= 1:
        fault(0)
        return
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        list(pool.map(fault, range(len(bounds) - 1)))


# ---- dlpack export ---------------------------------------------------------------------------------------
class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int32), ("dtype", _DLDataType),
                ("shape", ctypes.POINTER(ctypes.c_int64)), ("strides", ctypes.POINTER(ctypes.c_int64)),
                ("byte_offset", ctypes.c_uint64)]


class _DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p)]


# its own function object: `ctypes.pythonapi.PyCapsule_New` is shared, and other modules set its argtypes
_capsule_new = ctypes.PYFUNCTYPE(ctypes.py_object, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p)(
    ("PyCapsule_New", ctypes.pythonapi))
_DLTENSOR = b"dltensor"


class DlpackView:
    """A `__dlpack__` producer over raw bytes: `address`, a C-contiguous `shape` of `dtype`, on DLPack device
    (device_type, device_id), kept readable by `owner`. From its export until the importer calls the deleter (when
    the imported array is freed), this object and so `owner` stay alive: an array never outlives its bytes."""

    def __init__(self, address: int, shape: tuple[int, ...], dtype, device: tuple[int, int], owner):
        dtype = np.dtype(dtype)
        self._shape = (ctypes.c_int64 * len(shape))(*shape)
        code = _DL_BFLOAT if dtype.name == "bfloat16" else _DL_CODES[dtype.kind]
        tensor = _DLTensor(address, _DLDevice(*device), len(shape), _DLDataType(code, dtype.itemsize * 8, 1),
                           self._shape, None, 0)
        self._managed = _DLManagedTensor(tensor, None, ctypes.cast(_deleter, ctypes.c_void_p))
        self._device, self.owner = device, owner

    def __dlpack_device__(self):
        return self._device

    def __dlpack__(self, stream=None, **_):
        key = ctypes.addressof(self._managed)
        with _exported_lock:
            _exported[key] = self
        return _capsule_new(key, _DLTENSOR, None)


_exported: dict[int, DlpackView] = {}  # managed tensor address -> its producer, until the importer lets go
_exported_lock = threading.Lock()


@ctypes.CFUNCTYPE(None, ctypes.c_void_p)
def _deleter(managed: int, exported=_exported, lock=_exported_lock) -> None:
    with lock:  # bound as defaults: arrays freed at interpreter exit call this after module globals are cleared
        exported.pop(managed, None)


def _check_inside(buffer: HostBuffer, offset: int, shape, dtype) -> None:
    """ValueError where `shape` of `dtype` from `offset` does not lie inside the buffer."""
    dtype = np.dtype(dtype)
    if offset < 0 or offset + int(np.prod(shape)) * dtype.itemsize > buffer.nbytes:
        raise ValueError(f"bytes [{offset}, +{shape} {dtype}) lie outside the {buffer.nbytes}-byte buffer")


def import_array(buffer: HostBuffer, offset: int, shape, dtype, accel: jax.Device) -> jax.Array:
    _check_inside(buffer, offset, shape, dtype)
    view = DlpackView(buffer.address + offset, tuple(int(s) for s in shape), dtype,
                      (DL_CUDA_HOST, accel.local_hardware_id), buffer)
    array = jax.dlpack.from_dlpack(view)
    if array.sharding.memory_kind != "pinned_host" or array.devices() != {accel}:
        raise RuntimeError(f"dlpack import of page-locked memory gave {array.sharding}, not pinned_host memory of "
                           f"{accel}; use host_alloc='jax'")
    return array


def device_alias(buffer: HostBuffer, offset: int, shape, dtype, accel: jax.Device) -> jax.Array | None:
    _check_inside(buffer, offset, shape, dtype)
    lib = _Driver.enter(buffer.ordinal)
    pointer = ctypes.c_uint64()
    if lib.cuMemHostGetDevicePointer_v2(ctypes.byref(pointer), ctypes.c_void_p(buffer.address + offset), 0) != 0:
        return None
    view = DlpackView(pointer.value, tuple(int(s) for s in shape), dtype, (DL_CUDA, accel.local_hardware_id), buffer)
    try:
        array = jax.dlpack.from_dlpack(view)
    except Exception:  # noqa: BLE001 (JAX versions refuse foreign device memory differently: the caller copies)
        return None
    if array.sharding.memory_kind != "device" or array.devices() != {accel}:
        return None
    return array


def fill_from_device(buffer: HostBuffer, src: jax.Array) -> None:
    if src.nbytes > buffer.nbytes:
        raise ValueError(f"{src.nbytes} bytes do not fit the {buffer.nbytes}-byte buffer")
    src.block_until_ready()
    lib = _Driver.enter(buffer.ordinal)
    cuda_driver.check(lib, lib.cuMemcpyDtoH_v2(buffer.address, src.unsafe_buffer_pointer(), src.nbytes), "cuMemcpyDtoH")


@dataclasses.dataclass
class PinnedStack:
    whole: jax.Array
    experts: list[jax.Array]
    view: np.ndarray
    buffer: HostBuffer

    @functools.cached_property
    def device_view(self) -> jax.Array | None:
        return device_alias(self.buffer, 0, self.whole.shape, self.view.dtype, next(iter(self.whole.devices())))

    def release(self) -> None:
        self.buffer.release()


def on_gpu(src) -> bool:
    return isinstance(src, jax.Array) and all(d.platform == "gpu" for d in src.devices())


def pin_stack(src, accel: jax.Device, buffer: HostBuffer | None = None) -> PinnedStack:
    dtype = np.dtype(src.dtype)
    buffer = HostBuffer(src.nbytes, accel.local_hardware_id) if buffer is None else buffer
    view = buffer.view[:src.nbytes].view(dtype).reshape(src.shape)
    if on_gpu(src):
        fill_from_device(buffer, src)
    else:
        view[...] = np.asarray(src)
    each = src.nbytes // max(src.shape[0], 1)
    whole = import_array(buffer, 0, src.shape, dtype, accel)
    experts = [import_array(buffer, e * each, src.shape[1:], dtype, accel) for e in range(src.shape[0])]
    return PinnedStack(whole, experts, view, buffer)


PAGE_LOCK_THREADS = 2  # buffers page-locked at once; each faults its pages in with `populate_threads` more
PAGE_LOCK_THREADS_ENV = "PDSCOPE_PAGE_LOCK_THREADS"


def page_lock_threads() -> int:
    """Buffers a `BufferMaker` page-locks at once: PDSCOPE_PAGE_LOCK_THREADS (a positive integer), else
    `PAGE_LOCK_THREADS`; ValueError naming the variable for anything else."""
    setting = os.environ.get(PAGE_LOCK_THREADS_ENV, "").strip()
    if not setting:
        return PAGE_LOCK_THREADS
    if not setting.isdigit() or int(setting) < 1:
        raise ValueError(f"{PAGE_LOCK_THREADS_ENV} must be a positive integer (buffers page-locked at once), got "
                         f"{setting!r}; unset it for the default, {PAGE_LOCK_THREADS}")
    return int(setting)


class BufferMaker:
    def __init__(self, ordinal: int, threads: int | None = None, populate_threads: int = 8):
        self.ordinal, self._populate = ordinal, populate_threads
        self._pool = concurrent.futures.ThreadPoolExecutor(threads or page_lock_threads(),
                                                           thread_name_prefix="page-lock")
        self._expected: dict[int, collections.deque] = collections.defaultdict(collections.deque)

    def _make(self, nbytes: int) -> HostBuffer:
        return HostBuffer(nbytes, self.ordinal, populate_threads=self._populate)

    def expect(self, sizes) -> None:
        for nbytes in sizes:
            self._expected[int(nbytes)].append(self._pool.submit(self._make, int(nbytes)))

    def take(self, nbytes: int) -> HostBuffer:
        waiting = self._expected.get(int(nbytes))
        return waiting.popleft().result() if waiting else self._make(nbytes)

    def close(self) -> None:
        """Stop making buffers; those expected and not taken are dropped (unlocked)."""
        for waiting in self._expected.values():
            for future in waiting:
                future.cancel()
        self._pool.shutdown(wait=True)
        self._expected.clear()
