"""The CUDA driver (libcuda) through ctypes: loaded and initialised once a process, shared by its users.

Contract:
- `driver() -> ctypes.CDLL`: libcuda.so.1 with cuInit(0) done and the argument types of the calls that take
  addresses or sizes declared. OSError where the library does not load (no CUDA driver), RuntimeError naming the
  driver's error where cuInit fails. Thread-safe; the same object every call.
- `check(lib, code, what)`: RuntimeError naming `what` and the driver's error string when `code` is not 0.
- `total_memory(ordinal=0) -> int | None`: that GPU's memory in bytes; None without a driver or such a GPU.
Used before JAX starts its backends (`runtime.hold_gpu_to_budget`) and beside them (`store.page_locked`); it
creates no context. Why ctypes: the runtime needs a handful of driver calls and no CUDA Python package.
"""

from __future__ import annotations

import ctypes
import threading

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None


def driver() -> ctypes.CDLL:
    global _lib
    with _lock:
        if _lib is None:
            lib = ctypes.CDLL("libcuda.so.1")
            lib.cuMemHostRegister_v2.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
            lib.cuMemHostUnregister.argtypes = [ctypes.c_void_p]
            lib.cuMemcpyDtoH_v2.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t]
            lib.cuMemHostGetDevicePointer_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_void_p,
                                                         ctypes.c_uint]
            check(lib, lib.cuInit(0), "cuInit")
            _lib = lib
        return _lib


def check(lib: ctypes.CDLL, code: int, what: str) -> None:
    if code != 0:
        name = ctypes.c_char_p()
        lib.cuGetErrorString(code, ctypes.byref(name))
        raise RuntimeError(f"{what} failed: CUDA error {code} ({(name.value or b'?').decode()})")


def total_memory(ordinal: int = 0) -> int | None:
    try:
        lib = driver()
    except (OSError, RuntimeError, AttributeError):
        return None
    device, total = ctypes.c_int(), ctypes.c_size_t()
    if lib.cuDeviceGet(ctypes.byref(device), ordinal) or lib.cuDeviceTotalMem_v2(ctypes.byref(total), device):
        return None
    return total.value
