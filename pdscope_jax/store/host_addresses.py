"""Where the store's pinned experts lie, for native code that reads them in place (the CPU expert kernel, the bridge).

Contract:
- `host_view(array)` -> a numpy view of a single-buffer host-memory jax array's bytes, or None where its address is
  unavailable (backends differ in what they refuse).
- `host_weights(gate_ups, downs)` -> `kernels.cpu_ffn.HostWeights` of a layer's E per-expert pinned arrays: bf16
  experts, or int8 / int4 ones (`quant.formats.QuantizedWeight`) with their scales as stored (float32 or bf16:
  `scale_bits`; int4 with its rows per scale row, `groups`); None for other experts, scales of two types, or where
  any address is unavailable. Nothing is copied: the addresses are the arrays' own.
"""

from __future__ import annotations

import ctypes

import jax
import jax.numpy as jnp
import numpy as np

from pdscope_jax.kernels.cpu_ffn import HostWeights
from pdscope_jax.quant.formats import is_quantized

SCALE_BITS = {"float32": 32, "bfloat16": 16}  # the scale types the kernel reads where they lie


def host_view(array: jax.Array) -> np.ndarray | None:
    """A numpy view of a single-buffer host-memory array's bytes, or None when its address is unavailable."""
    try:
        address = array.unsafe_buffer_pointer()
    except Exception:  # noqa: BLE001 (backends differ in what they refuse; any refusal means "no view")
        return None
    raw = (ctypes.c_byte * array.nbytes).from_address(address)
    return np.frombuffer(raw, dtype=np.uint8).view(np.dtype(array.dtype)).reshape(array.shape)


def host_weights(gate_ups, downs) -> HostWeights | None:
    first, last = gate_ups[0], downs[0]
    quantized = is_quantized(first)
    if not quantized:
        if first.dtype != jnp.bfloat16:
            return None
        parts = [gate_ups, downs]
    else:
        scale_types = {np.dtype(w.scale.dtype).name for w in (first, last)}  # one type for the kernel's call
        if first.scheme.bits not in (8, 4) or len(scale_types) != 1 or not scale_types <= SCALE_BITS.keys():
            return None
        parts = [[w.q for w in gate_ups], [w.q for w in downs], [w.scale for w in gate_ups], [w.scale for w in downs]]
    addresses = []
    for arrays in parts:
        views = [host_view(a) if isinstance(a, jax.Array) else None for a in arrays]
        if any(v is None for v in views):
            return None
        addresses.append(tuple(v.ctypes.data for v in views))
    if not quantized:
        return HostWeights(*addresses)
    gate_up, down, gate_up_scale, down_scale = addresses
    bits = first.scheme.bits
    # int4: rows per scale row (dense rows over scale rows); int8's one scale row needs none
    groups = tuple(w.shape[-2] // w.scale.shape[-2] for w in (first, last)) if bits == 4 else (0, 0)
    return HostWeights(gate_up, down, bits, gate_up_scale, down_scale, groups, SCALE_BITS[scale_types.pop()])
