"""The r smallest entries of a vector in one reduction: what the decode step's victim pick needs from every slot.

`smallest(values [S] int32, r) -> [r] int32`: the indices of the r smallest values, smallest first, ties to the lower
index: exactly `lax.top_k(-values, r)[1]` (r <= S), with no sort. Why: `top_k` over thousands of slots lowers to a
sort on the GPU, a kernel chain per MoE layer; this is one variadic reduction whose accumulator is the r smallest
(value, index) pairs seen, in order. Two sorted lists merge to the r smallest of their union by the merge-path rule
c_j = min over i of max(a_i, b_(j-i)) (a_0 = b_0 below everything), which is associative and commutative, so XLA may
reduce in any tree order. Pairs compare by value then index, so ties are broken as `top_k` breaks them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

_ABOVE = np.iinfo(np.int32).max  # an empty place of the accumulator: after every (value, index) of a real entry


def _less(a, b):
    """Whether pair a = (value, index) comes before pair b."""
    return (a[0] < b[0]) | ((a[0] == b[0]) & (a[1] < b[1]))


def _first(a, b):
    """The pair of a, b that comes first."""
    before = _less(a, b)
    return jnp.where(before, a[0], b[0]), jnp.where(before, a[1], b[1])


def _last(a, b):
    """The pair of a, b that comes last."""
    before = _less(a, b)
    return jnp.where(before, b[0], a[0]), jnp.where(before, b[1], a[1])


def _merge(r: int):
    """The reduction's computation: two accumulators (flat value, index, value, index, ...) -> the r first pairs of
    their union, in order."""
    def merge(a, b):
        a = [(a[2 * i], a[2 * i + 1]) for i in range(r)]
        b = [(b[2 * i], b[2 * i + 1]) for i in range(r)]
        out = []
        for j in range(1, r + 1):  # c_j: the first of the candidates max(a_i, b_(j-i)), i = 0 .. j
            best = _first(b[j - 1], a[j - 1])
            for i in range(1, j):
                best = _first(best, _last(a[i - 1], b[j - i - 1]))
            out.extend(best)
        return tuple(out)
    return merge


def smallest(values, r: int):
    """The indices [r] int32 of the r smallest of values [S] int32 (see the module docstring)."""
    n = values.shape[0]
    if not 0 < r <= n:
        raise ValueError(f"smallest: r={r} must lie in 1..{n} (the vector's length)")
    empty = jnp.full((n,), _ABOVE, jnp.int32)
    operands = (values.astype(jnp.int32), jnp.arange(n, dtype=jnp.int32)) + (empty, empty) * (r - 1)
    found = jax.lax.reduce(operands, (np.int32(_ABOVE),) * (2 * r), _merge(r), (0,))
    return jnp.stack(found[1::2])
