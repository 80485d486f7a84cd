"""What a planner sees (`LayerDemand`), what it decides (`Plan`), the `Planner` interface, and `check_plan`.

Contract: per MoE layer and step the engine builds a `LayerDemand` (small numpy arrays: tokens per expert,
residency, the next layer's predicted scores) and asks the policy's planner for a `Plan`. Planners are pure
Python over these arrays (no device arrays, no jax); they may keep online statistics (e.g. a predictor's hit
rate) and update them in `observe`, which the engine calls once the next layer's true routing is known.

Plan semantics, in the order the engine acts on them:
- `unload`: this layer's resident experts whose slots may be freed (before loading when they are not in `gpu`,
  after this layer's compute when they are);
- `load_now`: non-resident activated experts to load before computing, in issue order (highest priority first);
- `gpu` / `cpu`: where each activated expert of this layer is computed (sorted ids); `gpu` = resident activated
  experts + `load_now`;
- `prefetch`: next-layer experts to start loading now, in issue order;
- `stream_next_layer`: prefill only; stream the whole next layer into the other full-layer buffer (the engine
  falls back to on-demand loading when two full layers do not fit);
- `load_low` ⊆ load_now, `prefetch_low` ⊆ prefetch, `stream_low`: copies made from the host's int4 copy
  (`sched.precision`; only where `demand.precision` allows, every copy under quality "int4").

`check_plan(demand, plan)` raises `PlanError` listing every broken invariant: each activated expert in exactly
one of gpu/cpu; non-activated experts never computed; load_now ⊆ gpu and never resident; gpu experts resident
or loaded now; unload ⊆ resident; prefetch only next-layer experts that are not resident there; and slots:
`len(load_now) + len(prefetch) <= free_slots + (unloaded experts not computed on the GPU now)`; low copies as
above.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Protocol, runtime_checkable

import numpy as np

from pdscope_jax.sched.costs import PHASES, CostTable
from pdscope_jax.sched.precision import LOW, PrecisionRule

_EMPTY = np.zeros(0, dtype=np.int64)


class PlanError(ValueError):
    """A plan that breaks an invariant for its demand; the message lists every violation."""


def _ids(x) -> np.ndarray:
    return _EMPTY if x is None or len(x) == 0 else np.asarray(x, dtype=np.int64).reshape(-1)


def cold_to_hot(ids: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    """`ids` sorted ascending by `tokens[ids]`, ties by id (the papers' E_cur / E_next order)."""
    return ids[np.lexsort((ids, tokens[ids]))]


class Capabilities:
    """What a planner needs from the engine, as class attributes (the engine reads these, never a policy name).
    Every planner derives from this; see `sched.registry` for what each one means."""

    reads_next_scores = False
    predictor_scores = False
    keeps_all_resident = False
    decodes_on_device = False
    decode_popularity = False
    decode_host_experts = False
    decode_copies = True
    balances_accelerators = False
    chooses_decode_mode = False

    @classmethod
    def hot_slots(cls, pool_slots: int, num_experts: int, layer_buffers_fit: bool, have_table: bool) -> int | None:
        """Pool slots its hot-expert table gets (None: no table), given the pool, whether two whole layers fit it
        (`layer_buffers_fit`) and whether activation counts were given (`have_table`)."""
        return None


class HotExperts:
    """The hot-expert table (PAPER.md offline step 4): per layer, the `per_layer` most activated experts in
    `activation_counts[layer]` (ties: lower id), or experts 0..per_layer-1 for a layer without counts. Planners
    that have one expose it as `hot_experts(layer)`, and the engine preloads those experts."""

    def __init__(self, per_layer: int = 0, activation_counts: Mapping[int, Sequence[float]] | None = None):
        if per_layer < 0:
            raise ValueError(f"hot_per_layer must be >= 0, got {per_layer}")
        self.per_layer = per_layer
        self._hot: dict[int, np.ndarray] = {}
        for layer, counts in (activation_counts or {}).items():
            counts = np.asarray(counts, dtype=np.float64)
            self._hot[layer] = np.sort(np.lexsort((np.arange(counts.size), -counts))[:per_layer])

    def __call__(self, layer: int) -> np.ndarray:
        hot = self._hot.get(layer)
        return hot if hot is not None else np.arange(self.per_layer)


@dataclasses.dataclass(frozen=True, eq=False)
class LayerDemand:
    layer: int                      # decoder-layer index
    phase: str                      # "prefill" | "decode"
    # Array fields are normalised to numpy (int64 / bool / float64) on construction.
    tokens_per_expert: np.ndarray   # [E] int, tokens routed to each expert now (0 = not activated)
    resident: np.ndarray            # [E] bool, in a GPU slot (or transfer already issued) now
    next_layer: int | None          # next MoE layer, None at the last
    next_scores: np.ndarray | None  # [E] predicted activation probability for next layer (None: no predictor)
    next_resident: np.ndarray | None  # [E] bool, next layer's experts in a slot or in flight
    free_slots: int                 # slots usable without evicting this layer's experts
    total_slots: int
    num_tokens: int | None = None   # tokens in this step (batch x new tokens); None: max(tokens_per_expert)
    precision: PrecisionRule | None = None  # how copies may load from the int4 copy (None: base precision only)
    peak_weight: np.ndarray | None = None  # [E] largest relative routing weight now (`precision.relative_peaks`)

    def __post_init__(self) -> None:
        if self.phase not in PHASES:
            raise ValueError(f"phase must be one of {PHASES}, got {self.phase!r}")
        for name, dtype in (("tokens_per_expert", np.int64), ("resident", bool), ("next_scores", np.float64),
                            ("next_resident", bool), ("peak_weight", np.float64)):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, np.asarray(value, dtype=dtype))
        tok = self.tokens_per_expert
        e = tok.shape[0] if tok.ndim == 1 else -1
        problems = []
        if tok.ndim != 1 or (tok < 0).any():
            problems.append(f"tokens_per_expert must be a 1-D non-negative array, got shape {tok.shape}")
        for name in ("resident", "next_scores", "next_resident", "peak_weight"):
            v = getattr(self, name)
            if v is not None and v.shape != (e,):
                problems.append(f"{name} has shape {v.shape}, expected ({e},)")
        if (self.next_scores is not None or self.next_resident is not None) and self.next_layer is None:
            problems.append("next_scores/next_resident given but next_layer is None")
        if not 0 <= self.free_slots <= self.total_slots:
            problems.append(f"need 0 <= free_slots ({self.free_slots}) <= total_slots ({self.total_slots})")
        if problems:
            raise ValueError("invalid LayerDemand:\n  " + "\n  ".join(problems))

    @property
    def num_experts(self) -> int:
        return int(self.tokens_per_expert.shape[0])

    @property
    def activated(self) -> np.ndarray:
        """[E] bool: experts with at least one token now."""
        return self.tokens_per_expert > 0

    @property
    def step_tokens(self) -> int:
        """Tokens in this step: `num_tokens`, or the lower bound max(tokens_per_expert) when not given."""
        if self.num_tokens is not None:
            return int(self.num_tokens)
        return int(np.max(self.tokens_per_expert, initial=0))

    def resident_activated(self) -> np.ndarray:
        return np.flatnonzero(self.activated & self.resident)

    def missing_cold_to_hot(self) -> np.ndarray:
        """Activated experts not resident, ascending by tokens (E_cur)."""
        return cold_to_hot(np.flatnonzero(self.activated & ~self.resident), self.tokens_per_expert)

    def next_not_resident(self) -> np.ndarray:
        """[E] bool: next-layer experts neither in a slot nor in flight (all False at the last layer)."""
        if self.next_layer is None:
            return np.zeros(self.num_experts, dtype=bool)
        if self.next_resident is None:
            return np.ones(self.num_experts, dtype=bool)
        return ~self.next_resident


@dataclasses.dataclass(frozen=True, eq=False)
class Plan:
    gpu: np.ndarray        # this layer's expert ids computed on the GPU (resident ones + load_now)
    load_now: np.ndarray   # subset of gpu: loaded on demand before computing, issue order
    cpu: np.ndarray        # this layer's activated expert ids computed on the CPU
    prefetch: np.ndarray   # next layer's expert ids to start loading now, issue order
    unload: np.ndarray     # this layer's resident expert ids whose slots may be freed
    stream_next_layer: bool = False   # prefill: stream all of the next layer into the other full-layer buffer
    load_low: np.ndarray = dataclasses.field(default_factory=lambda: _EMPTY)  # load_now ids copied low
    prefetch_low: np.ndarray = dataclasses.field(default_factory=lambda: _EMPTY)  # prefetch ids copied low
    stream_low: bool = False  # the streamed next layer is copied low

    @classmethod
    def from_loads(cls, demand: LayerDemand, load_now=None, prefetch=None, unload=None,
                   stream_next_layer: bool = False) -> "Plan":
        """The plan that loads `load_now`, computes every other resident activated expert on the GPU too, and
        every remaining activated expert on the CPU; its copies' precision by `demand.precision`'s rule."""
        load_now, prefetch = _ids(load_now), _ids(prefetch)
        on_gpu = demand.activated & demand.resident
        on_gpu[load_now] = True
        cpu_mask = demand.activated & ~on_gpu
        low = (_EMPTY, _EMPTY, False) if demand.precision is None else demand.precision.split(
            demand, load_now, prefetch, stream_next_layer)
        return cls(gpu=np.flatnonzero(on_gpu), load_now=load_now, cpu=np.flatnonzero(cpu_mask), prefetch=prefetch,
                   unload=np.sort(_ids(unload)), stream_next_layer=stream_next_layer, load_low=low[0],
                   prefetch_low=low[1], stream_low=low[2])


@runtime_checkable
class Planner(Protocol):
    """A placement policy. `plan` must be cheap (it runs per layer per step) and must not touch devices."""

    name: str

    def plan(self, demand: LayerDemand, costs: CostTable) -> Plan: ...


@runtime_checkable
class ObservingPlanner(Planner, Protocol):
    """A planner with online statistics: `observe(layer, phase, actual_next_experts)` is called after layer
    `layer`'s successor has been routed, with the ids of the experts it actually activated."""

    def observe(self, layer: int, phase: str, actual_next_experts: np.ndarray) -> None: ...


def check_plan(demand: LayerDemand, plan: Plan) -> None:
    """Raise `PlanError` listing every invariant `plan` breaks for `demand` (see the module docstring)."""
    e = demand.num_experts
    act = demand.activated
    res = demand.resident
    p: list[str] = []
    masks = {}
    for name in ("gpu", "load_now", "cpu", "prefetch", "unload", "load_low", "prefetch_low"):
        ids = np.asarray(getattr(plan, name))
        if ids.ndim != 1 or (ids.size and not np.issubdtype(ids.dtype, np.integer)):
            p.append(f"{name} must be a 1-D integer array, got dtype {ids.dtype} shape {ids.shape}")
            ids = _EMPTY
        if ids.size and (ids.min() < 0 or ids.max() >= e):
            p.append(f"{name} has ids outside [0, {e}): {ids[(ids < 0) | (ids >= e)].tolist()}")
            ids = ids[(ids >= 0) & (ids < e)]
        m = np.zeros(e, dtype=bool)
        m[ids] = True
        if np.count_nonzero(m) != ids.size:
            p.append(f"{name} repeats ids: {ids.tolist()}")
        masks[name] = m
    gpu, cpu, load, pre, unl = (masks[k] for k in ("gpu", "cpu", "load_now", "prefetch", "unload"))
    if (gpu & cpu).any():
        p.append(f"experts on both gpu and cpu: {np.flatnonzero(gpu & cpu).tolist()}")
    if (act & ~gpu & ~cpu).any():
        p.append(f"activated experts computed nowhere: {np.flatnonzero(act & ~gpu & ~cpu).tolist()}")
    if ((gpu | cpu) & ~act).any():
        p.append(f"non-activated experts computed: {np.flatnonzero((gpu | cpu) & ~act).tolist()}")
    if (load & ~gpu).any():
        p.append(f"load_now not in gpu: {np.flatnonzero(load & ~gpu).tolist()}")
    if (load & res).any():
        p.append(f"load_now holds resident experts: {np.flatnonzero(load & res).tolist()}")
    if (gpu & ~res & ~load).any():
        p.append(f"gpu experts neither resident nor loaded: {np.flatnonzero(gpu & ~res & ~load).tolist()}")
    if (unl & ~res).any():
        p.append(f"unload holds non-resident experts: {np.flatnonzero(unl & ~res).tolist()}")
    if pre.any():
        if demand.next_layer is None:
            p.append("prefetch at the last MoE layer")
        elif (pre & ~demand.next_not_resident()).any():
            p.append(f"prefetch of next-layer experts already resident: "
                     f"{np.flatnonzero(pre & ~demand.next_not_resident()).tolist()}")
    if plan.stream_next_layer and (demand.phase != "prefill" or demand.next_layer is None):
        p.append("stream_next_layer is only for prefill with a next layer")
    capacity = demand.free_slots + int(np.count_nonzero(unl & ~gpu))
    needed = int(load.sum() + pre.sum())
    if needed > capacity:
        p.append(f"needs {needed} slots (load_now + prefetch) but only {capacity} are free "
                 f"({demand.free_slots} free + unloaded ones not computed now)")
    p += _precision_problems(demand, plan, masks)
    if p:
        raise PlanError(f"invalid plan for layer {demand.layer} ({demand.phase}):\n  " + "\n  ".join(p))


def _precision_problems(demand: LayerDemand, plan: Plan, masks: dict[str, np.ndarray]) -> list[str]:
    """What the plan's low copies break: subsets of their copies, none unless the quality allows, all under int4."""
    p = []
    for low, of in (("load_low", "load_now"), ("prefetch_low", "prefetch")):
        if (masks[low] & ~masks[of]).any():
            p.append(f"{low} not in {of}: {np.flatnonzero(masks[low] & ~masks[of]).tolist()}")
    if plan.stream_low and not plan.stream_next_layer:
        p.append("stream_low without stream_next_layer")
    rule = demand.precision
    if rule is None and (masks["load_low"].any() or masks["prefetch_low"].any() or plan.stream_low):
        p.append("copies from the int4 copy, but the quality allows none (quality None or the stored precision)")
    if rule is not None and rule.quality == LOW and ((masks["load_now"] != masks["load_low"]).any() or (
            masks["prefetch"] != masks["prefetch_low"]).any() or plan.stream_low != plan.stream_next_layer):
        p.append("quality 'int4' copies every expert low, but some copies of this plan are not")
    return p
