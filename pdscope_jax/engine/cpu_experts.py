"""Routed experts computed on the JAX CPU backend.

Contract: `CpuExperts.dispatch(layer, h, groups)` takes the layer's MoE input h [N, D] already on the CPU
backend and, per expert placed on the CPU, the rows (token indices) routed to it and their routing weights;
it returns y [N, D] float32 on the CPU backend, sum over those experts of weight * expert_ffn(h[rows]) (the XLA
paths round h and each expert's output to the weights' dtype, as the plain model does; the kernel rounds only
the activation, so in bf16 it matches the plain model within rounding, not bit for bit). It only
dispatches, so the caller gets the result back at once and can keep the accelerator busy meanwhile. Three paths;
the first program of a layer makes the f32 accumulator itself, later ones add to it (donated):
- the CPU expert kernel (`kernels.cpu_ffn`; N <= `KERNEL_MAX_ROWS`, bf16 weights, where it is built and the CPU
  runs it, unless `kernel=False`): ONE program for all of the layer's CPU experts, reading each expert's weights
  where the store keeps them; the expert count is padded to a power of two with weight-0 experts, which the
  kernel skips without reading them, so few programs serve any count;
- few rows (N <= `DENSE_MAX_ROWS`, decode): every row through every expert, weighted by a dense [k, N]
  coefficient matrix (zero where a token is not routed to the expert), up to `DENSE_EXPERTS` experts per
  program; no gather or scatter, one program per layer for up to that many experts. Rows are padded inside the
  program to `min_rows`: XLA:CPU is pathologically slow on bf16 matmuls with one row;
- many rows (prefill): one program per expert that gathers its rows, padded to a power of two of at least
  `min_rows` (padding rows read token 0 with weight 0), and scatter-adds the result.
`compact_rows(groups, n, min_rows)` serves the many-rows path: the CPU needs only the rows its experts were
routed, so the caller gathers those (`take`, padded to `compact_size`) on the accelerator, hands the CPU h[take]
and the groups renumbered into it, and adds the result back at `take`: only those rows travel each way, and the
CPU's accumulator is as small.
Padding bounds the set of compiled programs; `precompile` compiles them all for a token count. Weights come
from the expert store's CPU views; this module never copies or moves expert weights.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pdscope_jax.kernels import cpu_ffn
from pdscope_jax.models.layers import expert_ffn
from pdscope_jax.store.expert_store import ExpertStore

F32 = jnp.float32
DENSE_MAX_ROWS = 16  # at most this many rows: the dense path (an expert at 16 rows costs about what 8 do)
DENSE_EXPERTS = 8  # experts per dense program
KERNEL_MAX_ROWS = 8  # at most this many rows: the kernel (it leads XLA:CPU at few rows, trails it at many)


def _kernel(h, coef, gate_ups, downs):
    """sum_j coef[j][:, None] * expert_ffn(h, gate_ups[j], downs[j]) in float32, by the CPU expert kernel."""
    return cpu_ffn.moe_ffn_cpu(h, coef, gate_ups, downs, impl="kernel")


def _gathered(acc, h, rows, weights, gate_up, down):
    """acc [N,D] f32 (None: zeros) + weights[:,None] * expert_ffn(h[rows]); h [N,D], rows [R] int32, weights [R].
    Optimization barriers keep the gather and the scatter out of the matmuls' fusions (which slow the matmuls)."""
    x = jax.lax.optimization_barrier(h[rows].astype(gate_up.dtype))  # [R, D] in the model's dtype (see _dense)
    y = jax.lax.optimization_barrier(expert_ffn(x, gate_up, down))  # [R, D]
    acc = jnp.zeros(h.shape, F32) if acc is None else acc
    return acc.at[rows].add(y.astype(F32) * weights[:, None])


def _dense(acc, h, coef, gate_ups, downs, min_rows):
    """acc [N,D] f32 (None: zeros) + sum_j coef[j][:,None] * expert_ffn(h, gate_ups[j], downs[j]); coef [k, N]."""
    n = h.shape[0]
    # h in the model's (weights') dtype: h may come as float32 (packed with the routing) and expert_ffn rounds
    # its output to x's dtype, so each expert's output is rounded where the plain model rounds it
    x = jax.lax.optimization_barrier(jnp.pad(h.astype(gate_ups[0].dtype), ((0, max(min_rows - n, 0)), (0, 0))))
    for j, (gate_up, down) in enumerate(zip(gate_ups, downs)):
        y = jax.lax.optimization_barrier(expert_ffn(x, gate_up, down))[:n].astype(F32) * coef[j][:, None]  # [N, D]
        acc = y if acc is None else acc + y
    return acc


def row_bucket(rows: int, min_rows: int) -> int:
    return max(min_rows, 1 << max(rows - 1, 0).bit_length())


def compact_sizes(n: int, min_rows: int) -> list[int]:
    """The sizes a compacted h of n rows can take, ascending: `min_rows` times a power of four below n, then n
    (powers of four rather than two: half as many sizes to compile, at most four times the rows needed)."""
    sizes, size = [], min_rows
    while size < n:
        sizes.append(size)
        size *= 4
    return sizes + [n]


def compact_size(rows: int, n: int, min_rows: int) -> int:
    """Rows of the compacted h for `rows` (<= n) distinct rows out of n: the least of `compact_sizes` that holds
    them."""
    return next(size for size in compact_sizes(n, min_rows) if size >= rows)


def compact_rows(groups: list[tuple[int, np.ndarray, np.ndarray]], n: int, min_rows: int
                 ) -> tuple[np.ndarray, list[tuple[int, np.ndarray, np.ndarray]]]:
    """The rows of h [n, D] that `groups` (expert, rows, weights) read, as `take` [compact_size] int32 (padded
    with row 0, which no group reads there), and the groups with their rows renumbered into h[take]."""
    needed = np.unique(np.concatenate([rows for _, rows, _ in groups]))
    take = np.zeros(compact_size(needed.size, n, min_rows), np.int32)
    take[:needed.size] = needed
    return take, [(expert, np.searchsorted(needed, rows), weights) for expert, rows, weights in groups]


def kernel_bucket(k: int) -> int:
    """Experts in the kernel's program for k experts: the next power of two."""
    return 1 << max(k - 1, 0).bit_length()


class CpuExperts:
    def __init__(self, store: ExpertStore, min_rows: int = 8, kernel: bool = True):
        self.store = store
        self.cpu = store.devices.cpu
        self.min_rows = min_rows
        self.kernel = kernel and cpu_ffn.available()  # shapes and dtype are checked per call
        self._gathered = jax.jit(_gathered, donate_argnums=0)
        self._dense = jax.jit(_dense, donate_argnums=0, static_argnums=5)
        self._kernel = jax.jit(_kernel)
        self._shapes: set[tuple[str, int, int, bool]] = set()  # (path, N, experts or rows, first) compiled
        self.expert_runs = 0

    @property
    def compiled_programs(self) -> int:
        return len(self._shapes)

    def precompile(self, layer: int, n: int, dtype) -> None:
        """Compile the programs a step of n rows can ask for, in `dtype` (runs each on zeros), each as a layer's
        first program and as a later one, on h of n rows (n <= DENSE_MAX_ROWS) or of every `compact_sizes(n)`
        size: the dense path's for 1 to `DENSE_EXPERTS` experts on h of at most DENSE_MAX_ROWS rows, else the
        gathered path's for every row bucket up to h's."""
        d = self.store.cpu_weights(layer, 0)[0].shape[0]
        runs = self.expert_runs
        for size in [n] if n <= DENSE_MAX_ROWS else compact_sizes(n, self.min_rows):
            h = jax.device_put(np.zeros((size, d), dtype), self.cpu)
            if self._uses_kernel(layer, h):
                top = kernel_bucket(len(self.store.layer_experts(layer)[0]))
                calls = [[(0, np.zeros(0, np.int64), np.zeros(0, np.float32))] * k
                         for k in sorted({kernel_bucket(k) for k in range(1, top + 1)})]
            elif size <= DENSE_MAX_ROWS:
                group = (0, np.zeros(0, np.int64), np.zeros(0, np.float32))
                calls = [[group] * (DENSE_EXPERTS * later + k) for later in (0, 1) for k in range(1, DENSE_EXPERTS + 1)]
            else:
                top = row_bucket(size, self.min_rows)
                buckets = {row_bucket(1 << b, self.min_rows) for b in range(top.bit_length())} | {top}
                calls = [[(0, np.zeros(r, np.int64), np.zeros(r, np.float32))] * 2 for r in sorted(buckets)]
            for groups in calls:
                self.dispatch(layer, h, groups)
        self.expert_runs = runs

    def dispatch(self, layer: int, h: jax.Array, groups: list[tuple[int, np.ndarray, np.ndarray]]) -> jax.Array:
        """h [N, D] on the CPU backend; groups: (expert, rows [r] int, weights [r] float) -> y [N, D] f32."""
        n = h.shape[0]
        acc = None  # the first program makes it: no separate program, no host buffer (one program per decode layer)
        if groups and self._uses_kernel(layer, h):
            acc = self._kernel_layer(layer, h, groups)
        elif n <= DENSE_MAX_ROWS:
            for lo in range(0, len(groups), DENSE_EXPERTS):
                acc = self._dense_chunk(layer, acc, h, groups[lo:lo + DENSE_EXPERTS])
        else:
            for expert, rows, weights in groups:
                acc = self._gathered_expert(layer, acc, h, expert, rows, weights)
        self.expert_runs += len(groups)
        return acc

    def _uses_kernel(self, layer: int, h: jax.Array) -> bool:
        return (self.kernel and h.shape[0] <= KERNEL_MAX_ROWS
                and cpu_ffn.kernel_supports(h, self.store.cpu_weights(layer, 0)[0]))

    def _kernel_layer(self, layer: int, h, groups) -> jax.Array:
        n, k = h.shape[0], kernel_bucket(len(groups))
        coef = np.zeros((k, n), np.float32)  # rows k' >= len(groups) stay 0: padding the kernel skips unread
        for j, (_, rows, weights) in enumerate(groups):
            np.add.at(coef[j], rows, weights)
        weights = [self.store.cpu_weights(layer, expert) for expert, _, _ in groups]
        weights += [weights[0]] * (k - len(groups))
        self._shapes.add(("kernel", n, k, True))
        return self._kernel(h, coef, [w[0] for w in weights], [w[1] for w in weights])

    def _dense_chunk(self, layer: int, acc, h, groups) -> jax.Array:
        n = h.shape[0]
        coef = np.zeros((len(groups), n), np.float32)  # [k, N]
        for j, (_, rows, weights) in enumerate(groups):
            np.add.at(coef[j], rows, weights)
        weights = [self.store.cpu_weights(layer, expert) for expert, _, _ in groups]
        self._shapes.add(("dense", n, len(groups), acc is None))
        # host arrays go straight into the call (jit places them beside h): cheaper than a device_put each
        return self._dense(acc, h, coef, tuple(w[0] for w in weights), tuple(w[1] for w in weights), self.min_rows)

    def _gathered_expert(self, layer: int, acc, h, expert: int, rows: np.ndarray, weights: np.ndarray):
        r = row_bucket(len(rows), self.min_rows)
        rows_p = np.zeros(r, np.int32)
        rows_p[: len(rows)] = rows
        weights_p = np.zeros(r, np.float32)
        weights_p[: len(rows)] = weights
        gate_up, down = self.store.cpu_weights(layer, expert)
        self._shapes.add(("gathered", h.shape[0], r, acc is None))
        return self._gathered(acc, h, rows_p, weights_p, gate_up, down)
