"""Precision as a planning decision: which copies of a layer's experts load from the host's low-precision copy.

Contract: the experts are stored at a base precision (the model's dtype, or `quantize`'s scheme); with `quality`
"mixed" or "int4" the store also keeps an int4 copy of every routed expert (`LOW`), and a copy (an on-demand
load, a prefetch or a streamed layer) may move those bytes instead; the slot keeps the base format (the int4
copy is dequantized into it on the device), so only the bytes on the link and the weights computed with change.
`quality`, the user's bound: None or the base precision: never below the base (no int4 copy kept); "int8": never
below int8 (an int8 base: the same); "mixed": the HOBBIT rule below; "int4": every copy low (preloads excepted).
`quality_problems(quality, base)` names a value or combination that cannot mean what it says (with the fix);
`rule_for(quality, base, threshold)` -> the `PrecisionRule` of a run that loads low copies, else None.
The rule ("mixed"): a copy loads low when its expert's weight is small. `relative_peaks(w, ids, E)` -> [E]: for
each expert the largest routing weight over the step's tokens routed to it, over that token's mean top-k weight
(1: an average pick; known exactly at routing, so this layer's misses use it); a next-layer expert's predicted
weight is its score over the mean of the m highest scores (m: this layer's activated experts, the predicted set).
A copy loads low when that relative weight is below `threshold` (`RuntimeConfig.mixed_threshold`); a prefetch
without scores loads at the base precision. Streamed layers (prefill) load low under "int4" only. CPU experts
and hits compute from what they hold: the base copy on the CPU, a slot's copy as it was loaded.
`PrecisionRule.split(demand, load_now, prefetch, stream)` -> (load_low, prefetch_low, stream_low): the one rule
every planner's `Plan.from_loads` applies. Pure numpy: no device, no jax.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

LOW = "int4"  # the scheme of the low-precision copy
QUALITIES = ("int8", "mixed", "int4")
DEFAULT_THRESHOLD = 1.0  # `mixed`: below an average pick's weight (relative weight 1) a copy loads low


def quality_value_problems(quality) -> list[str]:
    """Why `quality` is not a quality at all (empty for None and the `QUALITIES`)."""
    if quality is None or quality in QUALITIES:
        return []
    return [f"quality {quality!r} is not known; choose {', '.join(map(repr, QUALITIES))} (or None: never below the "
            "stored precision)"]


def quality_problems(quality, base: str | None) -> list[str]:
    """Why `quality` cannot bound copies of experts stored at `base` (None: the model's dtype); empty when it can."""
    if quality is None or quality_value_problems(quality):
        return quality_value_problems(quality)
    if quality == "int8" and base != "int8":
        stored = "in int4" if base == LOW else "in the model's dtype, with no int8 copy"
        return [f"quality='int8' keeps every copy at int8 or above, but the experts are stored {stored}: pass "
                "quantize='int8' (uniform int8), or quality='mixed' / 'int4' (an int4 copy beside them)"]
    if quality == "mixed" and base == LOW:
        return ["quality='mixed' loads int4 copies of light experts beside a higher precision, but quantize='int4' "
                "stores every expert in int4 already: pass quantize='int8' or None"]
    return []


def threshold_problems(threshold) -> list[str]:
    ok = isinstance(threshold, (int, float)) and not isinstance(threshold, bool) and math.isfinite(threshold)
    return [] if ok and threshold > 0 else [f"mixed_threshold must be a finite number > 0, got {threshold!r}"]


def loads_low(quality, base: str | None) -> bool:
    """Whether a run of `quality` on experts stored at `base` loads low copies (so the store keeps them)."""
    return quality in ("mixed", "int4") and base != LOW


@dataclasses.dataclass(frozen=True)
class PrecisionRule:
    quality: str  # "mixed" | "int4"
    threshold: float = DEFAULT_THRESHOLD

    def low_now(self, demand, experts: np.ndarray) -> np.ndarray:
        """[n] bool: which of this layer's `experts` load low (relative weights in `demand.peak_weight`)."""
        experts = np.asarray(experts, np.int64)
        if self.quality == LOW:
            return np.ones(experts.size, bool)
        if demand.peak_weight is None:
            return np.zeros(experts.size, bool)
        return demand.peak_weight[experts] < self.threshold

    def low_next(self, demand, experts: np.ndarray) -> np.ndarray:
        """[n] bool: which of the next layer's `experts` load low (predicted from `demand.next_scores`)."""
        experts = np.asarray(experts, np.int64)
        if self.quality == LOW:
            return np.ones(experts.size, bool)
        scores = demand.next_scores
        if scores is None or experts.size == 0:
            return np.zeros(experts.size, bool)
        m = max(int(np.count_nonzero(demand.activated)), 1)
        top = np.sort(scores[scores > 0])[::-1][:m]
        if top.size == 0:
            return np.zeros(experts.size, bool)
        return scores[experts] / top.mean() < self.threshold

    def split(self, demand, load_now, prefetch, stream: bool) -> tuple[np.ndarray, np.ndarray, bool]:
        """(load_low ⊆ load_now, prefetch_low ⊆ prefetch, stream_low) under this rule, in the plans' order."""
        load_now, prefetch = np.asarray(load_now, np.int64), np.asarray(prefetch, np.int64)
        return (load_now[self.low_now(demand, load_now)], prefetch[self.low_next(demand, prefetch)],
                bool(stream and self.quality == LOW))


def rule_for(quality, base: str | None, threshold: float = DEFAULT_THRESHOLD) -> PrecisionRule | None:
    """The rule of a run that loads low copies (`loads_low`), else None."""
    return PrecisionRule(quality, float(threshold)) if loads_low(quality, base) else None


def relative_peaks(w: np.ndarray, ids: np.ndarray, num_experts: int) -> np.ndarray:
    """[E]: per expert the largest w[n, k] / mean_k(w[n]) over the assignments (n, k) routed to it (0: none);
    w, ids [N, K] the step's real tokens' routing weights and expert ids."""
    w = np.asarray(w, np.float64)
    mean = w.mean(axis=1, keepdims=True) if w.size else w
    rel = np.divide(w, mean, out=np.zeros_like(w), where=mean > 0)
    out = np.zeros(num_experts)
    np.maximum.at(out, np.asarray(ids, np.int64).reshape(-1), rel.reshape(-1))
    return out
