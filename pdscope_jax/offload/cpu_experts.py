"""Routed experts computed on the JAX CPU backend.

Contract: `CpuExperts.dispatch(layer, h, groups)` takes the layer's MoE input h [N, D] already on the CPU
backend and, per expert placed on the CPU, the rows (token indices) routed to it and their routing weights;
it returns y [N, D] float32 on the CPU backend, sum over those experts of weight * expert_ffn(h[rows]). It only
dispatches (one small jitted program per expert, chained through a donated accumulator that the first one
creates), so the caller gets
the result back at once and can keep the accelerator busy meanwhile. Row counts are padded to a power of two
of at least `min_rows` (padding rows read token 0 with weight 0): XLA:CPU is pathologically slow on bf16
matmuls with one row, and padding bounds the set of compiled programs (`precompile` compiles them all for a
token count). Weights come from the expert store's CPU views; this module never copies or moves expert weights.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pdscope_jax.models.layers import expert_ffn
from pdscope_jax.offload.expert_store import ExpertStore

F32 = jnp.float32


def _accumulate(acc, h, rows, weights, gate_up, down):
    """acc [N,D] f32 += weights[:,None] * expert_ffn(h[rows]); h [N,D], rows [R] int32, weights [R] f32.
    Optimization barriers keep the gather and the scatter out of the matmuls' fusions. On the GPU node (jax
    0.11.2) this program took about twice the bare expert's time without them at every row count, and 1.2-1.4x
    with them (benchmarks/results/cpu_expert_vs_torch_h200_run{2,3}.json)."""
    x = jax.lax.optimization_barrier(h[rows])  # [R, D]
    y = jax.lax.optimization_barrier(expert_ffn(x, gate_up, down))  # [R, D]
    return acc.at[rows].add(y.astype(F32) * weights[:, None])


def _first(h, rows, weights, gate_up, down):
    """The first expert of a dispatch: `_accumulate` into zeros made inside the program."""
    return _accumulate(jnp.zeros(h.shape, F32), h, rows, weights, gate_up, down)


def row_bucket(rows: int, min_rows: int) -> int:
    return max(min_rows, 1 << max(rows - 1, 0).bit_length())


class CpuExperts:
    def __init__(self, store: ExpertStore, min_rows: int = 8):
        self.store = store
        self.cpu = store.devices.cpu
        self.min_rows = min_rows
        self._step = jax.jit(_accumulate, donate_argnums=0)
        self._first = jax.jit(_first)
        self._shapes: set[tuple[int, int]] = set()  # (N, R) pairs compiled
        self.expert_runs = 0

    @property
    def compiled_programs(self) -> int:
        return len(self._shapes)

    def precompile(self, layer: int, n: int, dtype) -> None:
        """Compile the programs for h of n rows in `dtype`, one per row bucket up to n (runs each on zeros)."""
        gate_up, down = self.store.cpu_weights(layer, 0)
        h = jax.device_put(np.zeros((n, gate_up.shape[0]), dtype), self.cpu)
        top = row_bucket(n, self.min_rows)
        sizes = {row_bucket(1 << b, self.min_rows) for b in range(top.bit_length())} | {top}
        for r in sorted(s for s in sizes if s <= top):
            acc = self._first(h, np.zeros(r, np.int32), np.zeros(r, np.float32), gate_up, down)
            self._step(acc, h, np.zeros(r, np.int32), np.zeros(r, np.float32), gate_up, down)
            self._shapes.add((n, r))

    def dispatch(self, layer: int, h: jax.Array, groups: list[tuple[int, np.ndarray, np.ndarray]]) -> jax.Array:
        """h [N, D] on the CPU backend; groups: (expert, rows [r] int, weights [r] float) -> y [N, D] f32."""
        n, d = h.shape
        acc = None
        for expert, rows, weights in groups:
            r = row_bucket(len(rows), self.min_rows)
            rows_p = np.zeros(r, np.int32)
            rows_p[: len(rows)] = rows
            weights_p = np.zeros(r, np.float32)
            weights_p[: len(rows)] = weights
            gate_up, down = self.store.cpu_weights(layer, expert)
            # host arrays go straight into the call (jit places them beside h): cheaper than a device_put each
            if acc is None:
                acc = self._first(h, rows_p, weights_p, gate_up, down)
            else:
                acc = self._step(acc, h, rows_p, weights_p, gate_up, down)
            self._shapes.add((n, r))
            self.expert_runs += 1
        return acc if acc is not None else jax.device_put(np.zeros((n, d), np.float32), self.cpu)
