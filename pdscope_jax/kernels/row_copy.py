"""Rows of one stack copied into slots of another inside a GPU program, each under its own condition, with no XLA
conditional (Pallas, Triton lowering).

Why: a decode step that keeps some of a layer's misses must copy a number of them known only on the GPU. XLA runs
a conditional's predicate on the host, which waits for the GPU at every layer (docs/MEASUREMENTS.md); a kernel whose
programs skip the rows not copied needs no such wait, and reads no byte of them.
- `copy_rows(dst, src, rows [R] int32, slots [R] int32) -> dst'`: dst with dst'[slots[r]] = src[rows[r]] for each
  r with 0 <= slots[r] < S; every other slot as it was. dst and src: pytrees of one structure (arrays,
  `quant.formats.QuantizedWeight`s, a bank's (gate_up, down)), each dst leaf [S, ...] and its src leaf [E, ...] of
  one dtype and shape past the first axis; every leaf copied in one kernel call. The copied rows' slots must be
  distinct. In a program that donates dst, the copy is in place (the kernel's outputs alias dst's leaves). rows
  must lie in [0, E) where their slot does.
- `supported(dst)`: the kernel takes every leaf (a row's elements a multiple of `MIN_BLOCK`) and can address it
  (`gather_matvec.addressable`); elsewhere, without a CUDA GPU, or with the GPU kernels off
  (`gather_matvec.ENABLED`, `compiles_here`), XLA scatters a gathered copy of every named row (which reads them
  all). `interpret=True` runs the kernel through Pallas' interpreter (tests).
"""

from __future__ import annotations

import functools

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
    return (all(leaf.ndim >= 1 and _block(_row_elements(leaf)) for leaf in jax.tree.leaves(dst))
            and gather_matvec.addressable(dst))


def _row_elements(a) -> int:
    size = 1
    for dim in a.shape[1:]:
        size *= dim
    return size


def _kernel(rows_ref, slots_ref, *refs, blocks: tuple, slot_count: int):
    """refs: each leaf's source, then each leaf's destination (aliased to its output), then the outputs. Program
    (r, j) copies block j - start of the leaf whose blocks hold j (a program-uniform branch) where row r's slot is
    in range."""
    n = len(blocks)
    srcs, outs = refs[:n], refs[2 * n:]
    r, j = pl.program_id(0), pl.program_id(1)
    slot = slots_ref[r]
    start = 0
    for src_ref, o_ref, (block, count) in zip(srcs, outs, blocks):
        def copy(src_ref=src_ref, o_ref=o_ref, block=block, start=start):
            cols = pl.ds(pl.multiple_of((j - start) * block, block), block)
            o_ref[slot, cols] = src_ref[rows_ref[r], cols]
        pl.when((slot >= 0) & (slot < slot_count) & (j >= start) & (j < start + count))(copy)
        start += count


def _by_kernel(dst, src, rows, slots, interpret: bool = False):
    """Every leaf of dst in one call (grid: rows x all leaves' blocks)."""
    leaves, structure = jax.tree.flatten(dst)
    s = leaves[0].shape[0]
    flat_dst = [a.reshape(s, _row_elements(a)) for a in leaves]
    flat_src = [a.reshape(a.shape[0], _row_elements(a)) for a in jax.tree.leaves(src)]
    blocks = tuple((_block(a.shape[1]), a.shape[1] // _block(a.shape[1])) for a in flat_dst)
    whole = pl.BlockSpec(memory_space=pl.ANY) if interpret else pl.no_block_spec
    from jax.experimental.pallas import triton as pl_triton

    n = len(leaves)
    out = pl.pallas_call(
        functools.partial(_kernel, blocks=blocks, slot_count=s),
        out_shape=[jax.ShapeDtypeStruct(a.shape, a.dtype) for a in flat_dst],
        grid=(rows.shape[0], sum(count for _, count in blocks)),
        in_specs=[whole] * (2 + 2 * n),
        out_specs=[whole] * n,
        input_output_aliases={2 + n + i: i for i in range(n)},
        compiler_params=pl_triton.CompilerParams(num_warps=4, num_stages=1),  # Triton, not Mosaic GPU
        name="copy_rows",
        interpret=interpret,
    )(rows.astype(jnp.int32), slots.astype(jnp.int32), *flat_src, *flat_dst)
    return structure.unflatten([o.reshape(a.shape) for o, a in zip(out, leaves)])


def _check(dst, src, rows, slots) -> None:
    d_leaves, s_leaves = jax.tree.leaves(dst), jax.tree.leaves(src)
    if (jax.tree.structure(dst) != jax.tree.structure(src) or rows.shape != slots.shape or rows.ndim != 1
            or any(d.shape[1:] != v.shape[1:] or d.dtype != v.dtype for d, v in zip(d_leaves, s_leaves))
            or len({d.shape[0] for d in d_leaves}) > 1):
        raise ValueError(f"copy_rows: dst {[d.shape for d in d_leaves]} and src {[v.shape for v in s_leaves]} differ "
                         f"past their first axis (or in dtype), dst's slot counts differ, or rows {rows.shape} / "
                         f"slots {slots.shape} are not one-dimensional of one length")


def _by_xla(dst, src, rows, slots):
    def leaf(d, v):
        inside = (slots >= 0) & (slots < d.shape[0])
        return d.at[jnp.where(inside, slots, d.shape[0])].set(v[jnp.where(inside, rows, 0)], mode="drop",
                                                               unique_indices=True)
    return jax.tree.map(leaf, dst, src)


def copy_rows(dst, src, rows: jax.Array, slots: jax.Array, interpret: bool = False):
    _check(dst, src, rows, slots)
    if interpret:
        return _by_kernel(dst, src, rows, slots, interpret=True)
    if not (supported(dst) and gather_matvec.ENABLED and compiles_here()):
        return _by_xla(dst, src, rows, slots)
    return jax.lax.platform_dependent(dst, src, rows, slots, cuda=_by_kernel, default=_by_xla)


@functools.cache
def compiles_here() -> bool:
    """Whether the kernel compiles where a GPU is the default backend (`gather_matvec.compile_check`); if not, it
    warns once and XLA's scatter runs."""
    dst = jax.ShapeDtypeStruct((4, MIN_BLOCK), jnp.bfloat16)
    index = jax.ShapeDtypeStruct((2,), jnp.int32)
    return gather_matvec.compile_check(lambda: jax.jit(_by_kernel).lower(dst, dst, index, index).compile(),
                                       "the GPU row copy kernel (pdscope_jax.kernels.row_copy)",
                                       "XLA's scatter runs instead.")
