"""Few-row products with gathered expert weights on the GPU, reading each weight once (Pallas, Triton lowering).

Why: at decode a routed expert multiplies one row (a few at small batches) by its [K, N] weights. XLA turns such a
product into a reduction and, over gathered experts, first copies each pick's weights (and transposes them):
on the H200 a DeepSeek-V2-Lite layer's six picks took 0.18 ms where their 104 MB take about 0.03 ms to read.
This kernel reads the picks' weights in place, in [BK, BN] tiles along the stored rows, and accumulates in
float32.
Contract:
- `gather_matvec(x [A, K], w [S, K, N], idx [A] int32) -> float32 [A, N]`: row a is x[a] @ w[idx[a]], products
  of x's values rounded to w's dtype, summed in float32 (as `jnp.dot(x.astype(w.dtype), w[idx[a]],
  preferred_element_type=float32)` computes them, up to the order of the sum). idx must lie in [0, S); w float
  (bf16 or f32, not quantized).
- `supported(a, k, n, dtype)`: the shapes the kernel takes (K and N multiples of its tiles, at most
  `MAX_ROWS` rows); callers keep their XLA path for the rest.
- `on_gpu(kernel_fn, xla_fn, *args)`: `kernel_fn(*args)` when the program is lowered for a CUDA GPU and
  `ENABLED`, `xla_fn(*args)` otherwise (`jax.lax.platform_dependent`: the CPU backend never lowers the kernel).
  `ENABLED` is False when the environment sets PDSCOPE_GPU_KERNELS=0 (the XLA paths everywhere: a comparison, or
  a way around a kernel that fails on some GPU).
`interpret=True` runs the kernel through Pallas' interpreter (tests on the CPU backend).
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

F32 = jnp.float32
ENABLED = os.environ.get("PDSCOPE_GPU_KERNELS", "1") != "0"
MAX_ROWS = 64  # assignments a call takes (the gather path's bound, models.experts.GATHER_MAX_ASSIGNMENTS)
BLOCK_N = 128
TARGET_PROGRAMS = 528  # 4 per multiprocessor of an H100/H200: split K until the grid has about this many


def _block_k(dtype) -> int:
    return 64 if jnp.dtype(dtype).itemsize <= 2 else 32


def supported(a: int, k: int, n: int, dtype) -> bool:
    dtype = jnp.dtype(dtype)
    return (0 < a <= MAX_ROWS and dtype in (jnp.dtype(jnp.bfloat16), jnp.dtype(F32), jnp.dtype(jnp.float16))
            and k % _block_k(dtype) == 0 and n % BLOCK_N == 0)


def _splits(a: int, k_blocks: int, n_blocks: int) -> int:
    """Parts K is cut into: the largest power of two dividing the K blocks that keeps the grid near
    TARGET_PROGRAMS programs (more programs, more weight bytes in flight)."""
    splits = 1
    while (k_blocks % (2 * splits) == 0 and a * n_blocks * splits * 2 <= TARGET_PROGRAMS):
        splits *= 2
    return splits


def _kernel(idx_ref, x_ref, w_ref, o_ref, *, block_k: int, steps: int):
    a, j, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    slot = idx_ref[a]
    cols = pl.ds(pl.multiple_of(j * BLOCK_N, BLOCK_N), BLOCK_N)

    def body(i, acc):
        start = pl.multiple_of((s * steps + i) * block_k, block_k)
        xb = x_ref[a, pl.ds(start, block_k)].astype(w_ref.dtype).astype(F32)  # [BK]
        wb = w_ref[slot, pl.ds(start, block_k), cols].astype(F32)  # [BK, BN]: rows of BN contiguous values
        return acc + jnp.sum(xb[:, None] * wb, axis=0)

    o_ref[...] = jax.lax.fori_loop(0, steps, body, jnp.zeros((BLOCK_N,), F32))


@functools.partial(jax.jit, static_argnames=("interpret",))
def gather_matvec(x: jax.Array, w: jax.Array, idx: jax.Array, interpret: bool = False) -> jax.Array:
    a, k = x.shape
    _, k_w, n = w.shape
    if k_w != k or idx.shape != (a,) or not supported(a, k, n, w.dtype):
        raise ValueError(f"gather_matvec: unsupported shapes x {x.shape}, w {w.shape} {w.dtype}, idx {idx.shape}")
    block_k = _block_k(w.dtype)
    n_blocks, k_blocks = n // BLOCK_N, k // block_k
    splits = _splits(a, k_blocks, n_blocks)
    kernel = functools.partial(_kernel, block_k=block_k, steps=k_blocks // splits)
    whole = pl.BlockSpec(memory_space=pl.ANY) if interpret else pl.no_block_spec
    from jax.experimental.pallas import triton as pl_triton

    parts = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((splits, a, n), F32),
        grid=(a, n_blocks, splits),
        in_specs=[whole, whole, whole],
        out_specs=pl.BlockSpec((None, None, BLOCK_N), lambda i, j, s: (s, i, j)),
        compiler_params=pl_triton.CompilerParams(num_warps=4, num_stages=3),
        interpret=interpret,
    )(idx.astype(jnp.int32), x, w)
    return parts.sum(axis=0) if splits > 1 else parts[0]


def on_gpu(kernel_fn, xla_fn, *args):
    if not ENABLED:
        return xla_fn(*args)
    return jax.lax.platform_dependent(*args, cuda=kernel_fn, default=xla_fn)
