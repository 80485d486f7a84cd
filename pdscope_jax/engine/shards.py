"""The offload engine over several accelerators: each owns an equal share of every MoE layer's routed experts.

Contract:
- `owners(E, n, moe_layers, counts=None)` -> {layer: [n, E/n]} the model's expert ids each accelerator owns: equal
  blocks by id, or, from a hot table's activation counts, shares that even out each layer's counted traffic.
- `Shard`: accelerator `device`'s share (`experts[layer]`, `count` a layer), with its own expert store (host copies
  in that accelerator's `pinned_host` memory), slot pool, CPU experts, transfers (its link, its stager thread),
  executor and planner (set by the runner); they number the share's experts from 0. The first shard's accelerator
  is the lead: it runs the embedding, attention, routers, shared experts and dense layers and holds the KV cache;
  the others hold slot pools only. `build_shards(stores, owned, slots, ...)` -> a shard per store.
- `Shard.local(values [E, ...], layer)` -> its experts' rows (`local_counts({layer: [E]})` of each layer);
  `Shard.local_ids(ids, layer)` -> those of `ids` it owns, in its numbering;
- `Shard.take_planner(planner, moe_layers)`: the shard's new planner; its pool emptied (host copies stay, so
  nothing moves), its transfers cleared, then what the planner keeps resident loaded: every expert of the share
  (`keeps_all_resident`) or its hot experts, as far as free slots go;
- `Shard.view(r, layer, nxt)` -> a layer's `Routed` as the shard's executor and planner take it: h, weights and
  ids on its accelerator, tokens per expert (layer) and next-layer scores (nxt) of its experts only (the host
  copies of the routing keep the model's ids, which the executor maps back).
- `Shard.part(programs, (n, D), y_gpu, y_cpu, cpu_rows)` -> its routed output [1, n, D] float32 on its accelerator
  (zeros when it computed nothing).
- `MeshSum(devices)(parts)` -> the sum of the shards' parts, [n, D] float32 on the lead: a `psum` over the mesh
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
    experts: dict[int, np.ndarray]  # MoE layer -> the model's ids of the share's experts 0..count-1
    count: int  # experts per MoE layer in the share
    store: ExpertStore
    pool: SlotPool
    cpu_experts: CpuExperts
    transfers: Transfers
    executor: PlanExecutor
    planner: object = None

    def __post_init__(self):
        self._position = {}  # MoE layer -> [E]: each model expert's id in the share, -1 when another's
        for layer, experts in self.experts.items():
            position = np.full(int(experts.max()) + 1, -1, np.int64)
            position[experts] = np.arange(experts.size)
            self._position[layer] = position

    def local(self, values: np.ndarray, layer: int) -> np.ndarray:
        return values[self.experts[layer]]

    def local_ids(self, ids: np.ndarray, layer: int) -> np.ndarray:
        position = self._position[layer]
        ids = np.asarray(ids, np.int64)
        mine = position[np.minimum(ids, position.size - 1)]
        return mine[(ids < position.size) & (mine >= 0)]

    def local_counts(self, counts: dict) -> dict[int, np.ndarray]:
        return {layer: self.local(np.asarray(c), layer) for layer, c in counts.items()}

    def take_planner(self, planner, moe_layers) -> None:
        self.planner = planner
        for layer in moe_layers:
            self.pool.release(layer, np.arange(self.count))
        self.transfers.clear()
        for layer in moe_layers:  # what the planner keeps resident: every expert of the share, or its hot ones
            if planner.keeps_all_resident:
                experts = np.arange(self.count)
            elif hasattr(planner, "hot_experts"):
                experts = np.asarray(planner.hot_experts(layer))[: self.pool.free_slots(moe_layers)]
            else:
                return
            if experts.size:
                self.store.write(self.pool, layer, experts, self.pool.allocate(layer, experts, moe_layers))

    def view(self, r: Routed, layer: int, nxt: int | None) -> Routed:
        moved = {}
        if r.h.devices() != {self.device}:
            moved = dict(zip(("h", "w", "ids"), jax.device_put((r.h, r.w, r.ids), self.device)))
        scores = None if r.next_scores is None or nxt is None else self.local(r.next_scores, nxt)
        return dataclasses.replace(r, tokens=self.local(r.tokens, layer), next_scores=scores, **moved)

    def part(self, programs: dict, shape: tuple[int, int], y_gpu, y_cpu, cpu_rows) -> jax.Array:
        if y_gpu is None and y_cpu is None:
            return jnp.zeros((1, *shape), jnp.float32, device=self.device)
        return programs["routed_share"](shape[0], y_gpu, y_cpu, cpu_rows)


def owners(num_experts: int, n: int, moe_layers, counts: dict | None = None) -> dict[int, np.ndarray]:
    """MoE layer -> [n, E/n]: the model's ids of the experts each of n accelerators owns, each row ascending. Equal
    blocks by id; with activation counts {layer: [E]} (a hot table) the experts, most activated first, go to the
    accelerator with the fewest counted tokens that still has room, so that every link carries about as much of a
    layer's traffic (streams move whole shares alike; cached decode loads follow the counts)."""
    size = num_experts // n
    out = {}
    for layer in moe_layers:
        layer_counts = None if counts is None else counts.get(layer)
        if layer_counts is None:
            out[layer] = np.arange(num_experts).reshape(n, size)
            continue
        if len(layer_counts) != num_experts:
            raise ValueError(f"the hot table gives layer {layer} {len(layer_counts)} expert counts, the model has "
                             f"{num_experts} experts a layer: record it on this model (`bench --hot-table auto`)")
        load, shares = np.zeros(n), [[] for _ in range(n)]
        for expert in np.argsort(-np.asarray(layer_counts, np.float64), kind="stable"):
            k = min((k for k in range(n) if len(shares[k]) < size), key=lambda k: load[k])
            shares[k].append(int(expert))
            load[k] += layer_counts[expert]
        out[layer] = np.sort(np.array(shares), axis=1)
    return out


def build_shards(stores: list[ExpertStore], owned: dict[int, np.ndarray], slots: int, moe_layers, cfg, dtype,
                 programs: dict, cpu: jax.Device, costs, mark, cpu_min_rows: int, cpu_kernel: str) -> list[Shard]:
    """One shard per store (in the accelerators' order), shard k owning `owned[layer][k]` of each MoE layer, each
    with a pool of `slots` slots of its share's experts of `dtype` (quantized as `cfg.expert_quant`)."""
    shards = []
    for k, store in enumerate(stores):
        device = store.devices.accel
        experts = {layer: owned[layer][k] for layer in moe_layers}
        count = experts[moe_layers[0]].size
        pool = SlotPool(slots, moe_layers, count, cfg.hidden_size, cfg.moe_intermediate_size, dtype, device,
                        cfg.expert_quant)
        cpu_experts = CpuExperts(store, cpu_min_rows, kernel=cpu_kernel)
        transfers = Transfers(pool, store)
        executor = PlanExecutor(programs, pool, cpu_experts, transfers, Devices(device, cpu), costs, mark,
                                owned=experts if len(stores) > 1 else None, num_experts=cfg.num_experts)
        shards.append(Shard(device, experts, count, store, pool, cpu_experts, transfers, executor))
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
        _, n, d = parts[0].shape
        stacked = jax.make_array_from_single_device_arrays((len(parts), n, d), self._stacked, parts)
        summed = self._sum(stacked)  # replicated: every accelerator holds the sum
        return next(s.data for s in summed.addressable_shards if s.device == self.lead)
