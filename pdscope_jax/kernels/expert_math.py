"""The one definition of a routed expert, which every kernel implements and every path calls.

Contract:
- `expert_ffn(x [N,D], gate_up [D,2F], down [F,D]) -> [N,D]` in x's dtype: `(silu(x @ Wg) * (x @ Wu)) @ Wd` with
  gate and up fused (gate columns first); matmuls in the weights' (compute) dtype with float32 accumulation, the
  activation rounded to down's dtype; quantized weights (`quant.formats.QuantizedWeight`) are dequantized in the
  program (`quant.formats.matmul`).
- `swiglu(h [..., 2F]) -> [..., F]`: silu of the gate half times the up half.
It lives beside the kernels (below `models`) so that a kernel's XLA fallback and the models share it without an
import cycle; `models.experts` re-exports it. Pure jax functions.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pdscope_jax.quant.formats import matmul

F32 = jnp.float32


def swiglu(h: jax.Array) -> jax.Array:
    gate, up = jnp.split(h, 2, axis=-1)
    return jax.nn.silu(gate) * up


def expert_ffn(x: jax.Array, gate_up: jax.Array, down: jax.Array) -> jax.Array:
    h = matmul(x, gate_up)  # [N, 2F] float32
    act = swiglu(h).astype(down.dtype)
    return matmul(act, down).astype(x.dtype)
