"""An expert-parallel copy of a built model: weights placed on the mesh, each MoE block's routed part sharded.

Contract: `expert_parallel(model, mesh) -> CausalLM` returns a new model (the argument is left as it was) with
- every MoE layer's routed-expert parameters (`layers.L.mlp.experts.*`: gate_up [E,D,2F], down [E,F,D] and the
  scales of quantized experts) as global arrays sharded on their first axis over mesh axis "experts"
  (`NamedSharding(mesh, P("experts"))`); every other parameter (embedding, attention, router, shared experts,
  dense layers, norms, lm_head) replicated (`P()`);
- each `MoE` block replaced by a `ShardedMoE`, the same parameters at the same paths, whose `routed_output` is
  `parallel.routed.routed_output` (shard_map + psum); routing, shared experts and everything else unchanged.
`expert_parallel_generator(model, mesh)` is a `generation.Generator` of that copy with its inputs replicated on
the mesh: the plain model's logits and tokens (float32 tolerance), each device holding E/N experts per layer.
Both raise `ExpertParallelError` when N does not divide E.
Placement builds each device's shards from the model's arrays (`jax.make_array_from_callback`), so in a
multi-process run every process passes the same model and its own devices receive their shards.
"""

from __future__ import annotations

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from pdscope_jax.generation.generator import Generator
from pdscope_jax.models.layers import CausalLM, MoE
from pdscope_jax.parallel.mesh import AXIS, check_split
from pdscope_jax.parallel.routed import routed_output


class ShardedMoE(MoE):
    """An `MoE` whose routed experts run expert-parallel over `mesh` (a static attribute of the graph)."""

    def __init__(self, moe: MoE, mesh: Mesh):  # takes over moe's submodules: same parameter paths
        for name, value in vars(moe).items():
            if not name.startswith("_"):  # nnx's own bookkeeping stays this object's
                setattr(self, name, value)
        self.mesh = mesh

    def routed_output(self, h: jax.Array, weights: jax.Array, expert_ids: jax.Array) -> jax.Array:
        return routed_output(self.mesh, h, weights, expert_ids, *self.experts.weights())


def expert_parallel(model: CausalLM, mesh: Mesh) -> CausalLM:
    check_split(model.config.num_experts, mesh)
    graphdef, state = nnx.split(model)
    placed = [(path, var.replace(place(var.get_value(), NamedSharding(mesh, spec(path)))))
              for path, var in nnx.to_flat_state(state)]  # new Variables: the argument keeps its own
    copy = nnx.merge(graphdef, nnx.from_flat_state(placed))
    for layer in copy.layers:
        if layer.is_moe:
            layer.mlp = ShardedMoE(layer.mlp, mesh)
    return copy


def spec(path: tuple) -> P:
    """Routed experts (`layers.L.mlp.experts.<name>`, expert axis first) split over the axis; the rest replicated."""
    return P(AXIS) if tuple(path[-3:-1]) == ("mlp", "experts") else P()


def expert_parallel_generator(model: CausalLM, mesh: Mesh) -> Generator:
    return Generator(expert_parallel(model, mesh), input_sharding=NamedSharding(mesh, P()))


def place(value: jax.Array, sharding: NamedSharding) -> jax.Array:
    """A global array of `value` under `sharding`, each addressable device given its own block."""
    host = np.asarray(value)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])
