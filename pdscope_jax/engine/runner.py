"""The offload engine: runs a model whose routed experts do not fit the accelerator budget.

Contract: `OffloadRunner(model, runtime_config, weights=None, *, cost_table=None, predictor=None, devices=None,
cpu_view="alias", host_alloc="auto", expert_stacks=False)`: `model`, a `CausalLM` (concrete, or abstract from
`models.abstract_model`); `weights`: None, a flat dict or a loader (`engine.build.take_weights`). `cpu_view`,
`host_alloc` and `expert_stacks` choose how the expert store keeps its one host copy (`store.expert_store`).
- The budget (`store.budget`) is checked before anything is placed; the accelerator then holds the non-expert weights,
  the KV cache and ONE slot pool (`store.slot_pool`) that is never reallocated; every routed expert lives once in pinned
  host memory, also the CPU experts' zero-copy source (`engine.cpu_experts`). `accelerators=N` (N divides E) splits
  the experts over N accelerators (`runtime.select_accelerators`), each with its share's store, a pool of the budget's
  slots and a planner (`shards`: `engine.shards.Shard`; `store`, `pool`, `planner` are the first's, the lead).
- `logits(input_ids [B,T]) -> np.float32 [B,T,V]` and `generate(input_ids, max_new_tokens, temperature=0, top_k=None,
  seed=0, **sampling) -> GenerationResult` give the plain model's numbers (same sampler: `generation.sampling`);
  `steps(...)` yields each step's `Sampled` (host copies) per `next`. Prefill (a whole prompt at batch 1, else chunks of
  `prefill_chunk` tokens) steps through `engine.loop.HostLoop`; decode through `engine.decode.choose`'s executor.
- `stats`: per phase (`engine.stats.PhaseStats`), compiled programs, the budget, host bytes, the allocator's peak where
  reported, the CPU cost calibration, each accelerator's copies since the last reset (`per_accelerator`).
  `activation_counts[phase][layer]`: tokens routed to each expert since the last reset. `timeline`: set to an
  `engine.timeline.Timeline` to record each layer's stages. `startup_seconds`: {stage: wall seconds} of building the
  engine (budget, weights and store, ..., policy).
- `warmup(batch, prompt_len, new_tokens)` compiles a shape's programs before timing (`precompile_routed()`: its
  routing-dependent part) and adds its `program_shape` (what the programs depend on) to `warmed_shapes`;
  `set_policy(name, options, **engine)` switches planners without rebuilding; `reset_calibration()` forgets the
  in-situ CPU calibration (which `set_policy` keeps under the same policy).
- RuntimeConfig switches (`runtime`): `cost_table` (else `build.analytic_costs`) with the in-situ CPU calibration
  (`engine.calibration`); `hot_table` (counts for planners with hot experts, preloaded; else the run's counts choose
  which experts prefill's streams keep of each layer's even share); `async_io`, `batched_gpu`, `device_decode`,
  `decode_*` (`engine.decode`, `engine.host_split`); `quality`, `mixed_threshold` (docs/PRECISION.md).
"""

from __future__ import annotations

import time
from typing import Any

import jax
import numpy as np

from pdscope_jax import models
from pdscope_jax.engine import decode, decode_trial, device_decode, recovery
from pdscope_jax.engine.build import (analytic_costs, new_store, param_dtype, place_non_experts, plan_budget,
                                      round_up, split_abstract, take_weights)
from pdscope_jax.engine.calibration import CpuCalibration
from pdscope_jax.engine.host_split import HostSplit
from pdscope_jax.engine.loop import HostLoop
from pdscope_jax.engine.programs import LOGIT_ROWS, build_programs, cache_size
from pdscope_jax.engine.route import Router
from pdscope_jax.engine.shards import MeshSum, build_shards, owners
from pdscope_jax.engine.stats import PhaseStats
from pdscope_jax.engine.timeline import StageClock, Timeline
from pdscope_jax.engine.warmup import precompile_bank_writes, precompile_combine, precompile_slot_writes
from pdscope_jax.errors import raise_problems
from pdscope_jax.generation.generator import (CACHE_BUCKET, CHUNK_COMPILER_OPTIONS, GenerationResult, Steps,
                                               check_request, sampling_params)
from pdscope_jax.generation.sampling import SamplingState
from pdscope_jax.parallel.mesh import split_size
from pdscope_jax.runtime import (Devices, RuntimeConfig, RuntimeConfigError, prefill_rows, select_accelerators,
                                 select_devices)
from pdscope_jax.sched import (CostTable, ObservingPlanner, activation_counts, load_cost_table, make_planner,
                               planner_class)
from pdscope_jax.sched.precision import LOW, loads_low, quality_problems, rule_for
from pdscope_jax.store.budget import BudgetError

__all__ = ["OffloadRunner", "analytic_costs"]
WARMUP_TOKENS = 2  # a warm-up's generation: the prefill's token and one decode step (every step's programs)


class OffloadRunner:
    def __init__(self, model, runtime_config: RuntimeConfig, weights=None, *, cost_table: CostTable | None = None,
                 predictor=None, devices: Devices | None = None, cpu_view: str = "alias", host_alloc: str = "auto",
                 expert_stacks: bool = False, accelerators: int = 1):
        rc = runtime_config
        if rc.policy is None:
            raise ValueError("OffloadRunner needs RuntimeConfig.policy (a planner name); without one the model "
                             "runs whole (generation.Generator)")
        self.config = cfg = model.config
        self.runtime = rc
        self.devices = devices or select_devices()
        self.predictor = predictor
        self._moe_layers = cfg.moe_layers

        clock = StageClock()  # where building the engine spends its time: `startup_seconds`
        abstract = models.abstract_model(cfg, param_dtype(model))  # shapes only: nothing placed yet
        graphdef, flat_state, shapes = split_abstract(abstract)
        raise_problems(quality_problems(rc.quality, cfg.expert_quant), "OffloadRunner")
        self.accelerators = accelerators
        share = split_size(cfg.num_experts, accelerators)  # each accelerator's experts per layer
        accels = select_accelerators(accelerators) if accelerators > 1 else (self.devices.accel,)
        # page-lock host memory for the experts while budgeting
        stores = [new_store(shapes, self._moe_layers, Devices(accel, self.devices.cpu), cpu_view=cpu_view,
                            host_alloc=host_alloc, expert_stacks=expert_stacks, shares=accelerators)
                  for accel in accels]
        # which experts each accelerator owns: blocks by id, or shares evened out by the hot table's counts
        owned = owners(cfg.num_experts, accelerators, self._moe_layers,
                       activation_counts(rc.hot_table) if rc.hot_table and accelerators > 1 else None)
        try:
            self.budget, expert_dtype, self.cache_dtype = plan_budget(cfg, rc, abstract, shapes)
            # an accelerator's pool: the budget's slots (every accelerator's pool alike), at most its whole share
            self._slots = min(self.budget.slots, len(self._moe_layers) * share)
            clock.lap("budget")
            self._check_policy(rc.policy)
            self.costs = cost_table or (load_cost_table(rc.cost_table) if rc.cost_table
                                        else analytic_costs(cfg, expert_dtype.itemsize))
            keep_low = loads_low(rc.quality, cfg.expert_quant)
            if keep_low:  # a table without the int4 transfer: the base one scaled by the bytes
                self.costs = self.costs.with_precision(LOW, bytes_ratio=cfg.replace(expert_quant=LOW).expert_bytes()
                                                       / cfg.expert_bytes(expert_dtype.itemsize))
            stores, non_expert = take_weights(model, weights, shapes, self._moe_layers, stores, owned,
                                              quant=cfg.expert_quant, dtype=expert_dtype, low=keep_low)
        finally:
            for store in stores:
                store.loaded()  # every layer taken, or an error: no page-locking left running behind
        clock.lap("weights and expert store")
        placed = place_non_experts(graphdef, flat_state, non_expert, self.devices.accel)
        clock.lap("non-expert weights")
        # the model without its layers (embedding, logits), each layer's (graph, state), the KV cache's program
        self._graph, self._state, self._layers, self._init_cache = (placed.graph, placed.state, placed.layers,
                                                                    placed.init_cache)
        self._programs = build_programs()
        self.shards = build_shards(stores, owned, self._slots, self._moe_layers, cfg, expert_dtype, self._programs,
                                   self.devices.cpu, self.costs, self._mark, rc.cpu_min_rows, rc.cpu_kernel)
        for shard in self.shards:  # which experts of each layer prefill's streams keep: its most routed
            shard.transfers.wanted = lambda layer, shard=shard: self.routed_counts(shard, layer)
        # the lead accelerator's share: all of it on one accelerator (device decode and the bridge use it alone)
        lead = self.shards[0]
        self.store, self.pool, self.cpu_experts = lead.store, lead.pool, lead.cpu_experts
        self._transfers, self._executor = lead.transfers, lead.executor
        self.mesh_sum = MeshSum(accels) if accelerators > 1 else None
        self._decode_step = device_decode.build_decode_step()
        # several steps a program run as command buffers on a GPU, as the whole model's chunks do
        self._decode_chunk = device_decode.build_decode_chunk(
            CHUNK_COMPILER_OPTIONS if self.devices.accel.platform == "gpu" else None)
        # the bridge's calls must run as issued, not replayed from a recorded command buffer
        self._decode_chunk_issued = device_decode.build_decode_chunk()
        self.host_split = HostSplit(self.store, cfg, self.devices.accel, expert_dtype, settle=self._copies_done)
        self._calibration = CpuCalibration(self.costs)
        next_moe = dict(zip(self._moe_layers[:-1], self._moe_layers[1:]))
        self._router = Router(self._programs, self._layers, next_moe, cfg.num_experts, self._mark)
        self._loop = HostLoop(self, self._router, self._calibration)
        self.warmed_shapes: set[tuple[int, int, int, int]] = set()  # `program_shape`s warmed up
        self.decode_trials: dict[int, decode_trial.DecodeTrial] = {}  # batch -> the executor its trial chose
        self.track_memory = False
        self.timeline: Timeline | None = None
        self.memory_trace: list[dict[str, int | None]] = []
        clock.lap("slot pool and programs")
        self.set_policy(rc.policy, rc.policy_options)
        clock.lap("policy")
        self.startup_seconds = clock.seconds

    # ---- policy and statistics -------------------------------------------------------------------------
    def set_policy(self, policy: str, policy_options=(), **engine) -> None:
        """Switch to another planner: empties the slot pool (host copies stay, so this moves nothing), preloads
        what the new policy keeps resident and resets the statistics. The pool itself is not reallocated.
        `engine` may change the RuntimeConfig fields `hot_table`, `async_io`, `batched_gpu`, `device_decode`,
        `decode_bank`, `decode_bank_pieces`, `decode_cpu_experts`, `decode_copy_share`, `decode_bridge_copies`,
        `decode_zero_copy`, `decode_copies_ahead`, `decode_chunk`, `decode_trial`, `quality` and `mixed_threshold`
        at the same time (a quality that loads int4 copies only where the store keeps them: RuntimeConfigError
        otherwise); a different policy also forgets the CPU calibration (learned under another's load).
        Planners with hot slots (`Capabilities.hot_slots`) get the hot table's `activation_counts` and, unless
        given, `hot_per_layer` = their hot slots split evenly over the MoE layers."""
        unknown = set(engine) - set("hot_table async_io batched_gpu device_decode decode_bank decode_bank_pieces "
                                    "decode_cpu_experts decode_copy_share decode_bridge_copies decode_zero_copy "
                                    "decode_copies_ahead decode_chunk decode_trial quality mixed_threshold".split())
        if unknown:
            raise TypeError(f"set_policy: unknown engine options {sorted(unknown)}")
        self._check_policy(policy)
        runtime = self.runtime.replace(policy=policy, policy_options=policy_options, **engine)
        self.precision = self._precision_rule(runtime)
        if policy != self.runtime.policy:  # the calibration learned under one policy's load is not another's
            self._calibration.clear()
        if runtime != self.runtime:  # a trial timed another planner or other engine options
            self.decode_trials.clear()
        self.runtime = runtime
        for shard in self.shards:
            options = self._planner_options(policy, shard)
            shard.take_planner(make_planner(policy, **options), self._moe_layers)
        self.planner = self.shards[0].planner
        self._hot_counts = options.get("activation_counts") if len(self.shards) == 1 else None  # {layer: [E]}
        self._loop.observing = isinstance(self.planner, ObservingPlanner)  # a Protocol check: slow, so once here
        self._router.configure(self.planner.reads_next_scores,
                               self.predictor if self.planner.predictor_scores else None)
        self.reset_stats()

    def _planner_options(self, policy: str, shard) -> dict:
        """The planner's options for `shard`: the policy's, a hot table's counts and hot experts per layer (of
        its share of the experts when there are several)."""
        options = self.runtime.policy_kwargs
        hot_table = self.runtime.hot_table
        hot_slots = planner_class(policy).hot_slots(shard.pool.num_slots, shard.count, shard.pool.can_double_buffer,
                                                    bool(hot_table))
        if hot_slots is not None:
            if hot_table:
                options.setdefault("activation_counts", activation_counts(hot_table))
            options.setdefault("hot_per_layer", min(shard.count, hot_slots // len(self._moe_layers)))
        if "activation_counts" in options and len(self.shards) > 1:
            options["activation_counts"] = shard.local_counts(options["activation_counts"])
        return options

    def _precision_rule(self, rc: RuntimeConfig):
        """The precision rule the planners see under `rc` (`sched.precision.rule_for`), checked against the store."""
        raise_problems(quality_problems(rc.quality, self.config.expert_quant), "set_policy")
        rule = rule_for(rc.quality, self.config.expert_quant, rc.mixed_threshold)
        if rule is not None and not self.store.has_low:
            raise RuntimeConfigError(f"quality={rc.quality!r} loads int4 copies, which the store keeps only when the "
                                     "engine is built with such a quality: build it with quality='mixed' or 'int4'")
        return rule

    @property
    def precision_trace(self) -> list | None:
        """(phase, layer, ids of GPU experts computed from int4 copies) per MoE layer run (and accelerator), while
        set to a list."""
        return self._executor.trace

    @precision_trace.setter
    def precision_trace(self, trace: list | None) -> None:
        for shard in self.shards:
            shard.executor.trace = trace

    def _check_policy(self, policy: str | None) -> None:
        accelerators = self.accelerators
        total = len(self._moe_layers) * self.config.num_experts // accelerators
        if planner_class(policy).keeps_all_resident and self._slots < total:
            each = f" on each of {accelerators} accelerators" if accelerators > 1 else ""
            raise BudgetError(f"policy {policy!r} keeps every expert resident: {total} slots needed{each}, the "
                              f"budget gives {self._slots} ({self.budget.describe()})")

    def routed_counts(self, shard, layer: int) -> np.ndarray:
        """[share's E] tokens routed to `shard`'s experts of `layer`: the hot table's counts, else this run's."""
        counts = self._hot_counts[layer] if self._hot_counts else sum(c[layer] for c in self.activation_counts.values())
        return shard.local(np.asarray(counts), layer)

    def reset_stats(self) -> None:
        self.phase_stats = {"prefill": PhaseStats(), "decode": PhaseStats()}
        self._loop.unsettled.clear()  # layers of a step that raised before settling
        # tokens routed to each expert, per phase and MoE layer (real tokens only): a hot table's raw counts
        self.activation_counts = {phase: {layer: np.zeros(self.config.num_experts, np.int64)
                                          for layer in self._moe_layers} for phase in ("prefill", "decode")}
        self.device_peak_bytes: int | None = None  # the allocator's peak, on devices that report one
        for shard in self.shards:
            shard.pool.evictions = 0
        self._bytes_at_reset = [shard.store.bytes_moved for shard in self.shards]

    def reset_calibration(self) -> None:
        """Forget the in-situ CPU calibration, even under the same policy: runs compared in one process then start
        from the table as a new process does (else later runs inherit what earlier ones learned)."""
        self._calibration.clear()

    def _copies_done(self) -> None:
        """Wait for every copy into the slot pools queued so far (`set_policy`'s preload, a prefill's streams)."""
        jax.block_until_ready([shard.pool.banks for shard in self.shards])

    def decode_host(self, batch: int):
        """How device decode splits a batch of `batch` rows' misses between copies and the host
        (`engine.host_split`): a `device_decode.HostExperts`, or None when every miss is copied;
        `device_decode.EVERY_RESIDENT` where the pool holds every routed expert (decode misses none)."""
        if self.pool.num_slots >= self.config.num_experts * len(self._moe_layers):
            return device_decode.EVERY_RESIDENT
        return self.host_split.for_step(self.runtime, self.planner, self.costs, batch)

    def _per_accelerator(self) -> list[dict[str, Any]]:
        """Each accelerator's share since the last reset: its device, experts a layer, slots, bytes copied over its
        link and evictions."""
        return [{"device": str(shard.device), "experts_per_layer": shard.count, "slots": shard.pool.num_slots,
                 "bytes_moved": shard.store.bytes_moved - base, "evictions": shard.pool.evictions}
                for shard, base in zip(self.shards, self._bytes_at_reset)]

    @property
    def decode_slots(self) -> int:
        """Slots device decode adds in its bank (the budget's `decode_slots`; 0 with `decode_bank` off)."""
        return self.budget.decode_slots if self.runtime.decode_bank else 0

    @property
    def compiled_programs(self) -> dict[str, int]:
        """Programs compiled so far, per kind (jit cache sizes; None where this jax does not expose them)."""
        counts = {name: cache_size(fn) for name, fn in self._programs.items()}
        counts.update(decode_step=cache_size(self._decode_step), decode_chunk=cache_size(self._decode_chunk),
                      decode_chunk_issued=cache_size(self._decode_chunk_issued),
                      init_cache=cache_size(self._init_cache), slot_commit=self.store.compiled_programs,
                      cpu_expert=self.cpu_experts.compiled_programs)
        if self.mesh_sum is not None:
            counts["mesh_sum"] = cache_size(self.mesh_sum._sum)
        counts["total"] = sum(v for v in counts.values() if v is not None)
        return counts

    @property
    def stats(self) -> dict[str, Any]:
        return {
            "policy": self.runtime.policy, "async_io": self.runtime.async_io, "hot_table": self.runtime.hot_table,
            "batched_gpu": self.runtime.batched_gpu, "device_decode": self.runtime.device_decode,
            "prefill": self.phase_stats["prefill"].to_dict(), "decode": self.phase_stats["decode"].to_dict(),
            "compiled_programs": self.compiled_programs, "accelerators": self.accelerators,
            "slots": sum(shard.pool.num_slots for shard in self.shards),
            "decode_bank": self.runtime.decode_bank, "decode_slots": self.decode_slots,
            "decode_cpu_experts": self.runtime.decode_cpu_experts, "decode_host": self.host_split.stats(),
            "decode_trials": {str(b): trial.to_dict() for b, trial in sorted(self.decode_trials.items())},
            "double_buffering": self.pool.can_double_buffer, "evictions": sum(sh.pool.evictions for sh in self.shards),
            "per_accelerator": self._per_accelerator(),
            # the in-situ CPU calibration the planners see now, per "phase rows" (absent: 1)
            "cpu_cost_scale": self._calibration.as_stats(),
            "budget": dict(self.budget.lines()), "device_peak_bytes": self.device_peak_bytes,
            "host_expert_bytes": sum(shard.store.host_bytes for shard in self.shards),
            "host_low_copy_bytes": sum(shard.store.low_bytes for shard in self.shards),
            "host_bytes_per_model_byte": self.store.host_bytes_per_model_byte,
            "quality": self.runtime.quality, "mixed_threshold": self.runtime.mixed_threshold,
            "within_budget": None if self.device_peak_bytes is None else self.device_peak_bytes <= self.budget.total,
        }

    # ---- public API ------------------------------------------------------------------------------------
    @recovery.recovers
    def logits(self, input_ids) -> np.ndarray:
        ids = self._check(input_ids, what="logits")
        b, t = ids.shape
        out = np.zeros((b, t, self.config.vocab_size), np.float32)
        cache, chunks = self._start(ids, 0)
        for c0, x, cache in self._prefill(chunks, cache, t):
            width = x.shape[1]
            for start, size, lo, hi in _logit_windows(width, min(width, t - c0), max(1, LOGIT_ROWS // b)):
                rows = np.asarray(self._programs["logits"](self._graph, self._state, x, start, size))
                out[:, c0 + lo:c0 + hi] = rows[:, lo - start:hi - start]
        return out

    @recovery.recovers
    def decode_logits(self, input_ids) -> np.ndarray:
        """`logits` as decode computes them (teacher forcing): the first token prefilled, then each later one fed
        to a decode step planned on the host (`HostLoop`; counted in the decode statistics) -> float32 [B,T,V]."""
        ids = self._check(input_ids, what="logits")
        b, t = ids.shape
        out = np.zeros((b, t, self.config.vocab_size), np.float32)
        cache, chunks = self._start(ids[:, :1], t - 1)
        x = next(self._prefill(chunks, cache, 1))[1]
        for p in range(t):
            if p:
                positions = jax.device_put(np.full((b, 1), p, np.int32), self.devices.accel)
                x, cache = self._loop.step(jax.device_put(ids[:, p:p + 1], self.devices.accel), positions, cache,
                                           "decode", np.ones(b, bool))
            out[:, p] = np.asarray(self._programs["logits"](self._graph, self._state, x, 0, 1))[:, 0]
        return out

    def generate(self, input_ids, max_new_tokens: int = 64, temperature: float = 0.0, top_k: int | None = None,
                 seed: int = 0, **sampling) -> GenerationResult:
        steps = self.steps(input_ids, max_new_tokens, temperature, top_k, seed, streamed=False, **sampling)
        start = time.perf_counter()
        tokens = [next(steps).token]  # a host copy: waits
        prefill_seconds = time.perf_counter() - start
        self.phase_stats["prefill"].generate_seconds += prefill_seconds
        start = time.perf_counter()
        tokens += [picked.token for picked in steps]
        decode_seconds = time.perf_counter() - start
        self.phase_stats["decode"].generate_seconds += decode_seconds
        return GenerationResult.timed(np.stack(tokens, axis=1), steps.prompt_len, prefill_seconds, decode_seconds)

    def steps(self, input_ids, max_new_tokens: int = 64, temperature: float = 0.0, top_k: int | None = None,
              seed: int = 0, streamed: bool = True, **sampling) -> Steps:
        """The call checked now, then an iterator of its steps' host `Sampled` copies (prefill's first); closing
        it early still settles the decode statistics and the pool's table. `streamed` (default): decode chunks
        sized for tokens handed out as they come (`engine.decode.chunk_steps`), not for a whole generation."""
        ids = self._check(input_ids, max_new_tokens, temperature, top_k, seed, **sampling)
        params, _ = sampling_params(temperature, top_k, seed, **sampling)
        return Steps(self._steps(ids, max_new_tokens, params, streamed=streamed), ids.shape[1])

    def _steps(self, ids: np.ndarray, max_new_tokens: int, params, cache_tokens: int | None = None, executor=None,
               streamed: bool = False):
        b, t = ids.shape
        decoder, failed = None, False
        try:  # a failure leaves the engine as a fresh one (`engine.recovery`) and raises as it came
            cache, chunks = self._start(ids, max_new_tokens, cache_tokens)
            state = SamplingState.create(params, ids, self.config.vocab_size, self.devices.accel)
            # the first new token: sampled in the chunk that holds the prompt's last token, t - 1 (T >= 1 is checked)
            for c0, x, cache in self._prefill(chunks, cache, t):
                if c0 <= t - 1 < c0 + x.shape[1]:
                    first, state = self._programs["next_token"](self._graph, self._state, x, t - 1 - c0, state, 0)
            token, first = first.token, decode.host_copy(first)  # only the token stays on the accelerator
            yield first
            executor = executor or decode.choose(self, b, max_new_tokens - 1)  # host-planned, or a program a step
            decoder = executor(self, token, cache, t, state, count=max_new_tokens - 1, streamed=streamed)
            for step in range(1, max_new_tokens):
                decoder.step(step)
                if self.track_memory:
                    self.memory_trace.append(self.device_memory())
                while decoder.tokens:  # the device executor's arrive two steps late; taken ones are not kept
                    yield decoder.tokens.pop(0)
        except Exception:
            failed = True
            recovery.after_failure(self)
            raise
        finally:  # also where the caller closed the steps early
            tokens = [] if failed or decoder is None else decoder.finish()
        yield from tokens

    def warmup(self, batch: int, prompt_len: int, new_tokens: int = 2) -> dict[str, int]:
        """Compile the programs of this shape: a generation of two tokens on dummy tokens in a KV cache sized for
        `new_tokens` (a decode step's programs are the same at every step; with `decode_chunk` above 1, of
        `new_tokens` tokens, so that its chunks compile: another count's last chunk compiles when it first runs),
        then what routing decides whether a real run needs: every CPU expert row bucket for the token counts it
        used, the layer combination with and without GPU and CPU parts, and every slot-commit batch size. Then the
        pool and the statistics start afresh, as after `set_policy`."""
        ids = np.zeros((batch, prompt_len), np.int32)
        params, _ = sampling_params(0.0, None, 0)
        # decode chunks are sized by the steps to come: warm the real run's count, so its chunks compile here
        chunked = decode.chunk_steps(self, self.decode_host(batch), new_tokens - 1) > 1
        tokens = new_tokens if chunked else WARMUP_TOKENS
        self.decode_trials.pop(batch, None)  # so that this compiles the executor `decode.choose` takes untried
        for _ in self._steps(ids, tokens, params, cache_tokens=new_tokens):
            pass
        # the trial's longer run fits the cache
        steps = min(self.runtime.decode_trial, new_tokens - decode_trial.COMPILE_TOKENS)
        trying = (steps > 0 and self.planner.chooses_decode_mode
                  and decode.choose(self, batch, steps) is decode.DeviceDecode)
        if trying:
            decode_trial.compile_loops(self, batch, prompt_len, new_tokens, device_too=chunked)
        self.precompile_routed()  # for both executors' shapes: the trial's timed runs compile nothing
        if trying:
            self.decode_trials[batch] = decode_trial.trial(self, batch, prompt_len, new_tokens, steps)
            self.set_policy(self.runtime.policy, self.runtime.policy_options)  # the pool afresh after the trial
        self.warmed_shapes.add(self.program_shape(batch, prompt_len, new_tokens))
        return self.compiled_programs

    def program_shape(self, batch: int, prompt_len: int, new_tokens: int) -> tuple[int, int, int, int]:
        """What a generation's programs depend on: (batch, padded prompt, prompt chunk, KV cache length). Shapes
        with the same key run the same programs, so one warm-up serves them all."""
        return (batch, *self._geometry(batch, prompt_len, new_tokens))

    def precompile_routed(self) -> None:
        """For the step shapes run so far: compile what routing decides whether a run needs (CPU expert row buckets,
        the layer combinations, the slot commits, the decode bank's fill), then start pool and statistics afresh."""
        first = self._moe_layers[0]
        shapes = self._loop.step_shapes
        for shard in self.shards:
            for n in sorted({n_pad for _, _, n_pad in shapes}):
                shard.cpu_experts.precompile(first, n, self.cache_dtype)
            precompile_slot_writes(shard.pool, shard.store, first, shard.count)
        precompile_combine(self._programs, shapes, self.devices, self.cache_dtype, self.config.hidden_size,
                           self.cpu_experts.min_rows)
        precompile_bank_writes(self.pool, self.store, first, self.budget.decode_fill_group, self.decode_slots,
                               self.runtime.decode_bank_pieces)
        self.set_policy(self.runtime.policy, self.runtime.policy_options)

    def device_memory(self) -> dict[str, int | None]:
        """Accelerator bytes held by live arrays, and the device allocator's bytes in use where it reports them."""
        live = sum(a.nbytes for a in jax.live_arrays() if self.devices.accel in a.devices()
                   and a.sharding.memory_kind in (None, "device"))
        reported = (self.devices.accel.memory_stats() or {}).get("bytes_in_use")
        return {"live_array_bytes": int(live), "bytes_in_use": reported}

    def _mark(self, phase: str, event: str, layer: int, at: float | None = None) -> None:
        """Record a stage of layer `layer` in the timeline, when one is being recorded."""
        if self.timeline is not None:
            self.timeline.mark(phase, event, layer, time.perf_counter() if at is None else at)

    # ---- steps -----------------------------------------------------------------------------------------
    def _check(self, input_ids, max_new_tokens=None, temperature=0.0, top_k=None, seed=0,
               what: str = "generate", **sampling) -> np.ndarray:
        """int32 ids [B, T] after checking every argument of the call (`generation.generator.check_request`):
        ids in [0, vocab) before the cast, B >= 1, T >= 1, the KV cache's max_batch / max_seq_len, sampling."""
        rc = self.runtime
        return check_request(input_ids, None, self.config.vocab_size, max_new_tokens, temperature, top_k, seed,
                             max_batch=rc.max_batch, max_seq_len=rc.max_seq_len, what=what, **sampling)

    def _geometry(self, batch: int, prompt_len: int, new_tokens: int) -> tuple[int, int, int]:
        """(padded prompt length, prefill chunk, KV cache length) of a generation."""
        rc = self.runtime
        if batch > 1 and prompt_len > rc.prefill_chunk:
            chunk = rc.prefill_chunk
            t_pad = round_up(prompt_len, chunk)
        else:
            t_pad = chunk = prefill_rows(prompt_len, rc, sequences=1)
        return t_pad, chunk, round_up(max(t_pad, prompt_len + new_tokens), CACHE_BUCKET)

    def _start(self, ids: np.ndarray, max_new_tokens: int, cache_tokens: int | None = None):
        """A fresh KV cache (sized for `cache_tokens` new tokens, default `max_new_tokens`) and the padded prompt's
        chunks [(c0, ids [B, C])]."""
        b, t = ids.shape
        t_pad, chunk, max_len = self._geometry(b, t, max(max_new_tokens, cache_tokens or 0))
        padded = np.zeros((b, t_pad), np.int32)
        padded[:, :t] = ids
        cache = self._init_cache(b, max_len, self.cache_dtype)
        return list(cache), [(c0, padded[:, c0:c0 + chunk]) for c0 in range(0, t_pad, chunk)]

    def _prefill(self, chunks, cache, t: int):
        """Yields (c0, hidden states [B, C, D] of the chunk, cache) for each chunk holding a real token."""
        for c0, ids in chunks:
            if c0 >= t:
                break
            b, c = ids.shape
            positions = np.broadcast_to(np.arange(c0, c0 + c, dtype=np.int32), (b, c))
            x, cache = self._loop.step(jax.device_put(ids, self.devices.accel),
                                       jax.device_put(positions, self.devices.accel), cache, "prefill",
                                       (positions < t).reshape(-1))
            yield c0, x, cache


def _logit_windows(width: int, real: int, size_max: int):
    """Windows covering the first `real` positions of a chunk `width` wide, all of one size (so one compiled
    logits program). Yields (start, size, lo, hi): compute chunk positions start..start+size-1 and keep lo..hi-1,
    rows lo-start..hi-start of the window. Windows step by `size`; the last one is moved back to end at the
    chunk's edge when it would run past it (then start < lo), so start <= lo < hi <= start + size <= width."""
    size = min(size_max, width)
    for lo in range(0, real, size):
        yield min(lo, width - size), size, lo, min(lo + size, real)
