"""Routed experts computed by the host's CPU from inside a CUDA program (the bridge), with an XLA stand-in.

Contract:
- `Bridge.create(weights, dims, device, max_rows, max_picks)` -> a Bridge, or None with `why_not()` saying why:
  `weights` [`cpu_ffn.HostWeights` of E experts] per MoE position, of one format, in host memory that outlives
  the bridge; `dims` (D, F). Needs a CUDA `device`, the bridge library (csrc/host_experts_cuda.cc) and the CPU
  expert kernel (`cpu_ffn`) built and using AVX-512 BF16. Quantized experts (int8, int4) are computed only:
  their bridge takes no `copy_ids` or `ahead_ids` (`Bridge.can_copy` is False), whose rows are bf16. `close()`
  stops its worker (no program using it may be pending); `stats()` -> {layers served, faults, seconds computing};
  `timeline()` -> per served layer, its MoE position, experts computed, and when the worker saw "go" and wrote
  "done".
- Inside a program jitted for that device, per MoE position m (an int or a traced int32 scalar: the worker reads it
  from the program, so one traced layer serves every position): `begin(bridge, m, h, ids, coef, picks)` ->
  (h', picks'): the host starts y_cpu[n] = sum_u coef[u, n] * expert(m, ids[u])(h[n]) over ids[u] >= 0
  (h [N, D] bf16, ids [U] int32, coef [U, N] float32; U = 0: nothing, and no end follows); `end(bridge, dep,
  rows, hidden)` -> y_cpu [N, D] float32, after `dep`. The caller reads h' and picks' for its own expert work,
  so that work is ordered after begin and runs while the host computes; end's wait holds the GPU only where the
  program needs y_cpu. With `copy_ids` [C] int32, begin also returns (gate_ups [C, D, 2F], downs [C, F, D]),
  into whose row c the worker copies expert copy_ids[c] (where >= 0) from the host by DMA; `fetched(bridge,
  gate_ups, downs)` returns them once the copies are done. The program then needs no conditional to size its
  copies, so the thread that launches it never waits for the GPU. With `ahead_ids` [A] int32 (experts of MoE
  position m + 1, a prediction), begin also returns (ahead gate_ups [A, D, 2F], ahead downs [A, F, D]), which the
  worker fills after this layer's copies, so they overlap this layer's work; the next layer passes them as
  `ahead_rows` to its begin and fetched, and a copy id -2 - a there takes row a of them (moved on the GPU).
`engine.device_decode` computes the same sum with XLA ops where there is no bridge. The kernel's arithmetic
(float32 sums, the activation rounded to bf16 after scaling) agrees with XLA's to bf16 rounding.
`PDSCOPE_HOST_EXPERTS=0` disables the bridge.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import operator
import os

import jax
import jax.numpy as jnp
import numpy as np

from pdscope_jax.kernels import cpu_ffn
from pdscope_jax.kernels.build import SOURCES, once, shared_library

SOURCE = SOURCES / "host_experts_cuda.cc"
BEGIN, FETCHED, END = f"{__name__}.begin", f"{__name__}.fetched", f"{__name__}.end"
TIMELINE = 8192  # layers a bridge's timeline keeps (kTimeline)
# Declared effect-free: data order alone keeps begin -> the GPU's part -> end (end reads the part, the part reads
# begin's outputs, the next layer reads end's), and a program with a side effect leaves jax's C++ dispatch path
# for the Python one, which costs a decode step several milliseconds of host time.
SIDE_EFFECT = False

_state: dict[str, object] = {}  # "why": the last reason a bridge was not made; "unloaded": why the library did not load


@once
def _library() -> ctypes.CDLL | None:
    if os.environ.get("PDSCOPE_HOST_EXPERTS", "1") == "0":
        _state["unloaded"] = "disabled by PDSCOPE_HOST_EXPERTS=0"
        return None
    path = shared_library(SOURCE)
    if path is None:
        _state["unloaded"] = f"{SOURCE.name} could not be built"
        return None
    lib = ctypes.CDLL(str(path))
    lib.pdscope_host_experts_create.restype = ctypes.c_int64
    lib.pdscope_host_experts_create.argtypes = ([ctypes.c_int] * 6 + [ctypes.c_void_p] * 2 + [ctypes.c_int] * 4
                                                + [ctypes.c_void_p] * 3 + [ctypes.c_int])
    lib.pdscope_host_experts_problem.restype = ctypes.c_char_p
    lib.pdscope_host_experts_destroy.argtypes = [ctypes.c_int64]
    lib.pdscope_host_experts_stats.argtypes = [ctypes.c_int64, ctypes.POINTER(ctypes.c_int64),
                                               ctypes.POINTER(ctypes.c_int64), ctypes.POINTER(ctypes.c_double)]
    lib.pdscope_host_experts_timeline.restype = ctypes.c_int64
    lib.pdscope_host_experts_timeline.argtypes = [ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64]
    try:
        for name, symbol in ((BEGIN, "pdscope_host_experts_begin"), (FETCHED, "pdscope_host_experts_fetched"),
                             (END, "pdscope_host_experts_end")):
            jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(getattr(lib, symbol)), platform="CUDA")
    except Exception as error:  # noqa: BLE001 (a jax without the CUDA plugin refuses the platform)
        _state["unloaded"] = f"no CUDA platform to register the bridge with ({type(error).__name__}: {error})"
        return None
    return lib


def why_not() -> str:
    """Why the last `Bridge.create` returned None ("" when it did not)."""
    return str(_state.get("why", ""))


@dataclasses.dataclass(frozen=True)
class Bridge:
    handle: int
    rows: int  # the most rows a layer may send (the program's batch)
    dims: tuple[int, int]  # (D, F) of the experts
    can_copy: bool = True  # whether its worker may copy experts (bf16 ones): `begin`'s copy_ids and ahead_ids

    @classmethod
    def create(cls, weights: list[cpu_ffn.HostWeights], dims: tuple[int, int], device: jax.Device, max_rows: int,
               max_picks: int) -> "Bridge | None":
        _state["why"] = ""
        if device.platform != "gpu" or "cuda" not in device.client.platform_version.lower():
            _state["why"] = f"the accelerator is {device.platform}, not a CUDA GPU"
            return None
        if not cpu_ffn.available():
            _state["why"] = "the CPU expert kernel is not built or this CPU lacks AVX-512 BF16"
            return None
        lib = _library()
        if lib is None:
            _state["why"] = str(_state["unloaded"])
            return None
        d, f = dims
        every = functools.reduce(operator.add, weights)  # layer after layer
        gate_up, gate_up_scale, down, down_scale = every.address_arrays()
        run = ctypes.cast(cpu_ffn.library().pdscope_cpu_ffn_run, ctypes.c_void_p)
        handle = lib.pdscope_host_experts_create(len(weights), len(weights[0]), d, f, max_rows, max_picks,
                                                 gate_up.ctypes.data, down.ctypes.data, every.bits, every.scale_bits,
                                                 *every.groups, gate_up_scale.ctypes.data, down_scale.ctypes.data,
                                                 run, device.local_hardware_id or 0)
        if handle < 0:
            _state["why"] = lib.pdscope_host_experts_problem().decode()
            return None
        return cls(int(handle), max_rows, (d, f), can_copy=every.bits == 16)

    def close(self) -> None:
        _library().pdscope_host_experts_destroy(self.handle)

    def stats(self) -> dict[str, float]:
        served, faults, busy = ctypes.c_int64(), ctypes.c_int64(), ctypes.c_double()
        _library().pdscope_host_experts_stats(self.handle, served, faults, busy)
        return {"served": served.value, "faults": faults.value, "seconds": busy.value}

    def timeline(self, last: int = TIMELINE) -> np.ndarray:
        """The latest `last` (at most TIMELINE) layers served, oldest first: int64 [n, 4] of MoE position,
        experts computed, and when the worker saw "go" and wrote "done" (`time.monotonic_ns` clock on Linux)."""
        out = np.zeros((max(min(last, TIMELINE), 0), 4), np.int64)
        n = _library().pdscope_host_experts_timeline(self.handle, out.ctypes.data, out.shape[0])
        return out[:n]


def begin(bridge: Bridge, m: int | jax.Array, h, ids, coef, picks, copy_ids=None, ahead_ids=None, ahead_rows=None):
    """See the module docstring; h' and picks' are copies of h and picks made after the host was told to start.
    -> (h', picks'), then (gate_ups, downs) for `fetched` with `copy_ids`, then (ahead gate_ups, ahead downs) with
    `ahead_ids`. `ahead_rows`: the layer before's ahead outputs, which copy ids -2 - a take rows from."""
    if not bridge.can_copy and (copy_ids is not None or ahead_ids is not None):
        raise ValueError("this bridge's experts are quantized: its worker computes them but copies none "
                         "(no copy_ids or ahead_ids)")
    d, f = bridge.dims
    lists = [jnp.zeros((0,), jnp.int32) if a is None else a.astype(jnp.int32) for a in (copy_ids, ahead_ids)]
    rows = [jax.ShapeDtypeStruct(shape, jnp.bfloat16) for n in (a.shape[0] for a in lists)
            for shape in ((n, d, 2 * f), (n, f, d))]
    call = jax.ffi.ffi_call(BEGIN, (jax.ShapeDtypeStruct(h.shape, h.dtype),
                                    jax.ShapeDtypeStruct(picks.shape, picks.dtype), *rows),
                            has_side_effect=SIDE_EFFECT)
    out = call(h, ids.astype(jnp.int32), coef.astype(jnp.float32), picks, *lists, *_rows_or_empty(bridge, ahead_rows),
               jnp.asarray(m, jnp.int32).reshape(1), handle=np.int64(bridge.handle))
    return (*out[:2], *(out[2:4] if copy_ids is not None else ()), *(out[4:] if ahead_ids is not None else ()))


def fetched(bridge: Bridge, gate_ups, downs, ahead_rows=None):
    """(gate_ups, downs) of the latest begin, once the worker's copies into them are done (the same buffers);
    `ahead_rows` as given to that begin (kept allocated until its rows are moved)."""
    call = jax.ffi.ffi_call(FETCHED, (jax.ShapeDtypeStruct(gate_ups.shape, gate_ups.dtype),
                                      jax.ShapeDtypeStruct(downs.shape, downs.dtype)),
                            has_side_effect=SIDE_EFFECT, input_output_aliases={0: 0, 1: 1})
    return call(gate_ups, downs, *_rows_or_empty(bridge, ahead_rows), handle=np.int64(bridge.handle))


def _rows_or_empty(bridge: Bridge, rows):
    """`rows` (gate_ups, downs), or none of either shape."""
    d, f = bridge.dims
    return rows if rows is not None else (jnp.zeros((0, d, 2 * f), jnp.bfloat16), jnp.zeros((0, f, d), jnp.bfloat16))


def end(bridge: Bridge, dep, rows: int, hidden: int):
    """y_cpu [rows, hidden] float32 of the latest begin, ordered after `dep`."""
    call = jax.ffi.ffi_call(END, jax.ShapeDtypeStruct((rows, hidden), jnp.float32), has_side_effect=SIDE_EFFECT)
    return call(dep, handle=np.int64(bridge.handle))
