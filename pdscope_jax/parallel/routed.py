"""One MoE layer's routed experts under `jax.shard_map`: each device runs the experts it owns, `psum` adds them.

Contract: `routed_output(mesh, h [N,D], weights [N,K] f32, ids [N,K] int32, gate_up [E,D,2F], down [E,F,D])
-> [N, D] in h's dtype`, equal (float32 tolerance) to `MoE.routed_output` of the same arguments.
- The stacks are sharded on their first axis over `mesh` axis "experts" (device i holds experts
  [i*E/N, (i+1)*E/N)); h, weights and ids are replicated, and so is the result.
- Per device: `models.experts.combine_experts` over its E/N experts, with `slot_of` mapping the experts it owns
  to their local slots and every other expert to -1 (ignored), summed in float32; `jax.lax.psum` over the axis
  adds the N partial sums, which are rounded once to h's dtype, as the plain model rounds its sum.
- Weights may be `quant.formats.QuantizedWeight`s: both their leaves carry the expert axis first.
Every token visits every device (tokens replicated): the simple, correct first form. Each device reads only
its own experts' weights (decode's cost), but combine_experts computes the rows of masked assignments too, so
compute is not divided by N; for large batches the next step is an all-to-all that sends each device only the
tokens routed to its experts (and back), as `jax.lax.all_to_all` / `ragged_all_to_all` over the same axis.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

from pdscope_jax.models.experts import F32, combine_experts
from pdscope_jax.parallel.mesh import AXIS


def owned_slots(num_experts: int, owned: int) -> jax.Array:
    """slot_of [E] of this device (inside shard_map): local slot of the experts it owns, -1 for the others."""
    first = jax.lax.axis_index(AXIS) * owned
    e = jnp.arange(num_experts, dtype=jnp.int32)
    return jnp.where((e >= first) & (e < first + owned), e - first, -1).astype(jnp.int32)


def routed_output(mesh: Mesh, h: jax.Array, weights: jax.Array, ids: jax.Array, gate_up, down) -> jax.Array:
    num_experts = gate_up.shape[0]

    def local(h, weights, ids, gate_up, down):
        part = combine_experts(h, weights, ids, gate_up, down, owned_slots(num_experts, gate_up.shape[0]),
                               out_dtype=F32)
        return jax.lax.psum(part, AXIS)

    summed = jax.shard_map(local, mesh=mesh, in_specs=(P(), P(), P(), P(AXIS), P(AXIS)), out_specs=P())(
        h, weights, ids, gate_up, down)
    return summed.astype(h.dtype)
