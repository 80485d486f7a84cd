"""Building an `OffloadRunner`'s parts from a model, in order: the budget, the expert store, the non-expert weights.

Contract (each function returns what it builds; nothing here is kept between calls):
- `plan_budget(cfg, rc, abstract, shapes)` -> (Budget, experts' dtype, cache dtype), from shapes alone, before
  anything is placed (activations measured by compiling the largest step's programs, `engine.activations`,
  unless `rc.activation_memory` is "estimated" or every expert fits the pool under the upper estimate anyway);
  raises `BudgetError` when the model does not fit.
- `new_store(shapes, moe_layers, devices, **store options)` -> an empty ExpertStore already page-locking the expert
  stacks' memory ahead (`ExpertStore.expect_stacks`; the driver's allocation), so that runs beside the budget; its
  caller ends that with `store.loaded()`, also on failure.
- `take_weights(model, weights, shapes, moe_layers, stores, owned, quant, dtype, low)` -> (the stores, filled,
  non-expert weights {path: array}); with several stores (one per accelerator, `engine.shards`; `new_store(...,
  shares=n)`), store k takes the experts `owned[layer][k]` of each layer (`engine.shards.owners`). Quantized
  experts (`quant`) reach the store as QuantizedWeights of compute dtype `dtype`, assembled from their integer and
  scale parameters; with `low` each layer's int4 copies
  (`store.low_copies.low_copy`) are made where the layer lies and kept beside it. `weights`: None (the model's
  own parameters), a flat `{path: array}` dict (routed-expert entries are popped as the store takes them, so the
  caller's dict keeps no second host copy), or a loader `loader(paths, placement) -> {path: array}` called once for
  every non-expert parameter, then once per MoE layer for its two expert stacks, each placed on the accelerator,
  copied into pinned host memory and dropped: the accelerator holds at most one layer of them (the budget's
  "transfer staging" line) and the host never holds the model twice. A progress bar counts the MoE layers once
  their experts reach `PROGRESS_BYTES`.
- `nbytes(array or ShapeDtypeStruct)` -> its bytes.
- `place_non_experts(graphdef, flat_state, weights, accel)` -> `Placed`: the model's non-expert weights on the
  accelerator split into the jitted pieces' arguments (expert stacks become empty arrays: attention, router and
  shared experts never read them).
- `analytic_costs(cfg, itemsize)`: the roofline cost table used when no measured table is named.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from rich.progress import Progress

from pdscope_jax import models
from pdscope_jax.engine.activations import measure_activations
from pdscope_jax.engine.programs import program_pieces
from pdscope_jax.generation.generator import CACHE_BUCKET
from pdscope_jax.models.static_graph import StaticGraph
from pdscope_jax.quant.formats import QuantizedWeight, scheme
from pdscope_jax.runtime import Devices, RuntimeConfig
from pdscope_jax.sched import CostTable
from pdscope_jax.store.budget import Budget, BudgetError, plan_budget as budget_of
from pdscope_jax.store.expert_store import ExpertStore, expert_paths, is_expert_path
from pdscope_jax.store.low_copies import low_copy
from pdscope_jax.weights.checkpoint import PROGRESS_BYTES


@dataclasses.dataclass
class Layer:
    graph: StaticGraph  # the layer's graphdef, hashed once
    state: Any
    moe: bool


@dataclasses.dataclass
class Placed:
    """The non-expert model on the accelerator, as the jitted pieces take it."""

    graph: StaticGraph  # the model without its layers (embedding, final norm, logits)
    state: Any
    layers: list[Layer]
    init_cache: Any  # jitted (batch, max_len, dtype) -> KV cache on the accelerator


def analytic_costs(cfg, itemsize: int) -> CostTable:
    """A roofline cost table for the benchmark node (H200, PCIe Gen5, AMX CPU) from PRIMITIVES.md's figures."""
    return CostTable.analytic(
        expert_bytes=cfg.expert_bytes(itemsize), flops_per_token=6 * cfg.hidden_size * cfg.moe_intermediate_size,
        pcie_GBps=50.0, cpu_GFLOPs=2000.0, gpu_TFLOPs=400.0, cpu_mem_GBps=30.0, model=cfg.name)


def split_abstract(abstract):
    """An abstract model's structure: (graphdef, flat NNX state, {path: ShapeDtypeStruct})."""
    graphdef, state = nnx.split(abstract)
    flat_state = nnx.to_flat_state(state)
    return graphdef, flat_state, {path_name(p): v.get_value() for p, v in flat_state}


def plan_budget(cfg, rc: RuntimeConfig, abstract, shapes: dict[str, Any]) -> tuple[Budget, np.dtype, np.dtype]:
    cache_dtype = np.dtype(shapes["embed.embedding"].dtype)
    # the experts' compute dtype: quantized experts compute in the model's dtype (their stored bytes are
    # `cfg.expert_bytes`, which the budget uses for slots, staging and transfers)
    expert_dtype = (cache_dtype if cfg.expert_quant else
                    np.dtype(shapes[f"layers.{cfg.moe_layers[0]}.mlp.experts.gate_up"].dtype))
    non_expert = sum(nbytes(s) for p, s in shapes.items() if not is_expert_path(p))
    kv = jax.eval_shape(lambda: abstract.init_cache(rc.max_batch, round_up(rc.max_seq_len, CACHE_BUCKET),
                                                    cache_dtype))
    kv_bytes = sum(nbytes(a) for a in jax.tree.leaves(kv))
    parts = dict(non_expert_bytes=int(non_expert), kv_cache_bytes=int(kv_bytes), itemsize=expert_dtype.itemsize)
    if rc.activation_memory == "measured":
        try:  # every expert fits the pool even under the upper estimate: measuring could change nothing
            upper = budget_of(cfg, rc, **parts)
            if upper.slots == len(cfg.moe_layers) * cfg.num_experts:
                return upper, expert_dtype, cache_dtype
        except BudgetError:
            pass
        measured = measure_activations(cfg, rc, abstract, kv, expert_dtype, cache_dtype)
        parts["activations"] = None if measured is None else measured.bytes
    return budget_of(cfg, rc, **parts), expert_dtype, cache_dtype


def nbytes(spec) -> int:
    """Bytes of an array or ShapeDtypeStruct."""
    return spec.size * np.dtype(spec.dtype).itemsize


def new_store(shapes: dict[str, Any], moe_layers, devices: Devices, *, cpu_view: str, host_alloc: str,
              expert_stacks: bool, shares: int = 1) -> ExpertStore:
    store = ExpertStore(devices, cpu_view=cpu_view, host_alloc=host_alloc, stacks=expert_stacks)
    store.expect_stacks(nbytes(s) // shares for paths in expert_paths(moe_layers).values()
                        for p in paths + tuple(q + "_scale" for q in paths) if (s := shapes.get(p)) is not None)
    return store


def take_weights(model, weights, shapes: dict[str, Any], moe_layers, stores: list[ExpertStore],
                 owned: dict | None = None, *, quant: str | None = None, dtype=None, low: bool = False
                 ) -> tuple[list[ExpertStore], dict]:
    accel = jax.sharding.SingleDeviceSharding(stores[0].devices.accel)

    def placement(path):  # the loader generates or reads every parameter on the accelerator
        return accel

    if callable(weights):  # a loader: non-expert parameters now, each layer's experts when the store asks
        loader = weights
        flat = loader([p for p in shapes if not is_expert_path(p)], placement)

        def layer_stacks(paths):
            return loader(list(paths), placement)
    else:  # a flat dict (or the model's own): expert entries are popped as the store takes them
        flat = models.to_flat(model) if weights is None else weights

        def layer_stacks(paths):
            return {p: flat.pop(p) for p in paths}

    abstract_values = [p for p, v in flat.items() if isinstance(v, jax.ShapeDtypeStruct)]
    if abstract_values:
        raise ValueError(f"no values for {len(abstract_values)} parameters (e.g. {abstract_values[0]}): an "
                         "abstract model needs `weights` (a dict or a loader)")
    layers = expert_paths(moe_layers)
    expert_bytes = sum(nbytes(s) for p, s in shapes.items() if is_expert_path(p))
    with Progress(transient=True, disable=expert_bytes < PROGRESS_BYTES) as progress:
        task = progress.add_task("routed experts -> pinned host memory (MoE layers)", total=len(layers))
        for layer, paths in layers.items():
            stacks = layer_stacks(paths + tuple(p + "_scale" for p in paths) if quant else paths)
            parts = [stacks[p] if quant is None else QuantizedWeight(stacks[p], stacks[p + "_scale"], scheme(quant),
                                                                     dtype) for p in paths]
            for store, share in zip(stores, _shares(parts, None if owned is None else owned[layer])):
                if low:
                    store.add_low_layer(layer, *(low_copy(part) for part in share))
                store.add_layer(layer, *share)
            del stacks, parts, share  # the layer's last references outside the stores
            progress.advance(task)
    return stores, flat


def _shares(parts: list, owned: np.ndarray | None):
    """The stacks `parts` ([E, ...] each) as the stores' shares: row k of `owned` [n, E/n] (the experts of the
    k-th store) for each store, or all of them for one (None); one share at a time, so at most one share is copied
    beside the layer."""
    if owned is None or len(owned) == 1:
        yield parts
        return
    for experts in owned:
        yield [part[experts] for part in parts]


def place_non_experts(graphdef, flat_state, weights: dict, accel_device) -> Placed:
    accel = jax.sharding.SingleDeviceSharding(accel_device)
    for p, var in flat_state:
        path = path_name(p)
        if is_expert_path(path):
            var.set_value(jax.device_put(jnp.zeros((0,), var.get_value().dtype), accel))
        else:
            var.set_value(jax.device_put(weights[path], accel))
    on_accel = nnx.merge(graphdef, nnx.from_flat_state(flat_state))
    graph, state, pieces = program_pieces(on_accel)
    layers = [Layer(*piece, layer.is_moe) for piece, layer in zip(pieces, on_accel.layers)]
    # one program on the accelerator rather than two eager `zeros` per layer
    init_cache = jax.jit(on_accel.init_cache, static_argnums=(0, 1, 2), out_shardings=accel)
    return Placed(graph, state, layers, init_cache)


def path_name(parts: tuple) -> str:
    return ".".join(str(p) for p in parts)


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def param_dtype(model) -> np.dtype:
    return np.dtype(model.embed.embedding.get_value().dtype)
