"""One layer's CPU experts in one call: a C++ kernel run by the JAX CPU backend, with an XLA fallback.

Contract: `moe_ffn_cpu(h, coef, gate_up, down, ids=None)` -> out [N, D] float32 with
    out[n] = sum_j coef[j, n] * expert_ffn(h[n], gate_up_j, down_j)        (kernels.expert_math.expert_ffn)
- h [N, D] on the CPU backend, any float dtype (cast to the weights' dtype, as `expert_ffn` does);
  coef [k, N] float32, 0 where row n is not routed to expert j (those rows skip that expert);
- the experts either as sequences of k arrays gate_up_j [D, 2F], down_j [F, D] (ids None: the expert store's
  per-expert CPU views), or as a layer's stacks [E, D, 2F], [E, F, D] with ids [k] int32 naming the experts
  (ids are data: one compiled program serves any set of k experts). Either form may hold quantized experts
  (`quant.formats.QuantizedWeight`, int8 or int4, one scheme, compute dtype bf16): the kernel reads their integers
  and float32 or bf16 scales where they lie and uses q * scale exactly; the XLA path dequantizes them to bf16.
The kernel reads each weight where it lies (no gather, no copy), once per call, on every thread of its pool, with
AVX-512 BF16 dot products (AMX-BF16 tiles for bf16 experts of several rows, where the CPU has them) and float32
sums, the activation rounded to bf16 after scaling by coef; the XLA path rounds each expert's output to h's dtype:
the two agree to bf16 rounding. Eager or inside `jax.jit`; the path is chosen at trace time by `impl`:
- "auto": the kernel where `available()` and `kernel_supports(...)`, else "xla";
- "kernel": the kernel, or an error where it cannot run; "xla": XLA ops, rows zero-padded to `min_rows`
  (XLA:CPU is pathologically slow on bf16 matmuls of one row), as the engine's dense path computes them.
`available()`: the library is built and loaded, its targets registered, and the CPU has AVX-512 BF16 (the
kernel's portable path is correct but not fast, so "auto" uses it only when forced with `set_isa("portable")`).
Outside XLA: `HostWeights` (where experts lie: bf16, or int8 / int4 integers with float32 or bf16 scales),
`run(weights, h, coef, dims)` (one call, as the CUDA bridge's worker makes it), `seconds_per_expert` (its time).
Built on first use (`kernels.build`; `PDSCOPE_CPU_KERNEL=0`: never). Threads: `PDSCOPE_CPU_FFN_THREADS` or
`set_threads(n)`, else this process's CPUs (less two from 8 on), a call in `set_groups(n)` groups each (default 4).
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from pdscope_jax.kernels.build import SOURCES, once, shared_library
from pdscope_jax.kernels.expert_math import expert_ffn
from pdscope_jax.quant.formats import QuantizedWeight, dense

SOURCE = SOURCES / "cpu_ffn.cc"
SYMBOLS = {"list": "pdscope_cpu_ffn_list", "stacked": "pdscope_cpu_ffn_stacked",  # the library's handlers
           "quant_list": "pdscope_cpu_ffn_quant_list", "quant_stacked": "pdscope_cpu_ffn_quant_stacked"}
# FFI target names are process-wide: named after this package, so a second copy of it in one process (an earlier
# tree imported beside this one to compare them) registers its own library's handlers under its own names.
TARGETS = {kind: f"{__name__}.{kind}" for kind in SYMBOLS}
BLOCK = 32  # the kernel needs D and F to be multiples of this
ISAS = {"portable": 0, "avx512_bf16": 2, "amx_bf16": 3}

_state: dict[str, object] = {}  # "forced": the portable path was chosen by set_isa


@once
def library() -> ctypes.CDLL | None:
    """The kernel library, built and loaded and its FFI targets registered on first call; None where it cannot
    be (no compiler, build failure, not x86-64 Linux, or PDSCOPE_CPU_KERNEL=0)."""
    if os.environ.get("PDSCOPE_CPU_KERNEL", "1") == "0":
        return None
    path = shared_library(SOURCE)
    if path is None:
        return None
    lib = ctypes.CDLL(str(path))
    for name in ("pdscope_cpu_ffn_isa", "pdscope_cpu_ffn_best_isa", "pdscope_cpu_ffn_threads"):
        getattr(lib, name).restype = ctypes.c_int
    for name in ("pdscope_cpu_ffn_set_isa", "pdscope_cpu_ffn_set_threads", "pdscope_cpu_ffn_set_stream",
                 "pdscope_cpu_ffn_set_groups", "pdscope_cpu_ffn_set_amx_rows"):
        getattr(lib, name).restype = ctypes.c_int
        getattr(lib, name).argtypes = [ctypes.c_int]
    lib.pdscope_cpu_ffn_set_quant_rows.restype = ctypes.c_int
    lib.pdscope_cpu_ffn_set_quant_rows.argtypes = [ctypes.c_int, ctypes.c_int]
    lib.pdscope_cpu_ffn_run.restype = ctypes.c_int
    lib.pdscope_cpu_ffn_run.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int] * 8 + [ctypes.c_void_p] * 5
    lib.pdscope_cpu_ffn_read.restype = None
    lib.pdscope_cpu_ffn_read.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    lib.pdscope_cpu_ffn_profile.restype = None
    lib.pdscope_cpu_ffn_profile.argtypes = [ctypes.c_int]
    lib.pdscope_cpu_ffn_profile_read.restype = ctypes.c_int
    lib.pdscope_cpu_ffn_profile_read.argtypes = [ctypes.POINTER(ctypes.c_double), ctypes.c_int]
    for kind, symbol in SYMBOLS.items():
        jax.ffi.register_ffi_target(TARGETS[kind], jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
    return lib


def built() -> bool:
    """The library is loaded (on any CPU: the portable path runs everywhere it builds)."""
    return library() is not None


def available() -> bool:
    """The kernel is what "auto" uses: built, and running its AVX-512 BF16 path (or forced to portable)."""
    lib = library()
    return lib is not None and (lib.pdscope_cpu_ffn_best_isa() >= ISAS["avx512_bf16"]
                                or _state.get("forced", False))


def isa() -> str | None:
    """The kernel's instruction set in use ("amx_bf16", "avx512_bf16" or "portable"), None where not built."""
    lib = library()
    return None if lib is None else {v: k for k, v in ISAS.items()}[lib.pdscope_cpu_ffn_isa()]


def set_isa(name: str | None) -> str | None:
    """Force the kernel's instruction set ("portable", or "avx512_bf16" or "amx_bf16" where supported), None for the
    best. "amx_bf16" runs bf16 experts with at least `set_amx_rows` routed rows on AMX tiles and the rest as
    "avx512_bf16". Returns the one in use (None where not built). A call reads it when it runs, not when it is
    dispatched: finish pending calls (`jax.block_until_ready`) before changing it."""
    lib = library()
    if lib is None:
        return None
    _state["forced"] = name == "portable"
    lib.pdscope_cpu_ffn_set_isa(-1 if name is None else ISAS[name])
    return isa()


def set_stream(on: bool) -> bool:
    """Use the streamed few-row bf16 path (csrc/ffn_stream.h: each task reads contiguous weight rows; for calls
    of at most 4 routed rows per expert) or not (the default). Returns the setting (False where not built)."""
    lib = library()
    return lib is not None and bool(lib.pdscope_cpu_ffn_set_stream(int(on)))


def set_amx_rows(n: int) -> int:
    """Where AMX is in use: the fewest routed rows of an expert for its bf16 weights to run on AMX tiles (n >= 1;
    n <= 0 keeps the setting; `PDSCOPE_CPU_FFN_AMX_ROWS`, 2 by default). Returns the setting (0 where not built)."""
    lib = library()
    return 0 if lib is None else lib.pdscope_cpu_ffn_set_amx_rows(n)


def set_quant_rows(n: int, bits: int = 4) -> int:
    """The most routed rows of an expert of `bits` (4: int4, 8: int8) for the few-row quantized kernels
    (csrc/ffn_quant.h), 0 to 4 (0: none, the unit kernels instead; n < 0 keeps the setting). By default int4 takes
    them up to 4 rows (`PDSCOPE_CPU_FFN_QUANT_ROWS`) and int8 never (`PDSCOPE_CPU_FFN_QUANT_ROWS_INT8`: its unit
    kernels ran faster on the GPU node's Xeon). Returns the setting (0 where not built). Read when a call runs."""
    if bits not in (4, 8):
        raise ValueError(f"set_quant_rows: bits must be 4 or 8, got {bits}")
    lib = library()
    return 0 if lib is None else lib.pdscope_cpu_ffn_set_quant_rows(bits, n)


def set_groups(n: int) -> int:
    """Cut a call's work into n groups per pool thread (n >= 1; more groups: a preempted thread holds up less of
    the call; n <= 0 keeps the setting; `PDSCOPE_CPU_FFN_GROUPS`, 4 by default). Returns the setting (0 where not
    built)."""
    lib = library()
    return 0 if lib is None else lib.pdscope_cpu_ffn_set_groups(n)


def threads() -> int:
    """Threads of the kernel's pool (0 where not built)."""
    lib = library()
    return 0 if lib is None else lib.pdscope_cpu_ffn_threads()


def set_threads(n: int) -> int:
    """Replace the kernel's pool with n threads (n <= 0: the default); not while a kernel runs."""
    lib = library()
    return 0 if lib is None else lib.pdscope_cpu_ffn_set_threads(n)


def read_bandwidth(nbytes: int = 1 << 30, repeats: int = 5) -> float:
    """GB/s at which the kernel's pool reads a fresh buffer of `nbytes` (median of `repeats`; 0.0 if not built):
    the memory speed the kernel can hope for."""
    import time

    lib = library()
    if lib is None:
        return 0.0
    buffer = np.ones(nbytes // 8, np.float64)
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        lib.pdscope_cpu_ffn_read(buffer.ctypes.data, buffer.nbytes)
        times.append(time.perf_counter() - start)
    return buffer.nbytes / float(np.median(times[1:])) / 1e9


@dataclasses.dataclass(frozen=True)
class HostWeights:
    """Experts' weights where they lie in host memory, for native code that reads them in place: per expert, the
    addresses of gate_up [D, 2F] and down [F, D], stored as `bits` says (16: bf16; 8 or 4: `quant.formats`'
    integers, with the addresses of their scales, float32 or bf16 as `scale_bits` (32 or 16) says, and int4's rows
    per scale row, `groups` = (gate_up's, down's)). `a + b` lists a's experts then b's (one format); `take(at)` the
    experts at indices `at`."""

    gate_up: tuple[int, ...]
    down: tuple[int, ...]
    bits: int = 16
    gate_up_scale: tuple[int, ...] = ()
    down_scale: tuple[int, ...] = ()
    groups: tuple[int, int] = (0, 0)
    scale_bits: int = 32  # quantized: the scales' type (bf16 experts: unused)

    def __len__(self) -> int:
        return len(self.gate_up)

    def __add__(self, other: "HostWeights") -> "HostWeights":
        if (self.bits, self.groups, self.scale_bits) != (other.bits, other.groups, other.scale_bits):
            raise ValueError(f"experts of two formats: {self.bits}-bit {self.groups} (scales {self.scale_bits}-bit) "
                             f"and {other.bits}-bit {other.groups} (scales {other.scale_bits}-bit)")
        return dataclasses.replace(self, **{name: getattr(self, name) + getattr(other, name) for name in
                                            ("gate_up", "down", "gate_up_scale", "down_scale")})

    def take(self, at) -> "HostWeights":
        def pick(addresses: tuple[int, ...]) -> tuple[int, ...]:
            return tuple(addresses[i] for i in at) if addresses else ()  # bf16: no scales to pick

        return dataclasses.replace(self, gate_up=pick(self.gate_up), down=pick(self.down),
                                   gate_up_scale=pick(self.gate_up_scale), down_scale=pick(self.down_scale))

    def address_arrays(self) -> tuple[np.ndarray, ...]:
        """(gate_up, gate_up scales, down, down scales) as uint64 arrays (scales empty for bf16)."""
        return tuple(np.asarray(getattr(self, name), np.uint64)
                     for name in ("gate_up", "gate_up_scale", "down", "down_scale"))


def run(weights: HostWeights, h: np.ndarray, coef: np.ndarray, dims: tuple[int, int]) -> np.ndarray:
    """out [N, D] float32 = sum_j coef[j, n] * expert_j(h[n]) over the k experts of `weights` (h [N, D] bf16 as
    uint16 or bfloat16, coef [k, N] float32), through the entry the CUDA bridge's worker calls: the math of the
    FFI handlers. ValueError where the library is not built or the kernel does not take the sizes or format."""
    lib = library()
    if lib is None:
        raise ValueError("the CPU expert kernel is not built")
    h = np.ascontiguousarray(np.asarray(h).view(np.uint16))
    coef = np.ascontiguousarray(coef, np.float32)
    out = np.empty((h.shape[0], dims[0]), np.float32)
    if _run(lib, weights, h, coef, out, dims) != 0:
        raise ValueError(_refusal(weights, dims))
    return out


def _refusal(weights: HostWeights, dims: tuple[int, int]) -> str:
    """Why the kernel refused a call (`run`)."""
    if weights.bits not in (16, 8, 4):
        return f"bits must be 16, 8 or 4, not {weights.bits}"
    if weights.bits != 16 and weights.scale_bits not in (32, 16):
        return f"scale_bits must be 32 (float32) or 16 (bf16), not {weights.scale_bits}"
    if any(n <= 0 or n % BLOCK for n in dims):
        return f"the kernel takes hidden and intermediate sizes that are multiples of {BLOCK}, not {dims}"
    return (f"int4 groups (rows per scale row) must be powers of two, multiples of {BLOCK}, dividing D and F "
            f"{dims}: not {weights.groups}")


def _run(lib, weights: HostWeights, h, coef, out, dims) -> int:
    gu, gus, dn, dns = weights.address_arrays()
    return lib.pdscope_cpu_ffn_run(h.ctypes.data, coef.ctypes.data, h.shape[0], *dims, len(weights), weights.bits,
                                   weights.scale_bits, *weights.groups, gu.ctypes.data, gus.ctypes.data,
                                   dn.ctypes.data, dns.ctypes.data, out.ctypes.data)


def seconds_per_expert(weights: HostWeights, dims: tuple[int, int], per_call: int = 2, rows: int = 1,
                       repeats: int = 12) -> float | None:
    """Seconds the kernel takes per expert: the median of `repeats` calls (after one untimed), each of `rows` rows
    routed to the next `per_call` experts of `weights`, read where they lie; dims (D, F). Give more experts than
    the CPU's caches hold (calls cycle through them) for the time of weights that come from memory. None where not
    built; ValueError where the kernel does not take the sizes (`run`)."""
    import time

    lib = library()
    if lib is None or not len(weights):
        return None
    d, f = dims
    k = min(per_call, len(weights))
    h = np.full((rows, d), 0x3C00, np.uint16)  # bf16 0.0078125: the values do not change the time
    coef = np.full((k, rows), 1.0 / k, np.float32)
    out = np.empty((rows, d), np.float32)
    times = []
    for rep in range(repeats + 1):
        call = weights.take((np.arange(k) + rep * k) % len(weights))
        start = time.perf_counter()
        if _run(lib, call, h, coef, out, dims) != 0:
            run(call, h, coef, dims)  # raises, naming what the kernel does not take
        times.append(time.perf_counter() - start)
    return float(np.median(times[1:])) / k


PROFILE_FIELDS = ("setup", "compute", "reduce", "gate_up", "act", "down", "groups", "slowest_group")


def profile(on: bool) -> None:
    """Start (totals reset) or stop the kernel's phase profile of later calls; no-op where not built."""
    lib = library()
    if lib is not None:
        lib.pdscope_cpu_ffn_profile(int(on))


def profile_read() -> dict[str, float]:
    """Milliseconds per call, by phase, over the calls since `profile(True)` ({} where not built or no call):
    `setup` (routing rows into units), `compute` and `reduce` (wall time of the two pool runs); `gate_up`, `act`,
    `down` and `groups` summed over the pool's groups (thread time: divide by `threads()` for wall time);
    `slowest_group` the longest group. `calls` is the number of calls."""
    lib = library()
    if lib is None:
        return {}
    totals = (ctypes.c_double * 16)()
    n = lib.pdscope_cpu_ffn_profile_read(totals, 16)
    calls = totals[0]
    if calls == 0:
        return {}
    return {"calls": int(calls), **{name: totals[i + 1] / calls / 1e6 for i, name in enumerate(PROFILE_FIELDS[:n - 1])}}


def _scales(weights) -> list:
    """The QuantizedWeights' scales as the kernel takes them: as they are where all are float32 or all bf16 (read
    where they lie), else widened to float32 in the program."""
    scales = [w.scale for w in weights]
    if len({jnp.dtype(s.dtype) for s in scales}) == 1 and jnp.dtype(scales[0].dtype) in (jnp.float32, jnp.bfloat16):
        return scales
    return [s.astype(jnp.float32) for s in scales]


def _quant_supported(w) -> bool:
    """An int8 or int4 QuantizedWeight the kernel reads: int4 groups (K / the scale's rows) a power of two, a
    multiple of 32."""
    if w.scheme.bits == 8:
        return w.scale.shape[-2] == 1
    if w.scheme.bits != 4:
        return False
    k, rows = w.shape[-2], w.scale.shape[-2]
    group = k // rows if rows and k % rows == 0 else 0
    return group >= BLOCK and group % BLOCK == 0 and group & (group - 1) == 0


def kernel_supports(h, gate_up, down=None) -> bool:
    """The kernel can compute this call (shapes and dtypes only): bf16 weights, or int8/int4 QuantizedWeights
    whose compute dtype is bf16 (`down` too when given, of the same scheme); D and F multiples of 32."""
    d, two_f = gate_up.shape[-2:]
    quantized = isinstance(gate_up, QuantizedWeight)
    if down is not None and (isinstance(down, QuantizedWeight) != quantized or jnp.dtype(down.dtype) != jnp.bfloat16
                             or (quantized and (down.scheme != gate_up.scheme or not _quant_supported(down)))):
        return False
    return (jnp.dtype(gate_up.dtype) == jnp.bfloat16 and h.ndim == 2 and h.shape[1] == d
            and d % BLOCK == 0 and two_f % (2 * BLOCK) == 0 and (not quantized or _quant_supported(gate_up)))


def moe_ffn_xla(h, coef, gate_up, down, ids=None, min_rows: int = 8) -> jax.Array:
    """The XLA path of `moe_ffn_cpu` (same arguments): each expert on all rows, weighted by coef (quantized
    experts dequantized in the program)."""
    n = h.shape[0]
    if ids is not None:
        gate_up, down = gate_up[ids], down[ids]  # [k, D, 2F], [k, F, D]
    x = jnp.pad(h, ((0, max(min_rows - n, 0)), (0, 0)))  # [max(N, min_rows), D]
    out = jnp.zeros(h.shape, jnp.float32)
    for j in range(coef.shape[0]):
        out = out + coef[j][:, None] * expert_ffn(x, dense(gate_up[j]), dense(down[j]))[:n].astype(jnp.float32)
    return out


Weights = jax.Array | QuantizedWeight


def _describe(w) -> str:
    return f"{w.scheme.name} (compute {w.dtype})" if isinstance(w, QuantizedWeight) else str(w.dtype)


def moe_ffn_cpu(h: jax.Array, coef: jax.Array, gate_up: Weights | Sequence[Weights], down: Weights | Sequence[Weights],
                ids: jax.Array | None = None, *, impl: str = "auto", min_rows: int = 8) -> jax.Array:
    """out [N, D] float32 = sum_j coef[j, n] * expert_ffn(h[n], expert j); see the module docstring."""
    if impl not in ("auto", "kernel", "xla"):
        raise ValueError(f"impl must be 'auto', 'kernel' or 'xla', got {impl!r}")
    k = coef.shape[0]
    if ids is None and (len(gate_up) != k or len(down) != k):
        raise ValueError(f"coef has {k} experts, got {len(gate_up)} gate_up and {len(down)} down arrays")
    first = gate_up if ids is not None else (gate_up[0] if k else None)
    if first is None:
        return jnp.zeros(h.shape, jnp.float32)
    quantized = isinstance(first, QuantizedWeight)
    weights = [gate_up, down] if ids is not None else [*gate_up, *down]
    if any(isinstance(w, QuantizedWeight) != quantized or (quantized and w.scheme != first.scheme) for w in weights):
        raise ValueError("gate_up and down must be all dense arrays or all QuantizedWeights of one scheme, "
                         f"got {sorted({_describe(w) for w in weights})}")
    supported = kernel_supports(h, first, down if ids is not None else down[0])
    use_kernel = impl == "kernel" or (impl == "auto" and available() and supported)
    if not use_kernel:
        return moe_ffn_xla(h, coef, gate_up, down, ids, min_rows)
    if library() is None:
        raise RuntimeError("the CPU expert kernel is not built (see the warning of pdscope_jax.kernels.build)")
    if not supported:
        raise ValueError(f"the CPU expert kernel needs bf16 weights (or int8/int4 QuantizedWeights of compute dtype "
                         f"bf16, int4 groups a power of two >= 32) with D and F multiples of {BLOCK}, got "
                         f"{_describe(first)} {first.shape} for h {h.shape}")
    out_type = jax.ShapeDtypeStruct(h.shape, jnp.float32)
    h = h.astype(jnp.bfloat16)
    coef = coef.astype(jnp.float32)
    if quantized:
        call = jax.ffi.ffi_call(TARGETS["quant_list" if ids is None else "quant_stacked"], out_type)
        bits = np.int32(first.scheme.bits)
        if ids is None:
            scales = _scales([*gate_up, *down])
            return call(h, coef, *(w.q for w in gate_up), *scales[:k], *(w.q for w in down), *scales[k:], bits=bits)
        gs, ds = _scales([gate_up, down])
        return call(h, coef, jnp.asarray(ids, jnp.int32), gate_up.q, gs, down.q, ds, bits=bits)
    if ids is None:
        return jax.ffi.ffi_call(TARGETS["list"], out_type)(h, coef, *gate_up, *down)
    return jax.ffi.ffi_call(TARGETS["stacked"], out_type)(h, coef, jnp.asarray(ids, jnp.int32), gate_up, down)
