"""The offload engine's jitted pieces: pure functions of an NNX layer's (graphdef, state) and arrays.

Contract: `build_programs() -> {name: jitted function}` with graphdefs (`static_graph.StaticGraph`) and shape
arguments static, so each traces once per shape: `embed`, `dense_layer` (a decoder layer without routed experts),
`moe_route` (attention, MoE input, router and shared experts, with the routing packed for one host fetch),
`moe_route_scored` (the same and the next layer's gate scores, Fate's predictor, in one program), `gpu_experts`
(`models.layers.combine_experts` over the slot pool, float32 sum), `take_rows` (the rows of the MoE input the CPU
experts read), `routed_share` (an executor's routed parts summed, as one accelerator's share), `moe_combine`
(residual + routed parts + shared experts), `logits` (a window of positions) and
`next_token` (sampling at one position, settings traced). KV caches are donated. `cache_size(jitted)` counts a
jitted function's compiled programs (None where jax hides it). `program_pieces(model)` -> (static graph, state) of
the model without its layers (embedding, logits) and of each layer: the arguments these pieces take. The engine
(`engine.loop`, `engine.execute`) decides what runs when; nothing here touches the host.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from pdscope_jax.generation.sampling import sample
from pdscope_jax.models.layers import combine_experts
from pdscope_jax.models.static_graph import static_graph

LOGIT_ROWS = 256  # logits are produced for at most this many tokens at a time


def embed(graph, state, ids):
    return nnx.merge(graph.graphdef, state).embed(ids)  # [B, T, D]


def dense_layer(graph, state, x, positions, layer_cache):
    return nnx.merge(graph.graphdef, state)(x, positions, layer_cache)


def moe_route(graph, state, x, positions, layer_cache, n_pad, with_h):
    """Attention, MoE input, router and shared experts; routed inputs padded to n_pad rows. `routing` packs what
    the host fetches into ONE f32 array [n_pad, 2K (+ D with_h)]: weights, expert ids (exact in f32) and, with_h,
    h: one fetch costs less than three."""
    layer = nnx.merge(graph.graphdef, state)
    x, layer_cache = layer.attend(x, positions, layer_cache)  # [B, T, D]
    h = layer.mlp_input(x).reshape(-1, x.shape[-1])  # [N, D]
    weights, ids = layer.mlp.route(h)  # [N, K] f32, [N, K] int32
    shared = layer.mlp.shared_output(h)  # [N, D]
    rows = ((0, n_pad - h.shape[0]), (0, 0))
    h, weights, ids = jnp.pad(h, rows), jnp.pad(weights, rows), jnp.pad(ids, rows)
    routing = jnp.concatenate([weights, ids.astype(jnp.float32)] + ([h.astype(jnp.float32)] if with_h else []), 1)
    return x, h, weights, ids, routing, shared, layer_cache


def next_layer_picks(graph, state, h):
    """The next MoE layer's (graph, state) router on this layer's MoE input h [N, D] -> (its top-k ids [N, K], its
    number of experts): what the predictors that read the next gate (Fate's scores, device decode's copies ahead)
    start from."""
    mlp = nnx.merge(graph.graphdef, state).mlp
    return mlp.route(h)[1], mlp.num_experts


def gate_scores(graph, state, h, valid):
    """Fate's prediction: the next layer's router on this layer's MoE input h [N, D] -> [E] share of tokens."""
    ids, num_experts = next_layer_picks(graph, state, h)  # [N, K]
    chosen = jax.nn.one_hot(ids, num_experts, dtype=jnp.float32).sum(axis=1)  # [N, E]
    chosen = chosen * valid[:, None]
    return chosen.sum(axis=0) / jnp.maximum(valid.sum(), 1)


def moe_route_scored(graph, state, x, positions, layer_cache, n_pad, with_h, next_graph, next_state, valid):
    """`moe_route` and, from its h, `gate_scores` of the next layer (graph/state next_*; valid [n_pad] f32) in
    ONE program, sparing the host a dispatch per layer."""
    out = moe_route(graph, state, x, positions, layer_cache, n_pad, with_h)
    return (*out, gate_scores(next_graph, next_state, out[1], valid))


def take_rows(h, rows):
    """h [Nb, D] -> h[rows] [R, D]."""
    return h[rows]


def gpu_experts(h, weights, ids, gate_up, down, slot_of):
    """`combine_experts` over the slot pool, its sum left in float32 (rounded once, in `moe_combine`)."""
    return combine_experts(h, weights, ids, gate_up, down, slot_of, out_dtype=jnp.float32)


def routed_part(n, y_gpu, y_cpu, cpu_rows=None):
    """The routed experts' float32 sum over the first n rows [n, D] from a GPU part [Nb, D] and a CPU part, either
    may be None (not both); the CPU part is [Nb, D], or [R, D] added at rows `cpu_rows` [R]
    (`cpu_experts.compact_rows`: a repeated row adds zeros)."""
    some = y_gpu if y_gpu is not None else y_cpu
    routed = jnp.zeros((n, some.shape[-1]), jnp.float32) if y_gpu is None else y_gpu[:n].astype(jnp.float32)
    if y_cpu is not None:
        part = y_cpu.astype(jnp.float32)
        routed = routed + part[:n] if cpu_rows is None else routed.at[cpu_rows].add(part)
    return routed


def routed_share(n, y_gpu, y_cpu, cpu_rows=None):
    """`routed_part` as one accelerator's share of the sum over several: [1, n, D] float32."""
    return routed_part(n, y_gpu, y_cpu, cpu_rows)[None]


def moe_combine(x, shared, y_gpu, y_cpu, cpu_rows=None):
    """x [B,T,D] + routed + shared [N,D], routed as `routed_part` adds it (zeros when both parts are None). The
    parts are added in float32 and rounded once to the model's dtype, as the plain model rounds its float32 sum
    over the experts (`models.experts.combine_experts`)."""
    n = shared.shape[0]
    routed = (jnp.zeros(shared.shape, jnp.float32) if y_gpu is None and y_cpu is None
              else routed_part(n, y_gpu, y_cpu, cpu_rows))
    return x + (routed.astype(shared.dtype) + shared).reshape(x.shape)


def logit_rows(graph, state, x, start, size):
    """Logits [B, size, V] of positions start..start+size-1 of x [B, T, D]."""
    rows = jax.lax.dynamic_slice_in_dim(x, start, size, axis=1)
    return nnx.merge(graph.graphdef, state).logits(rows)


def next_token(graph, state, x, index, sampling, step):
    """Sample from the logits at position `index` of x [B, T, D] -> (`sampling.Sampled`, sampling state')."""
    row = jax.lax.dynamic_slice_in_dim(x, index, 1, axis=1)  # [B, 1, D]
    return sample(nnx.merge(graph.graphdef, state).logits(row)[:, 0], sampling, step)


def build_programs() -> dict[str, Any]:
    """The jitted pieces, by name (graphdef and shape arguments static)."""
    return {
        "embed": jax.jit(embed, static_argnums=0),
        "dense_layer": jax.jit(dense_layer, static_argnums=0, donate_argnums=4),
        "moe_route": jax.jit(moe_route, static_argnums=(0, 5, 6), donate_argnums=4),
        "moe_route_scored": jax.jit(moe_route_scored, static_argnums=(0, 5, 6, 7), donate_argnums=4),
        "gpu_experts": jax.jit(gpu_experts),
        "take_rows": jax.jit(take_rows),
        "moe_combine": jax.jit(moe_combine),
        "routed_share": jax.jit(routed_share, static_argnums=0),
        "logits": jax.jit(logit_rows, static_argnums=(0, 4)),
        "next_token": jax.jit(next_token, static_argnums=0, donate_argnums=4),
    }


def program_pieces(model) -> tuple[Any, Any, list[tuple[Any, Any]]]:
    """(graph, state) of `model` without its layers, and [(graph, state)] of each layer; graphs static. The
    whole-model pieces get the model without its layers: passing every layer's arrays to each of their calls
    costs argument handling on every decode step."""
    layers = [(static_graph(graphdef), state) for graphdef, state in map(nnx.split, model.layers)]
    all_layers, model.layers = model.layers, nnx.List([])
    try:
        graphdef, state = nnx.split(model)
    finally:
        model.layers = all_layers
    return static_graph(graphdef), state, layers


def cache_size(jitted) -> int | None:
    size = getattr(jitted, "_cache_size", None)  # private in jax; present in 0.10-0.12
    return size() if size is not None else None
