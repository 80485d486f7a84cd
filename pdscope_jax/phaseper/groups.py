"""Layer groups of PhasePer: input, middle and output MoE layers, found from inter-layer similarity.

Contract
- Layers here are positions 0..L-1 in the ordered list of MoE layers (not decoder-layer indices).
- `layer_similarity(hidden_by_layer)`: for L arrays of hidden states [N, D] (the same N tokens at every
  layer) returns a per-layer profile [L]: entry l is the mean over tokens of the cosine similarity between
  layer l's and layer l-1's hidden state (entry 0 copies entry 1, as layer 0 has no predecessor).
- `detect_groups(similarity) -> (input_end, middle_end)`: input = [0, input_end), middle =
  [input_end, middle_end), output = [middle_end, L). The boundaries are the inflection points of the
  smoothed profile: the steepest rise, then (after it) the steepest fall, chosen jointly. For L >= 3 the
  three groups are always non-empty; L < 3 raises.
- `routing_weight_spread(w_by_layer)`: per layer, the standard deviation of the routing weights [N, K].
- `plot_groups(similarity, weight_spread, groups, path)` writes a PNG (matplotlib, Agg backend).
- `groups_from_traces(traces, phase)`: all of the above on the attention outputs of a trace set.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np

GROUP_NAMES = ("input", "middle", "output")


def layer_similarity(hidden_by_layer: Sequence[np.ndarray]) -> np.ndarray:
    if len(hidden_by_layer) < 2:
        raise ValueError("layer similarity needs at least two layers")
    unit = []
    for h in hidden_by_layer:
        h = np.asarray(h, np.float32)  # [N, D]
        unit.append(h / np.maximum(np.linalg.norm(h, axis=-1, keepdims=True), 1e-12))
    n = min(u.shape[0] for u in unit)
    sims = [float(np.mean(np.sum(unit[l][:n] * unit[l - 1][:n], axis=-1))) for l in range(1, len(unit))]
    return np.asarray([sims[0]] + sims, np.float32)  # [L]


def smooth(profile: np.ndarray, sigma: float) -> np.ndarray:
    """Gaussian smoothing with reflected edges, so the ends are not pulled towards zero."""
    profile = np.asarray(profile, np.float64)
    if sigma <= 0:
        return profile
    radius = max(1, int(round(3 * sigma)))
    x = np.arange(-radius, radius + 1)
    kernel = np.exp(-0.5 * (x / sigma) ** 2)
    kernel /= kernel.sum()
    padded = np.pad(profile, radius, mode="reflect" if len(profile) > radius else "edge")
    return np.convolve(padded, kernel, mode="valid")


def detect_groups(similarity: np.ndarray, sigma: float | None = None) -> tuple[int, int]:
    """Boundaries (input_end, middle_end); `sigma` defaults to max(0.75, L/24) layers of smoothing."""
    s = np.asarray(similarity, np.float64)
    num = len(s)
    if num < 3:
        raise ValueError(f"layer groups need at least 3 MoE layers, got {num}")
    if sigma is None:
        sigma = max(0.75, num / 24)
    d = np.diff(smooth(s, sigma))  # [L-1]; d[i] is the step from layer i to i+1
    # Boundary b (a group starts at layer b) sits on step b-1; 1 <= b_in < b_mid <= L-1 keeps groups non-empty.
    best, bounds = -np.inf, (1, 2)
    for b_in in range(1, num - 1):
        for b_mid in range(b_in + 1, num):
            score = d[b_in - 1] - d[b_mid - 1]
            if score > best:
                best, bounds = score, (b_in, b_mid)
    return bounds


def group_of(position: int, groups: tuple[int, int]) -> str:
    input_end, middle_end = groups
    return "input" if position < input_end else "middle" if position < middle_end else "output"


def routing_weight_spread(w_by_layer: Sequence[np.ndarray]) -> np.ndarray:
    return np.asarray([float(np.std(np.asarray(w, np.float32))) for w in w_by_layer], np.float32)  # [L]


def plot_groups(similarity: np.ndarray, weight_spread: np.ndarray, groups: tuple[int, int], path: str | Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layers = np.arange(len(similarity))
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(7, 5), sharex=True)
    ax1.plot(layers, similarity, marker="o", label="cosine similarity to previous layer")
    ax1.plot(layers, smooth(similarity, max(0.75, len(similarity) / 24)), ls="--", label="smoothed")
    ax1.set_ylabel("similarity")
    ax2.plot(layers, weight_spread, marker="s", color="tab:orange")
    ax2.set_ylabel("routing-weight std")
    ax2.set_xlabel("MoE layer position")
    for ax in (ax1, ax2):
        for b in groups:
            ax.axvline(b - 0.5, color="gray", ls=":")
    input_end, middle_end = groups
    for name, lo, hi in zip(GROUP_NAMES, (0, input_end, middle_end), (input_end, middle_end, len(similarity))):
        ax1.text((lo + hi - 1) / 2, ax1.get_ylim()[1], name, ha="center", va="top")
    ax1.legend(loc="lower center", fontsize=8)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def groups_from_traces(traces, phase: str = "prefill", max_tokens: int = 4096):
    """(groups, similarity [L], weight_spread [L]) from the attention outputs of `traces` (a `Traces`)."""
    per_layer = [traces.layer(phase, l, max_tokens=max_tokens) for l in traces.layers]
    if min(len(d["a"]) for d in per_layer) == 0:
        raise ValueError(f"no {phase} traces for every layer: cannot detect layer groups")
    hidden = [d["a"] for d in per_layer]
    weights = [d["w"] for d in per_layer]
    similarity = layer_similarity(hidden)
    return detect_groups(similarity), similarity, routing_weight_spread(weights)
