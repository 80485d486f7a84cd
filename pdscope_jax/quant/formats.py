"""Quantized weight formats of routed experts, and the array-like pytree that carries one.

Contract: a matrix w [..., K, N] (K: the contraction axis, N: outputs; leading axes index experts or slots) is
stored as integers `q` and a `scale`, w ~= dequantize(q, scale):
- "int8": q int8 [..., K, N], scale float32 [..., 1, N]: symmetric, per output channel, scale = max|w| / 127.
- "int4": q uint8 [..., K/2, N], two values per byte: rows 2i (low nibble) and 2i+1 (high nibble), each a
  two's-complement value in [-8, 7]; scale bfloat16 [..., K/G, N] per group of G consecutive rows, G = gcd(K, 64)
  (64 for every real model; 32 where K is an odd multiple of 32, as in the tiny test models; K % 32 == 0):
  symmetric, scale = -(the group's value of largest magnitude) / 8 (rounded to bf16 before the integers are
  chosen), so that value maps to -8 and the other side keeps 7 steps: 4.25 bits a weight (docs/MEASUREMENTS.md,
  "int4 format", has the choice of G, of this rule and of bf16 scales).
`QuantizedWeight(q, scale, scheme, dtype)` is a jax pytree (q and scale its leaves; scheme and the compute
dtype static) that indexes, moves (`jax.device_put`), slices and stacks like the dense array it stands for:
`.shape` and `.dtype` are the dense ones, `w[i]` indexes the leading axes of both leaves, `.nbytes` counts
the stored bytes. `dense(w)` gives the dense matrix in the compute dtype (w itself when not quantized):
inside a jitted program the dequantization is part of the program; `matmul(x, w)` is x times dense(w), int4 without
an interleaved copy of the dense matrix. `quantize(w, scheme)` is pure jax (it runs
where w lies). `SCHEMES` names the schemes; `scheme(name)` raises a ValueError naming them (both defined
in `pdscope_jax.config`, beside the `expert_quant` that names one, and re-exported here).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pdscope_jax.config import SCHEMES, Scheme, scheme  # noqa: F401  (the formats' names, kept here too)


@jax.tree_util.register_pytree_node_class
class QuantizedWeight:
    def __init__(self, q, scale, scheme: Scheme, dtype):
        self.q, self.scale, self.scheme, self.dtype = q, scale, scheme, np.dtype(dtype)

    def tree_flatten(self):
        return (self.q, self.scale), (self.scheme, self.dtype)

    @classmethod
    def tree_unflatten(cls, aux, leaves):
        return cls(*leaves, *aux)

    @property
    def shape(self) -> tuple[int, ...]:
        *lead, k, n = self.q.shape
        return (*lead, k * 2 if self.scheme.bits == 4 else k, n)

    @property
    def ndim(self) -> int:
        return len(self.q.shape)

    @property
    def nbytes(self) -> int:
        return int(self.q.nbytes + self.scale.nbytes)

    def __getitem__(self, index) -> QuantizedWeight:
        """Index the leading (expert or slot) axes of both parts."""
        return QuantizedWeight(self.q[index], self.scale[index], self.scheme, self.dtype)

    def __repr__(self) -> str:
        return f"QuantizedWeight({self.scheme.name}, shape={self.shape}, dtype={self.dtype.name})"

    def dequantize(self, dtype=None) -> jax.Array:
        return dequantize(self.q, self.scale, self.scheme, self.dtype if dtype is None else dtype)


def dense(w):
    """The dense matrix of `w` in its compute dtype: `w` itself unless it is a QuantizedWeight."""
    return w.dequantize() if isinstance(w, QuantizedWeight) else w


def is_quantized(w) -> bool:
    return isinstance(w, QuantizedWeight)


def matmul(x: jax.Array, w, preferred_element_type=jnp.float32) -> jax.Array:
    """x [..., K] @ w [..., K, N] (jnp.matmul's broadcasting), x rounded to w's compute dtype: the product with
    dense(w), accumulated in `preferred_element_type`. int4 multiplies w's even and odd rows as two products of K/2
    (each half dequantized as `dequantize` does it, without interleaving them, which XLA writes as a copy of the
    whole matrix) and adds them: equal to the product with dense(w) up to the order of the sum."""
    if not (is_quantized(w) and w.scheme.bits == 4):
        wd = dense(w)
        return jnp.matmul(x.astype(wd.dtype), wd, preferred_element_type=preferred_element_type)
    xc = x.astype(w.dtype)
    even, odd = (_group_scaled(rows, w.scale, w.dtype) for rows in _nibbles(w.q))  # a group of G rows: G/2 each
    return (jnp.matmul(xc[..., 0::2], even, preferred_element_type=preferred_element_type)
            + jnp.matmul(xc[..., 1::2], odd, preferred_element_type=preferred_element_type))


def _nibbles(q: jax.Array) -> tuple[jax.Array, jax.Array]:
    """uint8 [..., K/2, N] -> (rows 2i, rows 2i+1) as int8 [..., K/2, N] each (the low and the high nibbles)."""
    b = jax.lax.bitcast_convert_type(q, jnp.int8)
    return jnp.right_shift(jnp.left_shift(b, 4), 4), jnp.right_shift(b, 4)  # arithmetic shifts sign-extend


def _group_scaled(values: jax.Array, scale: jax.Array, dtype) -> jax.Array:
    """values [..., R, N] times scale [..., S, N] (row r takes scale row r // (R / S)), in float32, as dtype."""
    *lead, r, n = values.shape
    groups = scale.shape[-2]
    grouped = values.astype(jnp.float32).reshape(*lead, groups, r // groups, n)
    grouped = grouped * scale.astype(jnp.float32)[..., None, :]
    return grouped.reshape(*lead, r, n).astype(dtype)


def unpack_int4(q: jax.Array) -> jax.Array:
    """uint8 [..., K/2, N] -> int8 [..., K, N] (row 2i from the low nibble, 2i+1 from the high one)."""
    *lead, half, n = q.shape
    return jnp.stack(_nibbles(q), axis=-2).reshape(*lead, 2 * half, n)


def pack_int4(values: jax.Array) -> jax.Array:
    """int8 [..., K, N] in [-8, 7] -> uint8 [..., K/2, N]."""
    *lead, k, n = values.shape
    pairs = values.reshape(*lead, k // 2, 2, n).astype(jnp.uint8)
    return (pairs[..., 0, :] & 0xF) | (pairs[..., 1, :] << 4)


def dequantize(q, scale, s: Scheme, dtype) -> jax.Array:
    if s.bits == 8:
        return (q.astype(jnp.float32) * scale.astype(jnp.float32)).astype(dtype)
    return _group_scaled(unpack_int4(q), scale, dtype)


def quantize(w, name: str | Scheme, dtype=None) -> QuantizedWeight:
    """w [..., K, N] (any float dtype) -> QuantizedWeight whose compute dtype is `dtype` (default: w's)."""
    s = scheme(name)
    problem = s.check(w.shape[-2])
    if problem:
        raise ValueError(problem)
    dtype = np.dtype(w.dtype if dtype is None else dtype)
    w = jnp.asarray(w, jnp.float32)
    if s.bits == 8:
        scale = jnp.max(jnp.abs(w), axis=-2, keepdims=True) / 127.0
        scale = jnp.where(scale == 0, 1.0, scale)
        q = jnp.clip(jnp.round(w / scale), -127, 127).astype(jnp.int8)
        return QuantizedWeight(q, scale, s, dtype)
    *lead, k, n = w.shape
    g = s.group_for(k)
    groups = w.reshape(*lead, k // g, g, n)
    pick = jnp.argmax(jnp.abs(groups), axis=-2, keepdims=True)
    scale = -jnp.take_along_axis(groups, pick, axis=-2) / 8.0  # [..., K/G, 1, N]
    scale = jnp.where(scale == 0, 1.0, scale).astype(s.scale_dtype)  # stored; the integers fit the stored scale
    values = jnp.clip(jnp.round(groups / scale.astype(jnp.float32)), -8, 7).astype(jnp.int8).reshape(*lead, k, n)
    return QuantizedWeight(pack_int4(values), scale[..., 0, :], s, dtype)


def zeros(lead: tuple[int, ...], k: int, n: int, name: str | Scheme, dtype) -> QuantizedWeight:
    """An all-zero QuantizedWeight [*lead, K, N] (slot pools), scales 1."""
    s = scheme(name)
    return QuantizedWeight(jnp.zeros((*lead, *s.q_shape(k, n)), s.q_dtype()),
                           jnp.ones((*lead, *s.scale_shape(k, n)), s.scale_dtype), s, dtype)


def shapes(lead: tuple[int, ...], k: int, n: int, name: str | Scheme) -> tuple[jax.ShapeDtypeStruct, ...]:
    """(q, scale) ShapeDtypeStructs of a QuantizedWeight [*lead, K, N]."""
    s = scheme(name)
    return (jax.ShapeDtypeStruct((*lead, *s.q_shape(k, n)), s.q_dtype()),
            jax.ShapeDtypeStruct((*lead, *s.scale_shape(k, n)), np.dtype(s.scale_dtype)))
