"""The offload engine over several accelerators: each owns an equal share of every MoE layer's routed experts.

Contract:
- `Shard`: accelerator `device`'s share, experts [first, first + count) of every MoE layer, with its own expert
  store (host copies in that accelerator's `pinned_host` memory), slot pool, CPU experts, transfers (its link, its
  stager thread), executor and planner (`set_planner`); they number the share's experts from 0. The first shard's
  accelerator is the lead: it runs the embedding, attention, routers, shared experts and dense layers and holds
  the KV cache; the others hold slot pools only.
- `Shard.local(values [E, ...])` -> its experts' rows; `Shard.local_ids(ids)` -> those of `ids` it owns, numbered
  from 0; `Shard.view(r)` -> a layer's `Routed` as the shard's executor and planner take it: h, weights and ids
  on its accelerator, tokens per expert and next-layer scores of its experts only (the host copies of the
  routing keep the model's ids, which the executor maps with its `first_expert`).
- `Shard.part(programs, (n, D), y_gpu, y_cpu, cpu_rows)` -> its routed output [n, D] float32 on its accelerator
  (zeros when it computed nothing).
- `build_shards(stores, slots, ...)` -> a shard per store (one per accelerator, each holding its share).
- `MeshSum(devices)(parts)` -> the sum of the shards' parts [n, D] float32 on the lead: a `psum` over the mesh
  axis `parallel.AXIS` under `jax.shard_map` (XLA's all-reduce over the accelerators' links).
With one accelerator there is one shard of every expert, and nothing here runs between its executor and the sum.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from pdscope_jax.engine.cpu_experts import CpuExperts
from pdscope_jax.engine.execute import PlanExecutor
from pdscope_jax.engine.route import Routed
from pdscope_jax.engine.transfers import Transfers
from pdscope_jax.runtime import Devices
from pdscope_jax.parallel.mesh import AXIS, expert_mesh
from pdscope_jax.store.expert_store import ExpertStore
from pdscope_jax.store.slot_pool import SlotPool


@dataclasses.dataclass
class Shard:
    device: jax.Device
    first: int  # the model's id of the share's expert 0
    count: int  # experts per MoE layer in the share
    store: ExpertStore
    pool: SlotPool
    cpu_experts: CpuExperts
    transfers: Transfers
    executor: PlanExecutor
    planner: object = None

    def local(self, values: np.ndarray) -> np.ndarray:
        return values[self.first:self.first + self.count]

    def local_ids(self, ids: np.ndarray) -> np.ndarray:
        ids = np.asarray(ids)
        return ids[(ids >= self.first) & (ids < self.first + self.count)] - self.first

    def view(self, r: Routed) -> Routed:
        moved = {}
        if r.h.devices() != {self.device}:
            moved = dict(zip(("h", "w", "ids"), jax.device_put((r.h, r.w, r.ids), self.device)))
        return dataclasses.replace(r, tokens=self.local(r.tokens),
                                   next_scores=None if r.next_scores is None else self.local(r.next_scores),
                                   **moved)

    def part(self, programs: dict, shape: tuple[int, int], y_gpu, y_cpu, cpu_rows) -> jax.Array:
        if y_gpu is None and y_cpu is None:
            return jnp.zeros(shape, jnp.float32, device=self.device)
        return programs["routed_part"](shape[0], y_gpu, y_cpu, cpu_rows)


def build_shards(stores: list[ExpertStore], slots: int, moe_layers, cfg, dtype, programs: dict, cpu: jax.Device,
                 costs, mark, cpu_min_rows: int, cpu_kernel: str) -> list[Shard]:
    """One shard per store (in the accelerators' order), each with a pool of `slots` slots of its share's experts
    of `dtype` (quantized as `cfg.expert_quant`)."""
    count = cfg.num_experts // len(stores)
    shards = []
    for k, store in enumerate(stores):
        device = store.devices.accel
        pool = SlotPool(slots, moe_layers, count, cfg.hidden_size, cfg.moe_intermediate_size, dtype, device,
                        cfg.expert_quant)
        cpu_experts = CpuExperts(store, cpu_min_rows, kernel=cpu_kernel)
        transfers = Transfers(pool, store)
        executor = PlanExecutor(programs, pool, cpu_experts, transfers, Devices(device, cpu), costs, mark,
                                first_expert=k * count, num_experts=cfg.num_experts)
        shards.append(Shard(device, k * count, count, store, pool, cpu_experts, transfers, executor))
    return shards


class MeshSum:
    def __init__(self, devices):
        self.mesh = expert_mesh(devices)
        self.lead = devices[0]
        self._stacked = NamedSharding(self.mesh, P(AXIS))

        def add(parts):  # parts [1, n, D]: this device's
            return jax.lax.psum(parts[0], AXIS)

        self._sum = jax.jit(jax.shard_map(add, mesh=self.mesh, in_specs=P(AXIS), out_specs=P()))

    def __call__(self, parts: list[jax.Array]) -> jax.Array:
        n, d = parts[0].shape
        stacked = jax.make_array_from_single_device_arrays((len(parts), n, d), self._stacked,
                                                           [p.reshape(1, n, d) for p in parts])
        summed = self._sum(stacked)  # replicated: every accelerator holds the sum
        return next(s.data for s in summed.addressable_shards if s.device == self.lead)
