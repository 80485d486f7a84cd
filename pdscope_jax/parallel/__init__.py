"""Expert parallelism of the whole-model path (all experts resident) over a `jax.sharding.Mesh`.

Contract: `mesh = expert_mesh(devices)` (one axis, `AXIS` = "experts", N devices of one or several processes);
`expert_parallel(model, mesh)` gives a copy of a built `CausalLM` whose routed experts are split E/N per device
and whose MoE blocks run them under `jax.shard_map`, adding the partial sums with `psum` (`routed`); the rest
of the model is replicated (`placement`). `expert_parallel_generator(model, mesh)` runs that copy as
`generation.Generator` runs the plain model (logits, generate), in one process or in each of several
(`jax.distributed`), every process passing the same model and inputs.
N must divide E (`ExpertParallelError` otherwise). docs/SCALING.md describes the layout and its costs.
"""

from pdscope_jax.parallel.mesh import AXIS, ExpertParallelError, check_split, expert_mesh, split_size
from pdscope_jax.parallel.placement import ShardedMoE, expert_parallel, expert_parallel_generator
from pdscope_jax.parallel.routed import routed_output

__all__ = ["AXIS", "ExpertParallelError", "ShardedMoE", "check_split", "expert_mesh", "expert_parallel",
           "expert_parallel_generator", "routed_output", "split_size"]
