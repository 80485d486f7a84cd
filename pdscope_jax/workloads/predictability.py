"""How much of the next MoE layer's routing a predictor can read from this layer's state: targets and calibration.

The workloads (`workloads.routing`) give each MoE layer's router a mix of two parts of the routing code: a carried
part that every layer's MoE input shows, and a fresh part that only this layer's MoE input shows (the other
layers' post-attention norms zero it). With phi the mixing angle of layer l+1, its router logits are
`cos(phi) * carried + sin(phi) * fresh + b`, and a predictor reading layer l's MoE input sees only
`cos(phi) * carried + b`. The Fate-style predictor (layer l+1's gate applied to layer l's MoE input, what `fate`
and `pdscope`'s gate fallback use) then scores top-k of exactly that, so its recall@k is a function of phi that
`fit_angle` bisects to a target: phi = 0 is an oracle, pi/2 leaves the popularity guess.

Contract:
- `PREDICTABILITY`: the named settings; a float in [0, 1] is also accepted (the target recall@k of every pair).
- `reference_targets(path=None) -> dict`: the reference MoE's held-out Fate and PhasePer recall@k per MoE layer
  pair and phase (package data, `assets/reference-moe-predictability.json`).
- `pair_targets(setting, pairs, ref=None) -> list[float | None]`: the target Fate recall@k of each of `pairs`
  consecutive MoE layer pairs of a model (None: oracle); "reference" maps reference pairs by relative depth and
  takes the mean of prefill and decode (the designed routing is a function of the token, the same in both).
- `fate_recall(known, ids, k) -> float`: recall@k of top-k(`known` [N, E]) against the true `ids` [N, K]
  (`phaseper.train.recall_at_k`, the metric of `benchmarks/eval_predictors.py`).
- `fit_angle(recall_at, target, steps) -> float`: phi in [0, pi/2] whose recall is nearest `target`, assuming
  `recall_at(phi)` falls as phi grows.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

PREDICTABILITY = ("reference", "oracle")
REFERENCE_PREDICTABILITY = Path(__file__).resolve().parents[1] / "assets" / "reference-moe-predictability.json"


def reference_targets(path: str | Path | None = None) -> dict:
    """{"pairs", "fate_recall_at_k": {phase: [...]}, "phaseper_recall_at_k": {phase: [...]}, ...} of the reference."""
    path = Path(path) if path is not None else REFERENCE_PREDICTABILITY
    ref = json.loads(path.read_text())
    for phase in ("prefill", "decode"):
        if len(ref["fate_recall_at_k"][phase]) != len(ref["pairs"]):
            raise ValueError(f"{path}: {phase} has {len(ref['fate_recall_at_k'][phase])} pairs, not "
                             f"{len(ref['pairs'])}")
    return ref


def check_setting(setting) -> str | float:
    """The setting as given, if valid (a name of `PREDICTABILITY` or a float in [0, 1]); else ValueError."""
    if isinstance(setting, str) and setting in PREDICTABILITY:
        return setting
    try:
        value = float(setting)
    except (TypeError, ValueError):
        raise ValueError(f"predictability must be one of {PREDICTABILITY} or a recall in [0, 1], "
                         f"got {setting!r}") from None
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"predictability must lie in [0, 1], got {value}")
    return value


def pair_targets(setting, pairs: int, ref: dict | None = None) -> list[float | None]:
    setting = check_setting(setting)
    if setting == "oracle":
        return [None] * pairs
    if setting != "reference":
        return [float(setting)] * pairs
    ref = reference_targets() if ref is None else ref
    both = np.mean([ref["fate_recall_at_k"][p] for p in ("prefill", "decode")], axis=0)
    return [float(both[round(t * (both.size - 1) / max(pairs - 1, 1))]) for t in range(pairs)]


def fate_recall(known: np.ndarray, ids: np.ndarray, k: int) -> float:
    from pdscope_jax.phaseper.train import recall_at_k

    return recall_at_k(known, ids, k)


def fit_angle(recall_at, target: float, steps: int = 10) -> float:
    lo, hi = 0.0, math.pi / 2
    got = recall_at(lo)
    if got <= target:  # even the oracle reaches no further
        return lo
    best = (abs(got - target), lo)
    for _ in range(steps):
        mid = (lo + hi) / 2
        got = recall_at(mid)
        best = min(best, (abs(got - target), mid))
        lo, hi = (mid, hi) if got > target else (lo, mid)
    got = recall_at(hi)
    return min(best, (abs(got - target), hi))[1]
