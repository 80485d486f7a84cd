"""PhasePer training losses, exactly as in the paper, computed from logits.

Contract (z logits [N,E], y targets in {0,1} [N,E], f [E] activation frequency of each expert, N experts
in the paper's notation is E here; every loss is averaged over experts, then over tokens):
- `bce(z, y)`: elementwise BCE(y, sigmoid(z)) = softplus(z) - y*z, stable for any z.
- `expert_loss`: L_expert = mean_i (1/f_i) * BCE(y_i, p_i).
- `focal_loss`:  L_focal  = mean_i (1 - p_t,i)^gamma * BCE(y_i, p_i), p_t = p if y = 1 else 1 - p.
  1 - p_t is computed as -expm1(-BCE) (floored at 1e-30), exact and stable from logits; any gamma >= 0.
- `phase_loss(phase, group, ...)`: prefill, input/output groups: L_expert + lambda * L_focal;
  decode, input/output groups: L_focal; middle group, both phases: mean BCE. It is `combined_loss` with
  the weights `loss_coefficients(phase, group, lambda)` of (mean BCE, L_expert, L_focal).
- `expert_frequencies(e_next, E, floor)`: f_i from training targets, clamped below at `floor` so that
  1/f_i stays finite for experts never seen in the training set.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def bce(z: jax.Array, y: jax.Array) -> jax.Array:
    return jnp.logaddexp(0.0, z) - y * z  # [N, E]


def expert_loss(z: jax.Array, y: jax.Array, freq: jax.Array) -> jax.Array:
    return jnp.mean(jnp.mean(bce(z, y) / freq, axis=-1))


def focal_loss(z: jax.Array, y: jax.Array, gamma: float | jax.Array) -> jax.Array:
    b = bce(z, y)  # [N, E]
    # 1 - p_t, since p_t = exp(-BCE); the floor keeps d/dz finite for gamma < 1 where p_t rounds to 1.
    one_minus_pt = jnp.maximum(-jnp.expm1(-b), 1e-30)
    return jnp.mean(jnp.mean(one_minus_pt**gamma * b, axis=-1))


def loss_coefficients(phase: str, group: str, lam: float) -> np.ndarray:
    """[3] weights of (mean BCE, L_expert, L_focal) in the loss of (phase, group)."""
    if group == "middle":
        return np.array([1.0, 0.0, 0.0], np.float32)
    if phase == "prefill":
        return np.array([0.0, 1.0, lam], np.float32)
    return np.array([0.0, 0.0, 1.0], np.float32)


def combined_loss(z, y, freq, gamma, coefs) -> jax.Array:
    """coefs[0] * mean BCE + coefs[1] * L_expert + coefs[2] * L_focal; `coefs` may be traced, so one
    compiled training step serves every phase and group."""
    return coefs[0] * jnp.mean(bce(z, y)) + coefs[1] * expert_loss(z, y, freq) + coefs[2] * focal_loss(z, y, gamma)


def phase_loss(phase: str, group: str, z, y, freq, lam, gamma) -> jax.Array:
    """The loss PhasePer trains (phase, group) with."""
    return combined_loss(z, y, freq, gamma, loss_coefficients(phase, group, lam))


def targets(e_next: np.ndarray, num_experts: int) -> np.ndarray:
    """[N, E] float32 multi-hot of the next layer's selected experts e_next [N, K]."""
    y = np.zeros((e_next.shape[0], num_experts), np.float32)
    np.put_along_axis(y, np.asarray(e_next, np.int64), 1.0, axis=1)
    return y


def expert_frequencies(e_next: np.ndarray, num_experts: int, floor: float = 1e-2) -> np.ndarray:
    """[E] fraction of tokens that activate each expert, clamped to >= floor."""
    y = targets(e_next, num_experts)
    freq = y.mean(axis=0) if y.shape[0] else np.zeros(num_experts, np.float32)
    return np.maximum(freq, floor).astype(np.float32)
