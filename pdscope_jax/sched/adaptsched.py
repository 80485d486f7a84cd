"""AdaptSched, PDScope's phase-adaptive cross-layer planner (PAPER.md "AdaptSched").

`AdaptSched.plan(demand, costs) -> Plan` decides for one MoE layer the on-demand loads L_on (`load_now`), the next
layer's prefetches L_pre (`prefetch`) and the unloads L_un (`unload`); every activated expert neither resident nor in
L_on runs on the CPU. E_cur / E_next: this layer's activated and the next layer's predicted experts that are not
resident, n and n' of them, ascending by (predicted) tokens. A layer's GPU side is `t_transfer(its loads) + t_gpu(its
GPU set)`, its CPU side `t_cpu` summed over its CPU experts; `t_attn` is the next layer's attention.
Prefill (and decode mode d): 1. E_all = E_cur + E_next ascending; L_global = E_all[i:] for the first i whose GPU side is
below the CPU side of E_all[0:i] plus t_attn; j0 = the E_cur experts in E_all[0:i] bound step 2.
2. L_on = E_cur[i':] for the smallest i' >= j0 whose GPU side is below t_cpu(E_cur[0:i'-1]).
3. f = (T_C - T_G + t_attn) / t_io prefetches fit in the bubble; the ceil(f)-th is issued only if its expected utility
xi (from the hit rate R_hit of the phase) is positive; L_pre = the hottest ceil(f) or floor(f) of E_next.
Decode: n_c = argmin_x max(t_gpu(k - x experts), x * t_cpu(1 expert)); by (n > n_c, n' > n_c): a = step 2 with the
boundary on the CPU side; b = unload, then step 3 kept from making the next layer's GPU side the slower; c = unload
only; d = steps 1-3 with b's constraint. L_un: resident, not activated, not hot, least recently used. Loads and
prefetches never exceed free slots plus unloads; when cut, the hottest are kept.
Departures, on by default (`layer_guard=False, link_window=False`: exactly the paper's steps; docs/MEASUREMENTS.md):
- `layer_guard` (prefill, mode d): if steps 1-2 leave the layer slower than loading all of E_cur, take the boundary of
  least max(T_G, T_C); `link_window` (prefill, next layer not streamed): step 3 fills the link's free time, max(T_G,
  T_C) + t_attn - t_transfer(L_on).
- `stream_next_layer` (PAPER.md "Execution engine"): in prefill, when the pool holds two whole layers, stream the whole
  next layer where the cost table says it beats the plan (`_stream_pays`).
Precision (`demand.precision`, docs/PRECISION.md): the rule fixes each candidate's copy first (mixed: int4 when its
relative routing weight, predicted for E_next, is below the threshold); the steps weigh an int4 copy's transfer as
`costs.transfer_ratio("int4")` of a base one's.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
from collections.abc import Mapping, Sequence

import numpy as np

from pdscope_jax.sched.costs import CostTable
from pdscope_jax.sched.plan import PHASES, Capabilities, HotExperts, LayerDemand, Plan, cold_to_hot
from pdscope_jax.sched.precision import LOW


@dataclasses.dataclass(frozen=True)
class Decision:
    """What AdaptSched decided for one layer, for logging. None where a step did not run."""

    layer: int
    phase: str
    mode: str                  # "prefill", or decode mode "a" | "b" | "c" | "d"
    n: int                     # |E_cur|
    n_next: int                # |E_next|
    n_c: int | None            # decode balance target
    i: int | None              # step 1: L_global = E_all[i:] (i = n + n': empty)
    i_prime: int | None        # step 2: L_on = E_cur[i':] (i' = n: nothing loaded)
    f: float | None            # step 3: transfers that fit in the bubble
    xi: float | None           # step 3: expected utility of the ceil(f)-th prefetch
    T_G: float | None          # GPU side of this layer as decided (mode a: step 2's criterion values)
    T_C: float | None          # CPU side of this layer as decided
    r_hit: float
    loads: int
    prefetches: int
    unloads: int
    stream: bool = False       # prefill: the whole next layer streams (full-layer double buffering)


@dataclasses.dataclass
class _Step3:
    count: int
    f: float
    xi: float


class AdaptSched(Capabilities):
    """The planner of the module docstring. Online state: R_hit per phase (`observe`: the fraction of the
    prefetched experts, or with none prefetched of the top min(n', |actual|) of E_next, that the next layer
    activated; mean of the last `r_hit_window`, `r_hit_prior` before any), each expert's last activated step
    (for L_un), `last_decision`, and the hot table `hot_experts(layer)` that the engine preloads and that is
    never unloaded. Readings of the paper where it is ambiguous:
    - `[a:b]` excludes b; the transfer term counts |E_cur[i':]|. So prefill (and mode d) leaves the boundary
      expert E_cur[i'-1] out of the CPU side (it still runs there, PCIe stays free), decode mode a counts it;
      prefill therefore keeps at least two of E_cur on the CPU, mode a at least one.
    - Decode modes compare counts (`n' <= n_c`); `t_g` is the batched time of a GPU set, in step 1 the sum of
      both layers', and the decode balance uses the same batched model.
    - T_gap uses the physical CPU side (boundary included); in modes b/d the next-layer constraint, stated for
      ceil(f), is applied to the chosen count c as `(c - f)+ t_io + t_g(next) < t_cpu(rest of E_next)`.
    - Mode c unloads `n_c - n`, mode b `max(n_c - n, c - free_slots)`; step 1 only bounds step 2, L_pre comes
      from E_next; predicted tokens are `score * total_assignments / sum(scores)` over the m highest scores
      (m = experts activated in this layer)."""

    name = "pdscope"
    reads_next_scores = True
    predictor_scores = True
    decodes_on_device = True
    decode_popularity = True
    decode_host_experts = True
    balances_accelerators = True
    chooses_decode_mode = True

    def __init__(self, r_hit_prior: float = 0.5, r_hit_window: int = 16, hot_per_layer: int = 0,
                 activation_counts: Mapping[int, Sequence[float]] | None = None, layer_guard: bool = True,
                 link_window: bool = True):
        if not 0.0 <= r_hit_prior <= 1.0:
            raise ValueError(f"r_hit_prior must be in [0, 1], got {r_hit_prior}")
        if r_hit_window < 1:
            raise ValueError(f"r_hit_window must be >= 1, got {r_hit_window}")
        self.r_hit_prior = r_hit_prior
        self.layer_guard = layer_guard  # the departures in the module docstring
        self.link_window = link_window
        self.hot_experts = HotExperts(hot_per_layer, activation_counts)  # the engine preloads these; never unloaded
        self._hits = {phase: collections.deque(maxlen=r_hit_window) for phase in PHASES}
        self._pending: dict[int, tuple[str, np.ndarray, int]] = {}
        self._last_used: dict[int, np.ndarray] = {}
        self._step = 0
        self.last_decision: Decision | None = None

    @classmethod
    def hot_slots(cls, pool_slots: int, num_experts: int, layer_buffers_fit: bool, have_table: bool) -> int | None:
        if not have_table:
            return None
        # two whole layers stay free when they fit: prefill streams through them, decode loads into them
        return pool_slots - 2 * num_experts if layer_buffers_fit else pool_slots // 4

    # ---- online statistics -------------------------------------------------------------------------------

    def r_hit(self, phase: str) -> float:
        hits = self._hits[phase]
        return sum(hits) / len(hits) if hits else self.r_hit_prior

    def observe(self, layer: int, phase: str, actual_next_experts) -> None:
        """Score the predictions made at `layer` against the experts its successor actually activated."""
        pending = self._pending.get(layer)
        if pending is None or pending[0] != phase:
            return
        del self._pending[layer]
        _, ranked, h = pending
        actual = np.asarray(actual_next_experts, dtype=np.int64).reshape(-1)
        h = h or min(ranked.size, actual.size)
        if h:
            self._hits[phase].append(np.count_nonzero(np.isin(ranked[:h], actual)) / h)

    # ---- planning ----------------------------------------------------------------------------------------

    def plan(self, demand: LayerDemand, costs: CostTable) -> Plan:
        d = demand
        tok = np.asarray(d.tokens_per_expert, dtype=np.float64)
        act = tok > 0
        self._touch(d.layer, act)
        cur = d.missing_cold_to_hot()
        res_tok = tok[act & d.resident]
        nxt, nxt_tok, nxt_res_tok = self._predict(d, tok)
        n, n_next = cur.size, nxt.size
        s = _Layer(d, costs, cur, tok[cur], res_tok, nxt, nxt_tok, nxt_res_tok, self.r_hit(d.phase),
                   *_copy_weights(d, costs, cur, nxt))
        n_c = None
        if d.phase == "prefill":
            mode = "prefill"
        else:
            n_c = _balance_target(costs, int(np.count_nonzero(act)), float(tok[act].mean()) if act.any() else 0.0)
            mode = {(True, False): "a", (False, True): "b", (False, False): "c", (True, True): "d"}[
                (n > n_c, n_next > n_c)]
        i = i_prime = None
        step3 = None
        unload = np.zeros(0, dtype=np.int64)
        if mode in ("prefill", "d"):
            i, j0 = s.global_queue()
            i_prime = s.on_demand_boundary(j0, boundary_in_cpu_side=False, slots=d.free_slots)
            if self.layer_guard and max(s.layer_sides(i_prime)) > s.layer_sides(0)[0]:
                i_prime = s.balanced_boundary(slots=d.free_slots)
            step3 = s.prefetch_count(i_prime, next_constraint=mode == "d", slots=d.free_slots - (n - i_prime))
            t_g, t_c = s.layer_sides(i_prime)
        elif mode == "a":
            i_prime = s.on_demand_boundary(0, boundary_in_cpu_side=True, slots=d.free_slots)
            t_g, t_c = s.criterion(i_prime, boundary_in_cpu_side=True)
        else:
            t_g, t_c = s.layer_sides(n)
            wanted = 0
            if mode == "b":
                step3 = s.prefetch_count(n, next_constraint=True, slots=n_next)
                wanted = step3.count - d.free_slots
            unload = self._lru_unused(d.layer, act, d.resident, max(n_c - n, wanted))
            if step3 is not None:
                step3.count = min(step3.count, d.free_slots + unload.size)
        load_now = cur[i_prime:][::-1] if i_prime is not None else cur[:0]
        prefetch = nxt[::-1][:step3.count] if step3 is not None else nxt[:0]
        stream = mode == "prefill" and _stream_pays(d, costs, tok, prefetch, max(t_g, t_c) + s.t_attn, s.r_hit,
                                                    _all_low_ratio(d, costs))
        if mode == "prefill" and self.link_window and not stream:
            step3 = s.prefetch_count(i_prime, next_constraint=False, slots=d.free_slots - (n - i_prime),
                                     link_window=True)
            prefetch = nxt[::-1][:step3.count]
        self._pending[d.layer] = (d.phase, nxt[::-1], prefetch.size)
        self.last_decision = Decision(
            layer=d.layer, phase=d.phase, mode=mode, n=n, n_next=n_next, n_c=n_c, i=i, i_prime=i_prime,
            f=step3.f if step3 else None, xi=step3.xi if step3 else None, T_G=t_g, T_C=t_c, r_hit=s.r_hit,
            loads=load_now.size, prefetches=prefetch.size, unloads=unload.size, stream=stream)
        return Plan.from_loads(d, load_now=load_now, prefetch=prefetch, unload=unload, stream_next_layer=stream)

    def _predict(self, d: LayerDemand, tok: np.ndarray):
        """E_next (ascending by predicted tokens), its predicted tokens, and predicted tokens of the predicted
        next-layer experts that are already resident."""
        empty = np.zeros(0, dtype=np.int64)
        if d.next_layer is None or d.next_scores is None:
            return empty, np.zeros(0), np.zeros(0)
        scores = d.next_scores
        ranked = np.flatnonzero(scores > 0)
        top = ranked[np.argsort(-scores[ranked], kind="stable")][:np.count_nonzero(tok)]  # ties: lower id
        if top.size == 0:
            return empty, np.zeros(0), np.zeros(0)
        expected = _predicted_tokens(scores, tok.sum())
        missing = d.next_not_resident()[top]
        nxt = cold_to_hot(top[missing], expected)
        return nxt, expected[nxt], expected[top[~missing]]

    def _touch(self, layer: int, act: np.ndarray) -> None:
        self._step += 1
        last = self._last_used.get(layer)
        if last is None or last.size != act.size:
            last = self._last_used[layer] = np.full(act.size, -1, dtype=np.int64)
        last[act] = self._step

    def _lru_unused(self, layer: int, act: np.ndarray, resident: np.ndarray, count: int) -> np.ndarray:
        """Up to `count` resident, not activated experts of `layer` outside its hot table, least recently
        activated first."""
        cand = np.flatnonzero(resident & ~act)
        cand = cand[~np.isin(cand, self.hot_experts(layer))]
        if count <= 0 or cand.size == 0:
            return cand[:0]
        return cand[np.lexsort((cand, self._last_used[layer][cand]))][:count]


def _copy_weights(d: LayerDemand, costs: CostTable, cur: np.ndarray, nxt: np.ndarray):
    """(E_cur's, E_next's) transfer weights, aligned with them: 1 for a base copy, the low copy's transfer ratio
    for one the precision rule loads low."""
    if d.precision is None:
        return np.ones(cur.size), np.ones(nxt.size)
    ratio = costs.transfer_ratio(LOW)
    return (np.where(d.precision.low_now(d, cur), ratio, 1.0),
            np.where(d.precision.low_next(d, nxt), ratio, 1.0))


def _all_low_ratio(d: LayerDemand, costs: CostTable) -> float:
    """The transfer weight of every copy when the rule loads all of them low (quality "int4"), else 1."""
    return costs.transfer_ratio(LOW) if d.precision is not None and d.precision.quality == LOW else 1.0


def _count_within(capacity: float, weights: np.ndarray) -> float:
    """How many of the copies with transfer weights `weights` (issue order) fit `capacity` base copies, fractional
    (linear within a copy; past them base copies; capacity itself when every weight is 1)."""
    if capacity <= 0 or not (weights < 1).any():
        return capacity
    cum = np.concatenate(([0.0], np.cumsum(weights)))
    if capacity >= cum[-1]:
        return float(weights.size + (capacity - cum[-1]))
    k = int(np.searchsorted(cum, capacity, side="right")) - 1
    return float(k + (capacity - cum[k]) / weights[k])


def _predicted_tokens(scores: np.ndarray, assignments: int) -> np.ndarray:
    """Next-layer tokens per expert: each positive score's share of this layer's assignments (shares first, so
    scores of subnormal size do not overflow the division)."""
    return np.maximum(scores, 0) / scores[scores > 0].sum() * assignments


def _stream_pays(d: LayerDemand, costs: CostTable, tok: np.ndarray, prefetch: np.ndarray, window: float,
                 r_hit: float, copy_weight: float = 1.0) -> bool:
    """Whether streaming the whole next layer beats the plan for it. Only when the pool holds two whole layers
    (`total_slots >= 2E`). `window` = this layer's time as decided plus the next attention.
    - streamed: `max(0, t_transfer(non-resident there) - window) + t_g(all predicted experts)` (the copy hides
      behind this layer and the next attention; then every expert runs on the GPU);
    - planned: `min(max(t_g(resident + L_pre), C), t_transfer(n_miss) + t_g(all predicted))`: the expected
      misses are the predicted non-resident experts outside L_pre plus a share 1 - R_hit of L_pre, C their CPU
      time, n_miss their count (the alternative: load them on demand).
    Predicted next-layer tokens come from the scores, else this layer's tokens stand in (prefill hits nearly
    every expert in every layer). The plan's L_pre stays: the engine uses it where it cannot double-buffer.
    `copy_weight`: every copy's transfer weight (the low copy's ratio under quality "int4")."""
    e = d.num_experts
    if d.next_layer is None or d.total_slots < 2 * e:
        return False
    scores = d.next_scores
    if scores is not None and scores.sum() > 0:
        expected = _predicted_tokens(scores, tok.sum())
    else:
        expected = tok
    active = expected > 0
    missing = d.next_not_resident()
    pre = np.zeros(e, dtype=bool)
    pre[prefetch] = True
    all_gpu = costs.t_gpu(expected[active])
    streamed = max(0.0, float(costs.t_transfer(int(missing.sum()) * copy_weight)) - window) + all_gpu
    miss_share = np.where(pre, 1.0 - r_hit, np.where(active & missing, 1.0, 0.0))  # [E]
    planned_cpu = float(np.sum(costs.cpu_times(expected) * miss_share))
    planned = min(max(costs.t_gpu(expected[active & (~missing | pre)]), planned_cpu),
                  float(costs.t_transfer(float(miss_share.sum()) * copy_weight)) + all_gpu)
    return streamed < planned


@functools.lru_cache(maxsize=256)
def _balance_target(costs: CostTable, k: int, typical: float) -> int:
    """n_c = argmin_x max(GPU time of k - x experts, x * CPU time of one) for k experts of `typical` tokens
    (cached: in decode k and the tokens per expert repeat step after step)."""
    if k == 0:
        return 0
    x = np.arange(k + 1)
    gpu = costs.gpu_growing((), np.full(k, costs.gpu_marginals(typical)))[k - x]  # k - x experts batched
    cpu = x * costs.t_cpu(typical)
    return int(np.argmin(np.maximum(gpu, cpu)))


class _Layer:
    """One layer's cost curves over the candidate boundaries, computed once with cumulative sums."""

    def __init__(self, d: LayerDemand, costs: CostTable, cur, cur_tok, res_tok, nxt, nxt_tok, nxt_res_tok,
                 r_hit: float, w_cur: np.ndarray, w_next: np.ndarray):
        self.costs = costs
        self.w_all = np.concatenate((w_cur, w_next))  # transfer weights (`_copy_weights`), as all_tok
        self.n, self.n_next = cur.size, nxt.size
        self.r_hit = r_hit
        self.t_attn = costs.t_attn(d.phase, d.step_tokens)
        n, n_next = self.n, self.n_next
        self.all_tok = np.concatenate((cur_tok, nxt_tok))
        self.all_cpu = costs.cpu_times(self.all_tok)
        marg = costs.gpu_marginals(np.concatenate((self.all_tok, res_tok, nxt_res_tok)))
        # cpu_cur[j] = t_cpu(E_cur[0:j]); gpu_cur[m] = batched GPU time of resident + the m hottest of E_cur
        self.cpu_cur = np.concatenate(([0.0], np.cumsum(self.all_cpu[:n])))
        self.cpu_next = np.concatenate(([0.0], np.cumsum(self.all_cpu[n:])))
        # xfer_cur[j] = t_transfer(E_cur[j:]): the loads when the boundary is j (weights summed: low copies cheaper)
        self.xfer_cur = costs.t_transfer(np.concatenate((np.cumsum(w_cur[::-1])[::-1], [0.0])))
        self.w_next_hot = w_next[::-1]  # E_next hottest first, the order prefetches issue in
        split = n + n_next + res_tok.size
        self.gpu_cur = costs.gpu_growing(marg[n + n_next:split], marg[:n][::-1])
        self.gpu_next = costs.gpu_growing(marg[split:], marg[n:n + n_next][::-1])

    def global_queue(self) -> tuple[int, int]:
        """Step 1: (i, j0) with L_global = E_all[i:] and j0 = current-layer experts in E_all[0:i]."""
        n, n_next = self.n, self.n_next
        size = n + n_next
        # E_next then E_cur, each already ascending: a stable sort by tokens puts a next-layer expert before a
        # current one with as many tokens (the current one counts as hotter) and keeps id order within a layer.
        next_first = np.concatenate((self.all_tok[n:], self.all_tok[:n]))
        order = np.argsort(next_first, kind="stable")
        is_cur = order >= n_next
        cur_before = np.concatenate(([0], np.cumsum(is_cur)))  # current experts in E_all[0:i], i = 0..size
        next_before = np.arange(size + 1) - cur_before
        cpu_next_first = np.concatenate((self.all_cpu[n:], self.all_cpu[:n]))
        t_c = np.concatenate(([0.0], np.cumsum(cpu_next_first[order]))) + self.t_attn
        w_sorted = np.concatenate((self.w_all[n:], self.w_all[:n]))[order]
        xfer = self.costs.t_transfer(np.concatenate((np.cumsum(w_sorted[::-1])[::-1], [0.0])))  # of E_all[i:]
        t_g = xfer + self.gpu_cur[n - cur_before] + self.gpu_next[n_next - next_before]
        ok = (t_g < t_c)[:size]
        i = int(np.argmax(ok)) if ok.any() else size
        return i, int(cur_before[i])

    def criterion(self, i_prime, boundary_in_cpu_side: bool):
        """Step 2's (T_G, T_C) for boundary i' (scalar or array)."""
        i_prime = np.asarray(i_prime)
        t_g = self.xfer_cur[i_prime] + self.gpu_cur[self.n - i_prime]
        t_c = self.cpu_cur[i_prime if boundary_in_cpu_side else np.maximum(i_prime - 1, 0)]
        return (float(t_g), float(t_c)) if i_prime.ndim == 0 else (t_g, t_c)

    def on_demand_boundary(self, j0: int, boundary_in_cpu_side: bool, slots: int) -> int:
        """Step 2: the smallest i' >= j0 whose loads E_cur[i':] finish on the GPU before the CPU side; n if none.
        Cut to the hottest `slots` experts when more would be loaded than slots exist."""
        candidates = np.arange(j0, self.n)
        t_g, t_c = self.criterion(candidates, boundary_in_cpu_side)
        ok = t_g < t_c
        i_prime = int(candidates[np.argmax(ok)]) if ok.any() else self.n
        return max(i_prime, self.n - max(slots, 0))

    def balanced_boundary(self, slots: int) -> int:
        """The i' in [0, n] whose layer time max(GPU side, CPU side) is least (the fewest CPU experts on a tie),
        cut to the hottest `slots` loads like step 2."""
        loads = self.n - np.arange(self.n + 1)
        layer = np.maximum(self.xfer_cur + self.gpu_cur[loads], self.cpu_cur)
        return max(int(np.argmin(layer)), self.n - max(slots, 0))

    def layer_sides(self, i_prime: int) -> tuple[float, float]:
        """(GPU side, CPU side) of this layer with L_on = E_cur[i':] and E_cur[0:i'] on the CPU."""
        return (float(self.xfer_cur[i_prime] + self.gpu_cur[self.n - i_prime]),
                float(self.cpu_cur[i_prime]))

    def prefetch_count(self, i_prime: int, next_constraint: bool, slots: int, link_window: bool = False) -> _Step3:
        """Step 3: how many of E_next's hottest to prefetch after L_on = E_cur[i':], at most `slots`; with
        `link_window`, into the time the link is free (module docstring) instead of the GPU's bubble."""
        t_g, t_c = self.layer_sides(i_prime)
        t_io = self.costs.t_io
        if link_window:
            capacity = (max(t_g, t_c) + self.t_attn - self.xfer_cur[i_prime]) / t_io  # in base copies
        else:
            capacity = (t_c - t_g + self.t_attn) / t_io
        w = self.w_next_hot
        f = _count_within(capacity, w)  # prefetches (hottest first) that fit
        ceil_f = math.ceil(f)
        t_last = t_io * (w[ceil_f - 1] if 0 < ceil_f <= w.size else 1.0)  # the ceil(f)-th copy's transfer
        xi = self.r_hit * (f - ceil_f + 1) * t_last - (1 - self.r_hit) * (ceil_f - f) * t_last
        count = min(max(ceil_f if xi > 0 else math.floor(f), 0), self.n_next, max(slots, 0))
        if next_constraint:
            cum = np.concatenate(([0.0], np.cumsum(w)))  # base copies the `count` hottest take
            while count > 0 and not (max(cum[count] - capacity, 0.0) * t_io + self.gpu_next[count]
                                     < self.cpu_next[self.n_next - count]):
                count -= 1
        return _Step3(count=count, f=f, xi=xi)
