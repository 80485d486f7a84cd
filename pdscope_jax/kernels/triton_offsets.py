"""Pallas' Triton lowering made to offset operands of 2^31 elements or more in 64 bits.

Why: the lowering (`jax._src.pallas.triton.lowering._compute_offsets_from_indices`, jax 0.10-0.11) offsets an
operand's elements in 32-bit integers unless the operand exceeds 4 GiB, and Triton adds them to the pointer as
signed integers. An operand of 2^31 elements or more within 4 GiB (the int4 or int8 expert stacks of a 2-4 GB slot
pool) would then be read and written at wrapped addresses, so the kernels had to refuse it.
- `install() -> bool`: wraps that function once (idempotent), so that such an operand is described to it with its
  first axis doubled. Its strides come from the axes after the first, so every offset stays the operand's own and
  only their width changes, to 64 bits. False, and nothing changed, where the lowering has no such function (a
  jax this was not written against): the kernels then keep refusing those operands (`gather_matvec.addressable`).
- `needs_wide(shape, dtype) -> bool`: whether the lowering alone would give the operand 32-bit offsets that wrap;
  `described(block_info)`: the lowering's description of an operand as the wrap hands it on.
Nothing else of the lowering changes; the wrap only ever widens offsets.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax.numpy as jnp

LIMIT = 2**32  # bytes past which the lowering itself offsets in 64 bits


def needs_wide(shape, dtype) -> bool:
    elements = math.prod(shape)
    return elements >= 2**31 and elements * jnp.dtype(dtype).itemsize <= LIMIT


@functools.cache
def install() -> bool:
    try:
        from jax._src.pallas.triton import lowering
    except ImportError:
        return False
    original = getattr(lowering, "_compute_offsets_from_indices", None)
    if original is None or not dataclasses.is_dataclass(getattr(lowering, "BlockInfo", None)):
        return False

    @functools.wraps(original)
    def offsets(block_info, nd_indexer):
        return original(described(block_info), nd_indexer)

    lowering._compute_offsets_from_indices = offsets
    return True


def described(block_info):
    """The lowering's `BlockInfo` as the wrap hands it on: an operand that `needs_wide` with its first axis doubled
    (past 4 GiB: 64-bit offsets; the strides, from the other axes, unchanged), any other as it is."""
    full = block_info.full_shape_dtype
    if not (full.shape and needs_wide(full.shape, full.dtype)):
        return block_info
    return dataclasses.replace(block_info, full_shape_dtype=full.update(shape=(2 * full.shape[0], *full.shape[1:])))
