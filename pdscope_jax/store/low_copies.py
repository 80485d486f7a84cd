"""The host's low-precision (int4) copy of each routed expert, and what a slot holds once one is loaded.

Contract: with a quality that loads low copies (`sched.precision`), the expert store keeps, beside each expert at
its stored (base) precision, `low_copy(stack)`: the int4 quantization (`quant.formats`, groups of 64) of the base
weights as the model computes with them (`dense`: an int8 base is dequantized first), made expert by expert where
the stack lies. A copy moves those bytes over the link; `to_slot(w4, like)` turns it, inside the program that
writes the slot, into the slot pool's format `like`: dense in the compute dtype (a dense base: the int4 model's
weights exactly), or int8 requantized per output channel (an int8 base: int4's weights within half an int8 step,
about 1/32 of an int4 step). `round_trip(stack)` = what a slot holds after a low copy of each expert of the stack
(the tests' references). Pure jax; nothing here holds or moves host memory.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pdscope_jax.quant.formats import dense, is_quantized, quantize
from pdscope_jax.sched.precision import LOW


@functools.lru_cache(maxsize=None)
def _copier():
    # expert by expert (lax.map): the dense working copy is one expert's, not the stack's
    return jax.jit(lambda w: jax.lax.map(lambda expert: quantize(dense(expert), LOW), w))


def low_copy(stack):
    """The int4 QuantizedWeight [E, K, N] of a stack [E, K, N] (an array or a QuantizedWeight), where it lies."""
    return _copier()(stack)


def to_slot(w4, like):
    """int4 `w4` [..., K, N] in the format of `like` (the pool's part: an array, or an int8 QuantizedWeight)."""
    if is_quantized(like):
        return quantize(w4.dequantize(jnp.float32), like.scheme, like.dtype)
    return w4.dequantize(like.dtype)


@jax.jit
def round_trip(stack):
    """What the slots hold after a low copy of every expert of `stack` [E, K, N], in `stack`'s format."""
    return jax.lax.map(lambda expert: to_slot(quantize(dense(expert), LOW), expert), stack)
