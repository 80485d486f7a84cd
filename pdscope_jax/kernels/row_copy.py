"""Rows of one stack copied into slots of another inside a GPU program, each under its own condition, with no XLA
conditional (Pallas, Triton lowering).

Why: a decode step that keeps some of a layer's misses must copy a number of them known only on the GPU. XLA runs
a conditional's predicate on the host, which waits for the GPU at every layer (docs/MEASUREMENTS.md); a kernel whose
programs skip the rows not copied needs no such wait, and reads no byte of them.
- `copy_rows(dst, src, rows [R] int32, slots [R] int32) -> dst'`: dst with dst'[slots[r]] = src[rows[r]] for each
  r with 0 <= slots[r] < S (S: dst's first axis); every other slot as it was. dst [S, ...] and src [E, ...]: arrays
  of one dtype and shape past the first axis, or `quant.formats.QuantizedWeight`s of one scheme (each leaf copied).
  The copied rows' slots must be distinct. In a program that donates dst, the copy is in place (the kernel's output
  aliases dst). rows must lie in [0, E) where their slot does.
- `supported(dst)`: the kernel takes every leaf (a row's elements a multiple of `MIN_BLOCK`); elsewhere, without
  a CUDA GPU, or with the GPU kernels off (`gather_matvec.ENABLED`, `compiles_here`), XLA scatters a gathered copy
  of every named row (which reads them all). `interpret=True` runs the kernel through Pallas' interpreter (tests).
"""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pdscope_jax.kernels import gather_matvec

MAX_BLOCK = 1 << 14  # elements a program copies: large enough to keep the link busy, few programs a row
MIN_BLOCK = 128


def _block(elements: int) -> int:
    """The largest power of two in [MIN_BLOCK, MAX_BLOCK] dividing a row's elements, or 0."""
    block = MAX_BLOCK
    while block >= MIN_BLOCK and elements % block:
        block //= 2
    return block if block >= MIN_BLOCK else 0


def supported(dst) -> bool:
    return all(leaf.ndim >= 1 and _block(_row_elements(leaf)) for leaf in jax.tree.leaves(dst))


def _row_elements(a) -> int:
    size = 1
    for dim in a.shape[1:]:
        size *= dim
    return size


def _kernel(rows_ref, slots_ref, src_ref, dst_ref, o_ref, *, block: int, slot_count: int):
    del dst_ref  # aliased to o_ref: the slots not written keep their values
    r, j = pl.program_id(0), pl.program_id(1)
    slot = slots_ref[r]

    @pl.when((slot >= 0) & (slot < slot_count))
    def _():
        cols = pl.ds(pl.multiple_of(j * block, block), block)
        o_ref[slot, cols] = src_ref[rows_ref[r], cols]


def _copy_leaf(dst, src, rows, slots, interpret: bool):
    s, elements = dst.shape[0], _row_elements(dst)
    block = _block(elements)
    flat_dst, flat_src = dst.reshape(s, elements), src.reshape(src.shape[0], elements)
    whole = pl.BlockSpec(memory_space=pl.ANY) if interpret else pl.no_block_spec
    from jax.experimental.pallas import triton as pl_triton

    out = pl.pallas_call(
        functools.partial(_kernel, block=block, slot_count=s),
        out_shape=jax.ShapeDtypeStruct(flat_dst.shape, flat_dst.dtype),
        grid=(rows.shape[0], elements // block),
        in_specs=[whole] * 4,
        out_specs=whole,
        input_output_aliases={3: 0},
        compiler_params=pl_triton.CompilerParams(num_warps=4, num_stages=1),  # Triton, not Mosaic GPU
        name="copy_rows",
        interpret=interpret,
    )(rows.astype(jnp.int32), slots.astype(jnp.int32), flat_src, flat_dst)
    return out.reshape(dst.shape)


def _check(dst, src, rows, slots) -> None:
    d_leaves, s_leaves = jax.tree.leaves(dst), jax.tree.leaves(src)
    if (jax.tree.structure(dst) != jax.tree.structure(src) or rows.shape != slots.shape or rows.ndim != 1
            or any(d.shape[1:] != v.shape[1:] or d.dtype != v.dtype for d, v in zip(d_leaves, s_leaves))):
        raise ValueError(f"copy_rows: dst {[d.shape for d in d_leaves]} and src {[v.shape for v in s_leaves]} differ "
                         f"past their first axis (or in dtype), or rows {rows.shape} / slots {slots.shape} are not "
                         f"one-dimensional of one length")


def _by_xla(dst, src, rows, slots):
    def leaf(d, v):
        inside = (slots >= 0) & (slots < d.shape[0])
        return d.at[jnp.where(inside, slots, d.shape[0])].set(v[jnp.where(inside, rows, 0)], mode="drop",
                                                               unique_indices=True)
    return jax.tree.map(leaf, dst, src)


def _by_kernel(dst, src, rows, slots, interpret: bool = False):
    return jax.tree.map(lambda d, v: _copy_leaf(d, v, rows, slots, interpret), dst, src)


def copy_rows(dst, src, rows: jax.Array, slots: jax.Array, interpret: bool = False):
    _check(dst, src, rows, slots)
    if interpret:
        return _by_kernel(dst, src, rows, slots, interpret=True)
    if not (supported(dst) and gather_matvec.ENABLED and compiles_here()):
        return _by_xla(dst, src, rows, slots)
    return jax.lax.platform_dependent(dst, src, rows, slots, cuda=_by_kernel, default=_by_xla)


@functools.cache
def compiles_here() -> bool:
    """Whether the kernel compiles where a GPU is the default backend (once per process; shapes only); if not, it
    warns once and XLA's scatter runs."""
    if jax.default_backend() != "gpu":
        return True
    dst = jax.ShapeDtypeStruct((4, MIN_BLOCK), jnp.bfloat16)
    index = jax.ShapeDtypeStruct((2,), jnp.int32)
    try:
        jax.jit(_by_kernel).lower(dst, dst, index, index).compile()
    except Exception as err:  # noqa: BLE001 (any failure of Pallas/Triton here means: use XLA's scatter)
        warnings.warn(f"the GPU row copy kernel (pdscope_jax.kernels.row_copy) does not compile on this GPU "
                      f"({type(err).__name__}: {str(err)[:300]}); XLA's scatter runs instead.", RuntimeWarning,
                      stacklevel=2)
        return False
    return True
