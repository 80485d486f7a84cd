"""The offload engine: runs a model whose routed experts do not fit the accelerator budget.

Contract: `OffloadRunner(model, runtime_config, weights=None, cost_table=None, predictor=None)`
- `model`: a `CausalLM` (concrete, or abstract from `models.abstract_model`); `weights`: None (take the model's
  own parameters), a flat `{path: array}` dict (the runner deletes routed-expert entries from it as it takes
  them in, so the caller's dict does not keep a second host copy alive), or a loader
  `loader(paths, placement) -> {path: array}` for the given paths, e.g. `random_state` or `load_state` over a
  subset. The runner calls it once for every non-expert parameter, then once per MoE layer for that layer's two
  expert stacks, with `placement` = the accelerator for all: each layer's experts are generated or read there,
  copied into pinned host memory and dropped, so the accelerator holds at most one layer of them (the budget's
  "transfer staging" line) and the host never holds the model twice. A progress bar counts the MoE layers taken
  in when their experts reach `PROGRESS_BYTES`.
  `cpu_view` and `host_alloc` choose how the expert store keeps its one host copy (see `offload.expert_store`);
  `expert_stacks` asks it for whole-layer stacks also with host_alloc 'jax' (a second host copy; with 'torch'
  they come free), from which device decode copies a layer's misses at once.
- The budget (`offload.budget`) is checked before anything is placed; the accelerator then holds the
  non-expert weights, the KV cache and ONE slot pool (`offload.slot_pool`) that is never reallocated. Every
  routed expert lives once in pinned host memory (`offload.expert_store`), which also gives the CPU backend
  zero-copy views for CPU compute (`offload.cpu_experts`).
- `logits(input_ids [B,T]) -> np.float32 [B,T,V]` and `generate(input_ids, max_new_tokens, temperature=0,
  top_k=None, seed=0) -> generation.GenerationResult` give the numbers of the plain model (same sampling
  helper, same keys: fold_in(key(seed), step)). `stats` reports per phase: seconds of CPU expert compute, GPU
  expert compute, transfer and exposed transfer, bytes moved, slot hit rate, prefetch accuracy, plus compiled
  program counts, the budget, host bytes per model byte and, where the device reports it, the allocator's
  peak against the budget, and the planner's own time (`planner_ms_per_layer`). `activation_counts[phase][layer]`
  holds the tokens routed to each expert since the last reset (raw counts for a hot table, see `sched.hot`).
  `warmup(batch, prompt_len, new_tokens)` compiles the programs of a shape before timing;
  `set_policy(name, options, **engine)` switches planners (and the engine switches below) without rebuilding.
  `timeline`: set it to an `offload.timeline.Timeline` to record when each stage of each MoE layer happened.
- RuntimeConfig switches read here: `cost_table` (a name or path, `sched.load_cost_table`; else the analytic
  table; planners see it with CPU times scaled by an in-situ calibration: per phase and step size, a running
  mean of each layer's measured CPU time over the table's, at least 1, reset when the policy changes: the table
  is measured on an idle machine, a layer's CPU experts run beside copies and the host's own work), `hot_table`
  (activation counts for the planners' hot-expert tables, preloaded), `async_io` (False: every staged copy is
  waited for where it is issued, before compute, so nothing overlaps: the ablation's synchronous I/O),
  `batched_gpu` (False: one GPU program per expert instead of one per layer).

Per MoE layer (`_moe_layer`: `_route`, `_plan`, `_execute`, then its timing is kept) the engine does, in this
order:
  route    attention + router + shared experts in one program (with the next layer's gate scores when the
           planner reads them; the jitted pieces are `offload.programs`); fetch routing to the host (the sync
           point; with few rows, decode, the MoE input comes along for the CPU experts);
  plan     `LayerDemand` -> the policy's planner (`sched.make_planner(rc.policy)`) -> `Plan`, checked;
  execute  commit transfers staged for this layer into their slots; free unloaded slots; hand the CPU experts
           to the CPU backend (`_run_cpu`, dispatched only: it computes on its own threads; with many rows,
           prefill, only the rows they read travel to the CPU and back, gathered on the accelerator); issue the
           loads of `load_now` (`_load_now`: `ExpertStore.write`, ordered before every later reader of the pool),
           so the CPU experts compute while they copy; STAGE (from the stager thread, `_stage_ahead`: a
           `device_put` holds the thread that issues it) the next layer's prefetch, or in prefill its
           whole expert set when two layers fit the pool (`stream_next_layer`, `_issue_next`; `_stream` takes
           the slots streamed into for layers already computed, so resident experts stay), submitted before
           compute is dispatched (a copy issued from a second thread overlaps compute, PRIMITIVES.md); dispatch
           the GPU experts (`_run_gpu`: one `combine_experts` program over the pool with a slot_of map); hand
           the GPU result and the copies to helper threads that stamp when each is done; wait for the CPU part;
           add the parts and the shared experts;
  record   keep the layer's times (`offload.stats.LayerTiming`); the step adds them to the statistics at its
           end (`_settle`), so no layer waits for its own compute and the next layer's programs queue behind it.
Decode as one accelerator program per step (`offload.device_decode`) replaces all of the above in decode for the
policies in `device_decode.DEVICE_DECODE_POLICIES` when RuntimeConfig.device_decode, async_io and batched_gpu are on
and the pool has more slots than a layer's distinct experts (`_decodes_on_device`): no planner call, no host round
trip; its steps count in the decode statistics (`device_steps`) with hits and bytes but no time split.
With `async_io` off, each copy is waited for where it is issued and the CPU experts start after the copies.
When the policy streamed layers in the last prefill step, the next prefill step stages the first MoE layer's
experts before the embedding, so that copy hides behind the layers before it.
Next-layer scores for planners that want them (`fate`, `pdscope`): `fate` always uses the next layer's gate
applied to this layer's MoE input (Fate's own predictor, computed by the route program itself: one dispatch);
`pdscope` uses a predictor object's `predict(layer=, phase=, a=, w=, e=) -> [E] or [N, E]` probabilities when one
is given, else that gate too, in both phases: they come to the host with the routing, in its round trip, and
feed AdaptSched's streaming test and, where it does not stream, its prefetches. (Until call 50 `pdscope` got none
in prefill when two full layers fit the pool; its plans then prefetched nothing, and Qwen3-30B-A3B, whose
4,096-token prompt does not pay for streaming whole layers, loaded about 1,160 experts on demand where `fate`
prefetched them, call 40.) Token counts are padded to buckets
(`RuntimeConfig.decode_buckets` / `prefill_buckets`), so the set of compiled programs is bounded; padded rows
route but carry no weight in any statistic. Prefill runs a whole prompt at batch 1 and chunks of
`prefill_chunk` tokens per sequence otherwise.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from rich.progress import Progress

from pdscope_jax import models
from pdscope_jax.generation.generator import CACHE_BUCKET, GenerationResult, check_sampling
from pdscope_jax.store.budget import Budget, BudgetError, plan_budget
from pdscope_jax.engine import device_decode
from pdscope_jax.engine.cpu_experts import DENSE_MAX_ROWS, CpuExperts, compact_rows, compact_sizes
from pdscope_jax.store.expert_store import FUSED_MAX, ExpertStore, Staged, expert_paths, is_expert_path
from pdscope_jax.engine.programs import build_programs, cache_size
from pdscope_jax.store.slot_pool import SlotPool
from pdscope_jax.engine.stats import LayerTiming, PhaseStats
from pdscope_jax.engine.timeline import Timeline
from pdscope_jax.runtime import Devices, RuntimeConfig, bucket, select_devices
from pdscope_jax.models.static_graph import StaticGraph, static_graph
from pdscope_jax.sched import (CostTable, LayerDemand, ObservingPlanner, Plan, activation_counts, check_plan,
                               load_cost_table, make_planner, planner_class)
from pdscope_jax.weights.checkpoint import PROGRESS_BYTES

LOGIT_ROWS = 256  # logits are produced for at most this many tokens at a time
CPU_CALIBRATION = 0.25  # weight of one layer's measured / predicted CPU time in its (phase, step size) running scale
CPU_SCALE_MAX = 64.0  # Qwen3-30B-A3B's 4,096-token prefill sat at an earlier cap of 8 (H200, call 50)


@dataclasses.dataclass
class _Layer:
    graph: StaticGraph  # the layer's graphdef, hashed once
    state: Any
    moe: bool


@dataclasses.dataclass
class _Routed:
    """One MoE layer after routing: device arrays padded to Nb rows, host copies of the real rows."""

    x: jax.Array  # [B, T, D] residual stream after attention
    h: jax.Array  # [Nb, D] MoE input
    w: jax.Array  # [Nb, K] routing weights
    ids: jax.Array  # [Nb, K] expert ids
    shared: jax.Array  # [N, D] shared-expert output
    layer_cache: Any
    h_host: np.ndarray | None  # [Nb, D] host copy of h, fetched with the routing when there are few rows
    rows: np.ndarray  # [Nv] indices of real tokens among the Nb rows
    w_host: np.ndarray  # [Nv, K]
    ids_host: np.ndarray  # [Nv, K]
    tokens: np.ndarray  # [E] tokens routed to each expert
    next_scores: np.ndarray | None  # [E]

    @property
    def padded_rows(self) -> int:
        """Nb: the step's rows padded to their bucket (the CPU calibration keeps one scale per phase and size)."""
        return self.h.shape[0]


def analytic_costs(cfg, itemsize: int) -> CostTable:
    """A roofline cost table for the benchmark node (H200, PCIe Gen5, AMX CPU) from PRIMITIVES.md's figures."""
    return CostTable.analytic(
        expert_bytes=cfg.expert_bytes(itemsize), flops_per_token=6 * cfg.hidden_size * cfg.moe_intermediate_size,
        pcie_GBps=50.0, cpu_GFLOPs=2000.0, gpu_TFLOPs=400.0, cpu_mem_GBps=30.0, model=cfg.name)


def _split_abstract(abstract):
    """An abstract model's structure: (graphdef, flat NNX state, {path: ShapeDtypeStruct})."""
    graphdef, state = nnx.split(abstract)
    flat_state = nnx.to_flat_state(state)
    return graphdef, flat_state, {_path(p): v.get_value() for p, v in flat_state}


class OffloadRunner:
    def __init__(self, model, runtime_config: RuntimeConfig, weights=None, *, cost_table: CostTable | None = None,
                 predictor=None, devices: Devices | None = None, cpu_view: str = "alias", host_alloc: str = "auto",
                 expert_stacks: bool = False):
        rc = runtime_config
        if rc.policy is None:
            raise ValueError("OffloadRunner needs RuntimeConfig.policy (a planner name); without one the model "
                             "runs whole (generation.Generator)")
        self.config = cfg = model.config
        self.runtime = rc
        self.devices = devices or select_devices()
        self.predictor = predictor
        self._moe_layers = cfg.moe_layers
        self._next_moe = dict(zip(self._moe_layers[:-1], self._moe_layers[1:]))
        self._prev_moe = dict(zip(self._moe_layers[1:], self._moe_layers[:-1]))

        abstract = models.abstract_model(cfg, _param_dtype(model))  # shapes only: nothing placed yet
        graphdef, flat_state, shapes = _split_abstract(abstract)
        expert_dtype = self._plan_budget(abstract, shapes, cost_table)
        non_expert = self._take_weights(model, weights, shapes, cpu_view, host_alloc, expert_stacks)
        self._place_non_experts(graphdef, flat_state, non_expert)
        self.pool = SlotPool(self.budget.slots, self._moe_layers, cfg.num_experts, cfg.hidden_size,
                             cfg.moe_intermediate_size, expert_dtype, self.devices.accel)
        self.cpu_experts = CpuExperts(self.store, rc.cpu_min_rows)
        self._programs = build_programs()
        self._decode_step = device_decode.build_decode_step()
        self._step_shapes: set[tuple[int, int, int]] = set()  # (batch, tokens, padded rows) of steps run (warm-up)
        # layer -> (staging of its experts, issued on the stager thread; their slots)
        self._pending: dict[int, tuple[concurrent.futures.Future[Staged], np.ndarray]] = {}
        self._prefetched: dict[int, np.ndarray] = {}  # layer -> experts staged for it before it routed
        self._streamed: dict[int, np.ndarray] = {}  # layer -> experts streamed into it (transient slots)
        self._waiter = concurrent.futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="offload-wait")
        # issues staged copies: `device_put` holds its caller ~0.25 ms + 0.05 ms per expert on the H200, a helper
        # thread 0.02 ms (benchmarks/probes/probe_copy_issue.py); one worker keeps them in issue order
        self._stager = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="offload-stage")
        self._unsettled: list[LayerTiming] = []
        # in-situ CPU calibration: measured / cost-table CPU seconds (>= 1) per phase and step size (padded rows;
        # absent: 1), and the scaled tables
        self._cpu_scale: dict[tuple[str, int], float] = {}
        self._scaled_costs: dict[float, CostTable] = {}
        self.warmed_shapes: set[tuple[int, int, int]] = set()  # (batch, prompt_len, new_tokens) warmed up
        self.track_memory = False
        self.timeline: Timeline | None = None  # set to a Timeline to record each layer's stages (a profile)
        self.memory_trace: list[dict[str, int | None]] = []
        self.set_policy(rc.policy, rc.policy_options)

    # ---- construction (in __init__'s order) --------------------------------------------------------------
    def _plan_budget(self, abstract, shapes: dict[str, Any], cost_table: CostTable | None) -> np.dtype:
        """From the abstract model's shapes, before anything is placed: set `cache_dtype`, `budget` (BudgetError
        when the model does not fit) and `costs`. -> the routed experts' dtype."""
        cfg, rc = self.config, self.runtime
        expert_dtype = np.dtype(shapes[f"layers.{self._moe_layers[0]}.mlp.experts.gate_up"].dtype)
        self.cache_dtype = np.dtype(shapes["embed.embedding"].dtype)
        non_expert = sum(s.size * np.dtype(s.dtype).itemsize for p, s in shapes.items() if not is_expert_path(p))
        kv = jax.eval_shape(lambda: abstract.init_cache(rc.max_batch, _round_up(rc.max_seq_len, CACHE_BUCKET),
                                                        self.cache_dtype))
        kv_bytes = sum(a.size * np.dtype(a.dtype).itemsize for a in jax.tree.leaves(kv))
        self.budget: Budget = plan_budget(cfg, rc, non_expert_bytes=int(non_expert), kv_cache_bytes=int(kv_bytes),
                                          itemsize=expert_dtype.itemsize)
        self._check_policy(rc.policy)
        self.costs = cost_table or (load_cost_table(rc.cost_table) if rc.cost_table
                                    else analytic_costs(cfg, expert_dtype.itemsize))
        return expert_dtype

    def _take_weights(self, model, weights, shapes: dict[str, Any], cpu_view: str, host_alloc: str,
                      expert_stacks: bool) -> dict:
        """Build `store`, moving every routed expert into it one MoE layer at a time (see the module docstring).
        -> the non-expert weights {path: array}."""
        accel = jax.sharding.SingleDeviceSharding(self.devices.accel)

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
        self.store = ExpertStore(self.devices, cpu_view=cpu_view, host_alloc=host_alloc, stacks=expert_stacks)
        layers = expert_paths(self._moe_layers)
        expert_bytes = sum(shapes[p].size * np.dtype(shapes[p].dtype).itemsize for ps in layers.values() for p in ps)
        with Progress(transient=True, disable=expert_bytes < PROGRESS_BYTES) as progress:
            task = progress.add_task("routed experts -> pinned host memory (MoE layers)", total=len(layers))
            for layer, paths in layers.items():
                stacks = layer_stacks(paths)
                self.store.add_layer(layer, stacks[paths[0]], stacks[paths[1]])
                del stacks  # the layer's last reference outside the store
                progress.advance(task)
        return flat

    def _place_non_experts(self, graphdef, flat_state, weights: dict) -> None:
        """Fill the abstract model's state with the non-expert weights on the accelerator (expert stacks become
        empty arrays: attention, router and shared experts never read them) and split it into the jitted pieces'
        arguments: `_graph`/`_state` (the model without its layers), `_layers` (per layer) and `_init_cache`."""
        accel = jax.sharding.SingleDeviceSharding(self.devices.accel)
        for p, var in flat_state:
            path = _path(p)
            if is_expert_path(path):
                var.set_value(jax.device_put(jnp.zeros((0,), var.get_value().dtype), accel))
            else:
                var.set_value(jax.device_put(weights[path], accel))
        on_accel = nnx.merge(graphdef, nnx.from_flat_state(flat_state))
        self._layers = []
        for layer in on_accel.layers:
            layer_graphdef, state = nnx.split(layer)
            self._layers.append(_Layer(static_graph(layer_graphdef), state, layer.is_moe))
        # one program on the accelerator rather than two eager `zeros` per layer
        self._init_cache = jax.jit(on_accel.init_cache, static_argnums=(0, 1, 2), out_shardings=accel)
        # the whole-model pieces (embedding, logits) get the model without its layers: passing every layer's
        # arrays to each of their calls cost about a millisecond per decode step in argument handling alone
        layers, on_accel.layers = on_accel.layers, nnx.List([])
        graphdef, self._state = nnx.split(on_accel)
        on_accel.layers = layers
        self._graph = static_graph(graphdef)

    # ---- setup -----------------------------------------------------------------------------------------
    def set_policy(self, policy: str, policy_options=(), **engine) -> None:
        """Switch to another planner: empties the slot pool (host copies stay, so this moves nothing), preloads
        what the new policy keeps resident and resets the statistics. The pool itself is not reallocated.
        `engine` may change the RuntimeConfig fields `hot_table`, `async_io`, `batched_gpu` and `device_decode` at
        the same time.
        With a hot table, planners that have one (`HOT_POLICIES`) get its `activation_counts`. `hot_per_layer`
        defaults to the whole pool split evenly over the MoE layers for `static` (it loads nothing at run time);
        for `pdscope` to the pool less two full layers when those fit (prefill streams every other expert
        through the two layer buffers, which decode then uses for its loads and prefetches), else a quarter of
        it; and to a quarter of it for `greedy` (the rest of the pool serves its loads)."""
        unknown = set(engine) - {"hot_table", "async_io", "batched_gpu", "device_decode"}
        if unknown:
            raise TypeError(f"set_policy: unknown engine options {sorted(unknown)}")
        self._check_policy(policy)
        if policy != self.runtime.policy:  # the calibration learned under one policy's load is not another's
            self._cpu_scale.clear()
        self.runtime = self.runtime.replace(policy=policy, policy_options=policy_options, **engine)
        options = self.runtime.policy_kwargs
        hot_table = self.runtime.hot_table
        hot_slots = planner_class(policy).hot_slots(self.pool.num_slots, self.config.num_experts,
                                                    self.pool.can_double_buffer, bool(hot_table))
        if hot_slots is not None:
            if hot_table:
                options.setdefault("activation_counts", activation_counts(hot_table))
            options.setdefault("hot_per_layer", min(self.config.num_experts, hot_slots // len(self._moe_layers)))
        self.planner = make_planner(policy, **options)
        self._hot_counts = options.get("activation_counts")  # {layer: [E]} or None
        self._observing = isinstance(self.planner, ObservingPlanner)  # a Protocol check: slow, so once here
        self._wants_scores = self.planner.reads_next_scores
        for layer in self._moe_layers:
            self.pool.release(layer, np.arange(self.config.num_experts))
        self._pending.clear()
        self._prefetched.clear()
        self._streamed.clear()
        self._streams_prefill = False
        self._preload()
        self.reset_stats()

    def _check_policy(self, policy: str | None) -> None:
        total = len(self._moe_layers) * self.config.num_experts
        if planner_class(policy).keeps_all_resident and self.budget.slots < total:
            raise BudgetError(f"policy {policy!r} keeps every expert resident: {total} slots needed, the budget "
                              f"gives {self.budget.slots} ({self.budget.describe()})")

    def _preload(self) -> None:
        """Resident sets the policy asks for: every expert for 'gpu', the hot table for planners that have one."""
        for layer in self._moe_layers:
            if self.planner.keeps_all_resident:
                experts = np.arange(self.config.num_experts)
            elif hasattr(self.planner, "hot_experts"):
                experts = np.asarray(self.planner.hot_experts(layer))[: self.pool.free_slots(self._moe_layers)]
            else:
                return
            if experts.size:
                self.store.write(self.pool, layer, experts, self.pool.allocate(layer, experts, self._moe_layers))

    def reset_stats(self) -> None:
        self.phase_stats = {"prefill": PhaseStats(), "decode": PhaseStats()}
        self._unsettled.clear()  # layers of a step that raised before settling
        # tokens routed to each expert, per phase and MoE layer (real tokens only): a hot table's raw counts
        self.activation_counts = {phase: {layer: np.zeros(self.config.num_experts, np.int64)
                                          for layer in self._moe_layers} for phase in ("prefill", "decode")}
        self.device_peak_bytes: int | None = None  # the allocator's peak, on devices that report one
        self.pool.evictions = 0

    @property
    def compiled_programs(self) -> dict[str, int]:
        """Programs compiled so far, per kind (jit cache sizes; None where this jax does not expose them)."""
        counts = {name: cache_size(fn) for name, fn in self._programs.items()}
        counts["decode_step"] = cache_size(self._decode_step)
        counts["init_cache"] = cache_size(self._init_cache)
        counts["slot_commit"] = self.store.compiled_programs
        counts["cpu_expert"] = self.cpu_experts.compiled_programs
        counts["total"] = sum(v for v in counts.values() if v is not None)
        return counts

    @property
    def stats(self) -> dict[str, Any]:
        return {
            "policy": self.runtime.policy,
            "async_io": self.runtime.async_io,
            "batched_gpu": self.runtime.batched_gpu,
            "device_decode": self.runtime.device_decode,
            "hot_table": self.runtime.hot_table,
            "prefill": self.phase_stats["prefill"].to_dict(),
            "decode": self.phase_stats["decode"].to_dict(),
            "compiled_programs": self.compiled_programs,
            "slots": self.pool.num_slots,
            "double_buffering": self.pool.can_double_buffer,
            "evictions": self.pool.evictions,
            # the in-situ CPU calibration the planners see now, per "phase rows" (absent: 1)
            "cpu_cost_scale": {f"{phase} {rows}": scale for (phase, rows), scale in sorted(self._cpu_scale.items())},
            "budget": {name: value for name, value in self.budget.lines()},
            "host_expert_bytes": self.store.host_bytes,
            "host_bytes_per_model_byte": self.store.host_bytes_per_model_byte,
            "device_peak_bytes": self.device_peak_bytes,
            "within_budget": None if self.device_peak_bytes is None else self.device_peak_bytes <= self.budget.total,
        }

    # ---- public API ------------------------------------------------------------------------------------
    def logits(self, input_ids) -> np.ndarray:
        ids = self._check(input_ids, 0)
        b, t = ids.shape
        out = np.zeros((b, t, self.config.vocab_size), np.float32)
        cache, chunks = self._start(ids, 0)
        for c0, x, cache in self._prefill(chunks, cache, t):
            width = x.shape[1]
            for start, size, lo, hi in _logit_windows(width, min(width, t - c0), max(1, LOGIT_ROWS // b)):
                rows = np.asarray(self._programs["logits"](self._graph, self._state, x, start, size))
                out[:, c0 + lo:c0 + hi] = rows[:, lo - start:hi - start]
        return out

    def generate(self, input_ids, max_new_tokens: int = 64, temperature: float = 0.0, top_k: int | None = None,
                 seed: int = 0) -> GenerationResult:
        check_sampling(max_new_tokens, temperature, top_k, self.config.vocab_size)
        ids = self._check(input_ids, max_new_tokens)
        b, t = ids.shape
        temperature = float(temperature)
        root = jax.random.key(seed)
        next_token = self._programs["next_token"]
        accel = self.devices.accel

        start = time.perf_counter()
        cache, chunks = self._start(ids, max_new_tokens)
        token = None  # the first new token: sampled in the chunk that holds the prompt's last token, t - 1
        for c0, x, cache in self._prefill(chunks, cache, t):
            if c0 <= t - 1 < c0 + x.shape[1]:
                token = next_token(self._graph, self._state, x, t - 1 - c0,
                                   jax.device_put(jax.random.fold_in(root, 0), accel), temperature, top_k)
        if token is None:  # no chunk holds a real token
            raise ValueError(f"generate needs a prompt of at least one token, got shape {ids.shape}")
        tokens = [np.array(token)]  # a host copy (np.asarray could alias the buffer on CPU); waits
        prefill_seconds = time.perf_counter() - start
        self.phase_stats["prefill"].generate_seconds += prefill_seconds

        start = time.perf_counter()
        if max_new_tokens > 1 and self._decodes_on_device(b):
            tokens += self._decode_on_device(token, cache, t, max_new_tokens, root, temperature, top_k)
        for step in range(len(tokens), max_new_tokens):
            positions = jax.device_put(np.full((b, 1), t + step - 1, np.int32), accel)
            x, cache = self._step(token[:, None], positions, cache, "decode", np.ones(b, bool))
            token = next_token(self._graph, self._state, x, 0,
                               jax.device_put(jax.random.fold_in(root, step), accel), temperature, top_k)
            tokens.append(np.array(token))  # a host copy, so nothing on the accelerator grows with the output
            if self.track_memory:
                self.memory_trace.append(self.device_memory())
        decode_seconds = time.perf_counter() - start
        self.phase_stats["decode"].generate_seconds += decode_seconds
        return GenerationResult.timed(np.stack(tokens, axis=1), t, prefill_seconds, decode_seconds)

    def warmup(self, batch: int, prompt_len: int, new_tokens: int = 2) -> dict[str, int]:
        """Compile the programs of this shape: one generation on dummy tokens, then what routing decides
        whether a real run needs: every CPU expert row bucket for the token counts it used, the layer
        combination with and without GPU and CPU parts, and every slot-commit batch size. Then the pool and the
        statistics start afresh, as after `set_policy`."""
        self.generate(np.zeros((batch, prompt_len), np.int32), max_new_tokens=max(new_tokens, 2))
        first = self._moe_layers[0]
        for n in sorted({n_pad for _, _, n_pad in self._step_shapes}):
            self.cpu_experts.precompile(first, n, self.cache_dtype)
        self._precompile_combine()
        self._precompile_slot_writes(first)
        self.set_policy(self.runtime.policy, self.runtime.policy_options)
        self.warmed_shapes.add((batch, prompt_len, new_tokens))
        return self.compiled_programs

    def _precompile_slot_writes(self, layer: int) -> None:
        """Compile every slot-writing program a run can ask for: the commits of staged copies (power-of-two
        sizes up to the one a whole layer pads to) and the pull-and-commit loads (each count up to FUSED_MAX)."""
        limit, size = min(self.config.num_experts, self.pool.num_slots), 1
        while limit:  # commits pad to a power of two: up to the one `limit` experts pad to
            experts = np.arange(min(size, limit))
            self.pool.release(layer, experts)
            self.store.commit(self.pool, self.store.stage(layer, experts), self.pool.allocate(layer, experts))
            if size >= limit:
                break
            size *= 2
        for size in range(1, min(FUSED_MAX, limit) + 1):
            experts = np.arange(size)
            self.pool.release(layer, experts)
            self.store.write(self.pool, layer, experts, self.pool.allocate(layer, experts))

    def _precompile_combine(self) -> None:
        """Run `moe_combine` on zeros for each shape seen with every mix of parts (GPU only, CPU only, both,
        neither: a layer's plan decides which one it gets), the CPU part whole (few rows) or compacted to each
        size it can take, with `take_rows` for those sizes."""
        accel, dtype, d = self.devices.accel, self.cache_dtype, self.config.hidden_size

        def zeros(shape, kind=dtype):
            return jax.device_put(np.zeros(shape, kind), accel)

        for b, t, rows in sorted(self._step_shapes):
            x, shared, y_gpu = zeros((b, t, d)), zeros((b * t, d)), zeros((rows, d))
            if rows <= DENSE_MAX_ROWS:
                cpu_parts = [(zeros((rows, d), np.float32), None)]
            else:
                cpu_parts = [(zeros((size, d), np.float32), zeros(size, np.int32))
                             for size in compact_sizes(rows, self.cpu_experts.min_rows)]
                for _, take in cpu_parts:
                    self._programs["take_rows"](y_gpu, take)
            self._programs["moe_combine"](x, shared, y_gpu, None, None)
            self._programs["moe_combine"](x, shared, None, None, None)
            for y_cpu, take in cpu_parts:
                self._programs["moe_combine"](x, shared, None, y_cpu, take)
                self._programs["moe_combine"](x, shared, y_gpu, y_cpu, take)

    def device_memory(self) -> dict[str, int | None]:
        """Accelerator bytes held by live arrays, and the device allocator's bytes in use where it reports them."""
        live = sum(a.nbytes for a in jax.live_arrays() if self.devices.accel in a.devices()
                   and a.sharding.memory_kind in (None, "device"))
        reported = (self.devices.accel.memory_stats() or {}).get("bytes_in_use")
        return {"live_array_bytes": int(live), "bytes_in_use": reported}

    # ---- decode as one accelerator program per step (offload.device_decode) ----------------------------
    # `generate` decodes this way when `_decodes_on_device`: the policy keeps every activated expert on the
    # accelerator in decode (`device_decode.DEVICE_DECODE_POLICIES`), and RuntimeConfig's device_decode, async_io
    # and batched_gpu are on; `ondemand` keeps an LRU set, `pdscope` the same with its hot table's favourites
    # worth more (`_decode_bonus`).
    def _decode_bonus(self, batch: int) -> np.ndarray | None:
        """[Lm, E] clock ticks each expert's popularity adds to its worth in decode's device-side cache (see
        `device_decode`): for `pdscope` with a hot table, its activations over its layer's mean (1 for an expert
        of average popularity) times the pool's turnover, the ticks in which a step's misses could replace every
        slot (slots / distinct experts a layer can pick); None (LRU) otherwise."""
        if not self.planner.decode_popularity or not self._hot_counts:
            return None
        table = np.stack([np.asarray(self._hot_counts[layer], np.float64) for layer in self._moe_layers])
        over_mean = table / np.maximum(table.mean(axis=1, keepdims=True), 1e-12)
        turnover = self.pool.num_slots / min(batch * self.config.num_experts_per_tok, self.config.num_experts)
        return np.round(over_mean * turnover).astype(np.int32)

    def _decodes_on_device(self, batch: int) -> bool:
        rc = self.runtime
        picks = min(batch * self.config.num_experts_per_tok, self.config.num_experts)
        return (rc.device_decode and rc.async_io and rc.batched_gpu
                and self.planner.decodes_on_device and device_decode.fits(self.pool, picks))

    def _decode_on_device(self, token, cache: list, t: int, max_new_tokens: int, root, temperature: float,
                          top_k: int | None) -> list[np.ndarray]:
        """Tokens 1.. max_new_tokens - 1 after `token`, one accelerator program per step; the pool's table lives
        on the accelerator meanwhile and comes back at the end. Each token comes to the host two steps behind its
        step, so the host never waits for the step it just dispatched."""
        for layer in list(self._pending):
            self._commit_staged(layer)  # nothing staged stays behind the table's upload
        self._streamed.clear()
        stats = self.phase_stats["decode"]
        waited = time.perf_counter()
        jax.block_until_ready((self.pool.gate_up, self.pool.down))  # prefill's queued work apart from the steps'
        stats.handoff_seconds += time.perf_counter() - waited
        accel, b = self.devices.accel, token.shape[0]
        table = device_decode.upload(self.pool, self._moe_layers, self._decode_bonus(b), accel)
        experts = tuple(self.store.layer_stacks(layer) or self.store.layer_experts(layer) for layer in self._moe_layers)
        graphs = tuple(layer.graph for layer in self._layers)
        states = tuple(layer.state for layer in self._layers)
        positions = jax.device_put(np.full((b, 1), t, np.int32), accel)
        step = jax.device_put(np.int32(1), accel)
        key = jax.device_put(root, accel)
        caches = tuple(cache)
        in_flight, tokens = [], []
        start = time.perf_counter()
        for _ in range(1, max_new_tokens):
            token, positions, step, caches, self.pool.gate_up, self.pool.down, table = self._decode_step(
                graphs, self._graph, self._moe_layers, temperature, top_k, states, self._state, experts, token,
                positions, caches, key, step, self.pool.gate_up, self.pool.down, table)
            token.copy_to_host_async()
            in_flight.append(token)
            if len(in_flight) > 2:
                tokens.append(np.array(in_flight.pop(0)))
            if self.track_memory:
                self.memory_trace.append(self.device_memory())
        tokens += [np.array(tk) for tk in in_flight]
        seconds = time.perf_counter() - start
        counts = device_decode.download(table, self.pool, self._moe_layers)
        for layer, routed in zip(self._moe_layers, np.asarray(table.routed)):
            self.activation_counts["decode"][layer] += routed
        misses = counts["activated"] - counts["hits"]
        # every routed expert has one size: the misses' bytes are those of as many copies of one expert
        nbytes = self.store.count_moved(self._moe_layers[0], np.zeros(misses, np.int64))
        stats.steps += len(tokens)
        stats.device_steps += len(tokens)
        stats.tokens += b * len(tokens)
        stats.seconds += seconds
        stats.activated += counts["activated"]
        stats.hits += counts["hits"]
        stats.experts_loaded_now += misses
        stats.gpu_experts += counts["activated"]  # every activated expert ran on the accelerator
        stats.bytes_moved += nbytes
        return tokens

    # ---- steps -----------------------------------------------------------------------------------------
    def _check(self, input_ids, max_new_tokens: int) -> np.ndarray:
        ids = np.asarray(input_ids)
        vocab, rc = self.config.vocab_size, self.runtime
        if ids.ndim != 2:
            raise ValueError(f"input_ids must be [batch, tokens], got shape {ids.shape}")
        if ids.size and (ids.min() < 0 or ids.max() >= vocab):
            raise ValueError(f"token ids must lie in [0, {vocab}); got {ids.min()}..{ids.max()}")
        b, t = ids.shape
        if b > rc.max_batch or t + max_new_tokens > rc.max_seq_len:
            raise ValueError(f"batch {b} x {t} + {max_new_tokens} tokens exceeds what the budget was sized for "
                             f"(RuntimeConfig max_batch={rc.max_batch}, max_seq_len={rc.max_seq_len})")
        return ids.astype(np.int32)

    def _start(self, ids: np.ndarray, max_new_tokens: int):
        """A fresh KV cache and the padded prompt's chunks [(c0, ids [B, C])]."""
        b, t = ids.shape
        rc = self.runtime
        if b > 1 and t > rc.prefill_chunk:
            chunk = rc.prefill_chunk
            t_pad = _round_up(t, chunk)
        else:
            t_pad = chunk = bucket(t, rc.prefill_buckets)
        padded = np.zeros((b, t_pad), np.int32)
        padded[:, :t] = ids
        max_len = _round_up(max(t_pad, t + max_new_tokens), CACHE_BUCKET)
        cache = self._init_cache(b, max_len, self.cache_dtype)
        return list(cache), [(c0, padded[:, c0:c0 + chunk]) for c0 in range(0, t_pad, chunk)]

    def _prefill(self, chunks, cache, t: int):
        """Yields (c0, hidden states [B, C, D] of the chunk, cache) for each chunk holding a real token."""
        for c0, ids in chunks:
            if c0 >= t:
                break
            b, c = ids.shape
            positions = np.broadcast_to(np.arange(c0, c0 + c, dtype=np.int32), (b, c))
            x, cache = self._step(jax.device_put(ids, self.devices.accel),
                                  jax.device_put(positions, self.devices.accel), cache, "prefill",
                                  (positions < t).reshape(-1))
            yield c0, x, cache

    def _step(self, ids, positions, cache: list, phase: str, valid: np.ndarray):
        """One forward over ids [B, T] at positions [B, T]; valid [B*T] marks real tokens. -> (x [B,T,D], cache)."""
        start = time.perf_counter()
        n = valid.size
        n_pad = bucket(n, self.runtime.decode_buckets if phase == "decode" else self.runtime.prefill_buckets)
        self._step_shapes.add((*ids.shape, n_pad))
        valid_pad = np.zeros(n_pad, bool)
        valid_pad[:n] = valid
        # the next-layer gate's row mask, on the accelerator once per step rather than once per layer
        valid_device = jax.device_put(valid_pad.astype(np.float32), self.devices.accel) if self._wants_scores else None
        if phase == "decode":
            self._streamed.clear()  # what prefill streamed is now part of the decode cache
        elif self._streams_prefill and self.pool.can_double_buffer:
            first = self._moe_layers[0]  # streams behind the embedding and the layers before it
            self._stream(first, (), self.phase_stats[phase])
        x = self._programs["embed"](self._graph, self._state, ids)
        for i, layer in enumerate(self._layers):
            if layer.moe:
                x, cache[i] = self._moe_layer(i, x, positions, cache[i], phase, valid_pad, valid_device)
            else:
                x, cache[i] = self._programs["dense_layer"](layer.graph, layer.state, x, positions, cache[i])
        x.block_until_ready()
        self._settle()
        reported = self.devices.accel.memory_stats() or {}
        if "peak_bytes_in_use" in reported:
            self.device_peak_bytes = max(self.device_peak_bytes or 0, int(reported["peak_bytes_in_use"]))
        stats = self.phase_stats[phase]
        stats.steps += 1
        stats.tokens += int(valid.sum())
        stats.seconds += time.perf_counter() - start
        return x, cache

    def _moe_layer(self, i: int, x, positions, layer_cache, phase: str, valid: np.ndarray, valid_device):
        self._mark(phase, "layer_start", i)
        r = self._route(i, x, positions, layer_cache, phase, valid, valid_device)
        plan = self._plan(i, phase, r)
        x, timing = self._execute(i, phase, plan, r)
        self._unsettled.append(timing)  # settled at the end of the step, so no layer waits for its own compute
        return x, r.layer_cache

    def _route(self, i: int, x, positions, layer_cache, phase: str, valid: np.ndarray, valid_device) -> _Routed:
        """Attention, router and shared experts on the accelerator; routing to the host (the layer's sync point)."""
        layer = self._layers[i]
        # with few rows, h comes to the host with the routing for the CPU experts (so they need not wait for a
        # copy queued behind this layer's GPU work)
        with_h = valid.size <= DENSE_MAX_ROWS
        rows = np.flatnonzero(valid)  # [Nv] real tokens (padding can sit between sequences)
        # where next-layer scores come from, if the plan reads them: the predictor object (pdscope with one),
        # else the next layer's gate on this layer's h, in the route program
        wants = i in self._next_moe and self._wants_scores
        predicts = wants and self.predictor is not None and self.planner.predictor_scores
        gate = self._layers[self._next_moe[i]] if wants and not predicts else None
        if gate is None:
            x, h, w, ids, routing, shared, layer_cache = self._programs["moe_route"](
                layer.graph, layer.state, x, positions, layer_cache, valid.size, with_h)
            scores = None
        else:  # the next layer's gate scores this layer's h in the same program
            x, h, w, ids, routing, shared, layer_cache, scores = self._programs["moe_route_scored"](
                layer.graph, layer.state, x, positions, layer_cache, valid.size, with_h, gate.graph, gate.state,
                valid_device)
        self._mark(phase, "route_dispatched", i)
        if predicts:
            scores = np.asarray(self.predictor.predict(layer=i, phase=phase, a=h[rows], w=w[rows], e=ids[rows]))
            scores = scores.mean(axis=0) if scores.ndim == 2 else scores
            self._mark(phase, "scores_dispatched", i)
        routing, scores = jax.device_get((routing, scores))  # one round trip
        self._mark(phase, "routed", i)
        k = w.shape[1]
        w_np, ids_np = routing[:, :k], routing[:, k:2 * k].astype(np.int32)
        h_np = routing[:, 2 * k:].astype(h.dtype) if with_h else None
        tokens = np.bincount(ids_np[rows].reshape(-1), minlength=self.config.num_experts)  # [E]
        self.activation_counts[phase][i] += tokens
        activated = np.flatnonzero(tokens)
        if self._observing and i in self._prev_moe:
            self.planner.observe(self._prev_moe[i], phase, activated)
        prefetched = self._prefetched.pop(i, None)
        if prefetched is not None:
            self.phase_stats[phase].prefetch_used += int(np.isin(prefetched, activated).sum())
        return _Routed(x, h, w, ids, shared, layer_cache, h_np, rows, w_np[rows], ids_np[rows], tokens, scores)

    def _plan(self, i: int, phase: str, r: _Routed) -> Plan:
        nxt, pool = self._next_moe.get(i), self.pool
        resident = pool.resident(i)
        demand = LayerDemand(
            layer=i, phase=phase, tokens_per_expert=r.tokens, resident=resident, next_layer=nxt,
            next_scores=None if nxt is None else r.next_scores,
            next_resident=None if nxt is None else pool.resident(nxt),
            free_slots=pool.free_slots(protect=(i,)), total_slots=pool.num_slots, num_tokens=r.rows.size)
        start = time.perf_counter()
        plan = self.planner.plan(demand, self._planner_costs(phase, r.padded_rows))
        planner_seconds = time.perf_counter() - start
        check_plan(demand, plan)
        self._mark(phase, "planned", i)
        if phase == "prefill" and nxt is not None:
            self._streams_prefill = plan.stream_next_layer  # the next prefill streams its first layer too
        stats = self.phase_stats[phase]
        stats.planner_seconds += planner_seconds
        stats.planner_calls += 1
        stats.activated += int(demand.activated.sum())
        stats.hits += int((demand.activated & resident).sum())
        return plan

    def _planner_costs(self, phase: str, rows: int) -> CostTable:
        """The cost table with CPU times scaled by the calibration of this phase and step size (rounded to a
        tenth, so a few scaled tables serve every layer)."""
        scale = round(self._cpu_scale.get((phase, rows), 1.0), 1)
        if scale <= 1.0:
            return self.costs
        if scale not in self._scaled_costs:
            self._scaled_costs[scale] = self.costs.with_cpu_scale(scale)
        return self._scaled_costs[scale]

    def _calibrate_cpu(self, t: LayerTiming, done: float) -> None:
        """Fold one layer's measured CPU time (dispatch to done, stamped by a helper thread) over what the cost
        table predicted into the scale of its phase and step size: a running mean, kept in [1, CPU_SCALE_MAX]. Step
        sizes keep apart because one factor cannot model a fixed cost per layer: a few one-token CPU experts drove
        a 128-token prefill's scale to the cap, and a 4,096-token prefill that inherited it planned with CPU experts
        eight times too dear (H200, calls 41-42)."""
        key = (t.phase, t.step_rows)
        observed = (done - t.cpu_start) / t.cpu_predicted
        scale = (1 - CPU_CALIBRATION) * self._cpu_scale.get(key, 1.0) + CPU_CALIBRATION * observed
        self._cpu_scale[key] = min(max(scale, 1.0), CPU_SCALE_MAX)

    def _execute(self, i: int, phase: str, plan: Plan, r: _Routed):
        """CPU experts (dispatched: they run on the CPU backend's threads) and this layer's loads first, then the
        next layer's transfers (staged before compute), then the GPU experts; then only the CPU part is waited for
        (the accelerator runs ahead)."""
        pool, stats = self.pool, self.phase_stats[phase]
        on_gpu = np.zeros(self.config.num_experts, bool)  # [E]
        on_gpu[plan.gpu] = True
        self._commit_staged(i)
        pool.release(i, plan.unload[~on_gpu[plan.unload]])  # unloads this layer does not compute with: free now
        cpu_part, cpu_start = None, time.perf_counter()
        if plan.cpu.size and self.runtime.async_io:  # the CPU experts run while the loads copy
            cpu_part = self._run_cpu(i, plan.cpu, r)
            self._mark(phase, "cpu_submitted", i)
        start = time.perf_counter()
        loads, loads_end = self._load_now(i, plan.load_now, stats)
        self._mark(phase, "loads_issued", i)
        # the next layer's copies are issued BEFORE this layer's compute is dispatched, so they overlap it
        staged_next = self._issue_next(i, self._next_moe.get(i), plan, stats)
        self._mark(phase, "next_issued", i)
        dispatched = time.perf_counter()
        if plan.cpu.size and not self.runtime.async_io:  # synchronous I/O: nothing overlapped the copies
            cpu_part, cpu_start = self._run_cpu(i, plan.cpu, r), dispatched
        y_gpu = self._run_gpu(i, plan.gpu, on_gpu, r)
        self._mark(phase, "gpu_dispatched", i)
        # helper threads stamp when each part is done (from now, not after the CPU part: exact GPU times)
        ready = {name: self._waiter.submit(_ready_at, arrays) for name, arrays in
                 (("gpu", y_gpu), ("load", loads)) if arrays is not None}
        if staged_next is not None:
            ready["transfer"] = self._waiter.submit(_staged_ready_at, staged_next)
        if cpu_part is not None:
            ready["cpu"] = self._waiter.submit(_ready_at, cpu_part[0])
        (y_cpu, cpu_rows), cpu_end = self._join_cpu(cpu_part)
        self._mark(phase, "cpu_joined", i)
        x = self._programs["moe_combine"](r.x, r.shared, y_gpu, y_cpu, cpu_rows)
        self._mark(phase, "combined", i)
        pool.release(i, plan.unload[on_gpu[plan.unload]])  # after compute in dispatch order: safe to reuse
        pool.touch(i, plan.gpu)
        return x, LayerTiming(i, phase, plan.gpu.size, plan.cpu.size, start, dispatched, cpu_start, cpu_end,
                              loads_end, ready, self.costs.t_cpu(r.tokens[plan.cpu]), r.padded_rows)

    def _mark(self, phase: str, event: str, layer: int, at: float | None = None) -> None:
        """Record a stage of layer `layer` in the timeline, when one is being recorded."""
        if self.timeline is not None:
            self.timeline.mark(phase, event, layer, time.perf_counter() if at is None else at)

    def _commit_staged(self, i: int) -> None:
        """Copy the transfers staged for layer i (by the layer before it) into their reserved slots."""
        if i in self._pending:
            staging, slots = self._pending.pop(i)
            self.store.commit(self.pool, staging.result(), slots)

    def _load_now(self, i: int, experts: np.ndarray, stats: PhaseStats) -> tuple[jax.Array | None, float | None]:
        """Issue the load of `experts` of layer i into slots (ordered before every later reader of the pool).
        -> (an array ready when the load is done, None) or, with `async_io` off, where the copy is
        waited for here, (None, perf_counter when it was done); (None, None) when nothing was loaded."""
        if experts.size == 0:
            return None, None
        written = self.store.write(self.pool, i, experts, self.pool.allocate(i, experts, protect=(i,)))
        stats.bytes_moved += written.nbytes
        stats.experts_loaded_now += experts.size
        if not self.runtime.async_io:
            written.done.block_until_ready()
            return None, time.perf_counter()
        return written.done, None

    def _run_gpu(self, i: int, experts: np.ndarray, on_gpu: np.ndarray, r: _Routed):
        """Dispatch layer i's GPU `experts` over the slot pool (on_gpu [E] marks them). -> y [Nb, D], or None."""
        if experts.size == 0:
            return None
        pool = self.pool
        slot_of = pool.slot_of(i)  # [E]
        slot_of[~on_gpu] = -1
        # batched: one program for every GPU expert; else one program per expert (the ablation's baseline)
        parts = [slot_of] if self.runtime.batched_gpu else [_only(slot_of, e) for e in experts]
        y_gpu = None
        for part in parts:
            y = self._programs["gpu_experts"](r.h, r.w, r.ids, pool.gate_up, pool.down, part)  # part: host [E]
            y_gpu = y if y_gpu is None else y_gpu + y
        return y_gpu

    def _run_cpu(self, i: int, experts: np.ndarray, r: _Routed) -> tuple[jax.Array, jax.Array | None]:
        """Dispatch layer i's CPU `experts` on the CPU backend (returns at once). -> (y f32 there, rows): y [Nb, D]
        and rows None when h came to the host with the routing (few rows), else only the rows the experts read
        (`cpu_experts.compact_rows`, gathered on the accelerator): y [R, D] for rows [R] on the accelerator."""
        groups = _groups(experts, r.rows, r.w_host, r.ids_host)
        if r.h_host is not None:
            return self.cpu_experts.dispatch(i, jax.device_put(r.h_host, self.devices.cpu), groups), None
        take, groups = compact_rows(groups, r.h.shape[0], self.cpu_experts.min_rows)
        take = jax.device_put(take, self.devices.accel)
        h_cpu = jax.device_put(self._programs["take_rows"](r.h, take), self.devices.cpu)
        return self.cpu_experts.dispatch(i, h_cpu, groups), take

    def _join_cpu(self, part: tuple[jax.Array, jax.Array | None] | None
                  ) -> tuple[tuple[jax.Array | None, jax.Array | None], float | None]:
        """Wait for the CPU part. -> ((y on the accelerator, its rows or None), perf_counter when the CPU was
        done), or ((None, None), None) without one."""
        if part is None:
            return (None, None), None
        acc, rows = part
        acc.block_until_ready()
        done = time.perf_counter()
        return (jax.device_put(acc, self.devices.accel), rows), done

    def _settle(self) -> None:
        """Add the timed layers of the step to the statistics (`LayerTiming.settle_into`), and their done-times
        to the timeline."""
        for t in self._unsettled:
            done = {name: future.result() for name, future in t.ready.items()}
            for name, at in {"cpu": t.cpu_end, **done}.items():  # the helper's stamp of the CPU part is exact
                if at is not None:
                    self._mark(t.phase, f"{name}_done", t.layer, at)
            if "cpu" in done and t.cpu_predicted > 0:
                self._calibrate_cpu(t, done["cpu"])
            t.settle_into(self.phase_stats[t.phase], done)
        self._unsettled.clear()

    def _issue_next(self, i: int, nxt: int | None, plan: Plan, stats: PhaseStats):
        """Stage the next layer's experts (whole layer when streaming fits, else the plan's prefetch)."""
        if nxt is None:
            return None
        if plan.stream_next_layer and self.pool.can_double_buffer:
            return self._stream(nxt, (i,), stats)
        return self._stage_ahead(nxt, plan.prefetch, (i,), stats)

    def _stream(self, layer: int, protect: tuple[int, ...], stats: PhaseStats):
        """Stage every non-resident expert of `layer` into slots streamed into for layers already computed (then
        free or LRU ones), so experts resident before the prefill stay resident."""
        done = [(other, experts) for other, experts in self._streamed.items() if other != layer and
                other not in protect]
        transient = np.concatenate([self.pool.slot_of(other)[experts] for other, experts in done] or [[]])
        experts = np.flatnonzero(~self.pool.resident(layer))
        self._streamed[layer] = experts
        return self._stage_ahead(layer, experts, protect, stats, prefer=transient[transient >= 0])

    def _stage_ahead(self, layer: int, experts: np.ndarray, protect: tuple[int, ...], stats: PhaseStats,
                     prefer: np.ndarray | None = None):
        """Reserve slots (`prefer`red ones first, see `SlotPool.allocate`) and have the stager thread issue the
        copy of `experts` of `layer`, committed when `layer` runs. -> the staging (a Future of `Staged`), or None
        when nothing is in flight (no experts, or `async_io` off: then the copy is waited for here, before any
        compute is dispatched, and all of it counts as exposed)."""
        if experts.size == 0:
            return None
        start = time.perf_counter()
        slots = self.pool.allocate(layer, experts, protect=protect, prefer=prefer)
        staging = self._stager.submit(self.store.stage, layer, experts)
        nbytes = self.store.count_moved(layer, experts)
        self._pending[layer] = (staging, slots)
        self._prefetched[layer] = experts
        stats.bytes_moved += nbytes
        stats.experts_prefetched += experts.size
        if self.runtime.async_io:
            return staging
        staged = staging.result()
        jax.block_until_ready(staged.gate_ups + staged.downs)
        waited = time.perf_counter() - start
        stats.transfer_seconds += waited
        stats.exposed_transfer_seconds += waited
        return None


def _logit_windows(width: int, real: int, size_max: int):
    """Windows covering the first `real` positions of a chunk `width` wide, all of one size (so one compiled
    logits program). Yields (start, size, lo, hi): compute chunk positions start..start+size-1 and keep lo..hi-1,
    rows lo-start..hi-start of the window. Windows step by `size`; the last one is moved back to end at the
    chunk's edge when it would run past it (then start < lo), so start <= lo < hi <= start + size <= width."""
    size = min(size_max, width)
    for lo in range(0, real, size):
        yield min(lo, width - size), size, lo, min(lo + size, real)


def _only(slot_of: np.ndarray, expert: int) -> np.ndarray:
    """slot_of [E] with every expert but `expert` mapped to -1."""
    out = np.full_like(slot_of, -1)
    out[expert] = slot_of[expert]
    return out


def _groups(experts: np.ndarray, rows: np.ndarray, w: np.ndarray, ids: np.ndarray
            ) -> list[tuple[int, np.ndarray, np.ndarray]]:
    """Per expert: (expert, rows of h routed to it, their routing weights); w, ids [Nv, K] belong to `rows` [Nv]."""
    flat = ids.reshape(-1)
    order = np.argsort(flat, kind="stable")
    bounds = np.searchsorted(flat[order], np.stack([experts, experts + 1]))  # [2, n]
    k = ids.shape[1]
    out = []
    for e, lo, hi in zip(experts, bounds[0], bounds[1]):
        picks = order[lo:hi]
        out.append((int(e), rows[picks // k], w.reshape(-1)[picks]))
    return out


def _staged_ready_at(staging: concurrent.futures.Future[Staged]) -> float:
    staged = staging.result()
    return _ready_at(staged.gate_ups + staged.downs)


def _ready_at(arrays) -> float:
    jax.block_until_ready(arrays)
    return time.perf_counter()


def _path(parts: tuple) -> str:
    return ".".join(str(p) for p in parts)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _param_dtype(model) -> np.dtype:
    return np.dtype(model.embed.embedding.get_value().dtype)

