"""Routing one MoE layer: attention, router and shared experts on the accelerator, the routing on the host.

Contract: `Router(programs, layers, next_moe, num_experts, mark).route(i, x, positions, layer_cache, phase, valid,
valid_device) -> Routed` dispatches ONE route program for layer i over x [B, T, D] (rows padded to valid.size,
valid [Nb] marks real tokens; valid_device is its f32 copy on the accelerator when scores are wanted) and fetches
the routing to the host in ONE round trip: the layer's sync point. With few rows (decode) the MoE input comes
along, so the CPU experts need not wait for a copy queued behind the GPU work.
Next-layer scores, when `configure(wants_scores, predictor)` asked for them and layer i has a successor: from
`predictor.predict(layer=, phase=, a=, w=, e=) -> [E] or [N, E]` probabilities (averaged over rows) when one is
given, else from the next layer's gate applied to this layer's MoE input inside the route program itself.
Marks "route_dispatched", "scores_dispatched" (with a predictor) and "routed" in the timeline.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from pdscope_jax.engine.cpu_experts import DENSE_MAX_ROWS


@dataclasses.dataclass
class Routed:
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
        """Nb: the step's rows padded to their bucket."""
        return self.h.shape[0]


class Router:
    def __init__(self, programs: dict, layers: list, next_moe: dict[int, int], num_experts: int, mark):
        self._programs, self._layers, self._next_moe = programs, layers, next_moe
        self._num_experts = num_experts
        self._mark = mark
        self.wants_scores = False
        self.predictor = None

    def configure(self, wants_scores: bool, predictor) -> None:
        """Whether the planner reads next-layer scores, and the predictor object that gives them (None: the
        next layer's gate)."""
        self.wants_scores = wants_scores
        self.predictor = predictor if wants_scores else None

    def route(self, i: int, x, positions, layer_cache, phase: str, valid: np.ndarray, valid_device) -> Routed:
        layer = self._layers[i]
        with_h = valid.size <= DENSE_MAX_ROWS
        rows = np.flatnonzero(valid)  # [Nv] real tokens (padding can sit between sequences)
        wants = i in self._next_moe and self.wants_scores
        predicts = wants and self.predictor is not None
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
        tokens = np.bincount(ids_np[rows].reshape(-1), minlength=self._num_experts)  # [E]
        return Routed(x, h, w, ids, shared, layer_cache, h_np, rows, w_np[rows], ids_np[rows], tokens, scores)
