"""What the CPU expert kernel tests compare against: random routing cases and an exact float64 reference."""

import jax.numpy as jnp
import numpy as np

from pdscope_jax.quant.formats import QuantizedWeight


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def routing_case(rows: int, k: int, d: int, experts: int, seed: int):
    """(h [rows, d] bf16, coef [k, rows] f32, ids [k] int32): some rows not routed to an expert, and the last
    expert (k > 1) routed no row."""
    rng = np.random.default_rng(seed)
    h = jnp.asarray(rng.standard_normal((rows, d)), jnp.bfloat16)
    ids = rng.choice(experts, k, replace=False).astype(np.int32)
    coef = rng.random((k, rows)).astype(np.float32)
    coef[rng.random((k, rows)) < 0.4] = 0.0  # rows not routed to an expert
    coef[-1] = 0.0 if k > 1 else coef[-1]  # an expert no row is routed to
    return h, coef, ids


def _float64(w) -> np.ndarray:
    """An expert's weights as the kernel computes with them: bf16 values, or q * scale (not rounded to bf16)."""
    w = w.dequantize(jnp.float32) if isinstance(w, QuantizedWeight) else w.astype(jnp.float32)
    return np.asarray(w, np.float64)


def exact(h, coef, gate_up, down, ids) -> np.ndarray:
    """sum_j coef[j, n] * expert_ffn(h[n]) in float64 over the experts `ids` of the stacks gate_up, down."""
    h = np.asarray(h.astype(jnp.float32), np.float64)
    out = np.zeros(h.shape)
    for j, e in enumerate(ids):
        gu, dn = _float64(gate_up[e]), _float64(down[e])
        pre = h @ gu
        gate, up = np.split(pre, 2, axis=1)
        out += coef[j][:, None] * ((gate / (1 + np.exp(-gate)) * up) @ dn)
    return out
