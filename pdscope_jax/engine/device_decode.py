"""Decode as ONE accelerator program per step: the program routes each MoE layer, takes every activated expert
from the slot pool or copies it from pinned host memory itself, and keeps the pool a cache of them; the host only
dispatches the step.

Why: host-driven decode (`offload.engine`: per MoE layer, fetch the routing, plan, dispatch loads and expert
programs) held the H200 node's host 1.7-3.2 ms per MoE layer at batch 1, while the copies themselves need about
0.35 ms per missed expert (benchmarks/results, calls 16-24). A jitted program can index pinned host memory with an
index it computed and copy just that expert (`benchmarks/probes/probe_host_gather.py`: 6 experts in 2.1-2.9 ms, 36-48 GB/s),
so a whole decode step needs no host round trip. What it cannot do well is run experts on the CPU backend: a
host callback (`jax.pure_callback`) that runs them there costs more than copying them
(`benchmarks/probes/probe_decode_cpu_callback.py`, call 49: a layer handing 4 experts to the CPU took 3.10 ms against 1.47 ms
copying them; 2 + 2 took 3.28 ms, so the copies did not overlap the callback, and 4 experts took 1.37 ms on the CPU
outside any program). Policies whose decode plan keeps every activated expert on the accelerator
(`DEVICE_DECODE_POLICIES`) use it. Measured on
the H200 (calls 26-29): decode 12.6 -> 18.1 tok/s for `ondemand`, 8.6 -> 21.9 for `pdscope` (skewed routing);
with a layer's picks handled as straight-line code instead of a loop (call 34): 20.1 and 23.6. The picks' weights
as one array straight from the copy (no zero rows, no select between copies and pool rows) and a matmul with a
batch dimension on both sides (no transpose): a resident stand-in layer 0.53-0.57 -> 0.46 ms (the decode probe,
calls 39-40 against 45), DeepSeek-V2-Lite decode 19.8-20.9 -> 21.1-22.5 tok/s (skewed, calls 41 and 46). Tried
and measured slower (calls 43-44): running each pick where its weights lie, one matmul per pick (XLA rewrites a
one-row matmul into a multiply and a reduction that write the whole product, and merged two-row ones into one
matmul over concatenated weights).

Contract:
- `PoolTable`: the slot pool's table as accelerator arrays: `slot_of` [Lm, E] int32 (-1: not resident), `owner`
  [S] int32 (MoE position * E + expert; -1: free), `keep` [S] int32 (how much the slot's expert is worth keeping;
  the victim of a miss is the slot of least `keep`; -1: free), `bonus` [Lm, E] int32 >= 0 (clock ticks an
  expert's popularity adds to its worth; zeros: LRU), `clock` [] int32 (one tick per MoE layer run), `counts`
  [3] int32 (activated, hits, evictions since upload), `routed` [Lm, E] int32 (rows routed to each expert since
  upload). `upload(pool, moe_layers, bonus, device)` builds it from a `SlotPool` (bonus [Lm, E] or None: LRU);
  `download(table, pool, moe_layers)` writes it back (the pool's arrays are the step's donated outputs, set by
  the caller).
- Residency rules (GreedyDual with popularity as the cost): an expert used at clock c is worth c + its bonus. A
  hit refreshes its slot's `keep` to that; a layer's misses, most worth first, are paired with the slots least
  worth keeping (least first, this layer's hits excluded), and a miss takes its slot when it is worth more than
  the slot's expert (always, under LRU), else it is used once and not kept. Under LRU (`ondemand`, `gpu`) the
  pool is an LRU cache; with bonuses from a hot table (`pdscope`, `engine._decode_bonus`) a popular expert
  outlives an unpopular one used as recently by its bonus in ticks, and an expert used often stays whatever the
  table says. Fixed priorities, the rule before call 40, kept the table's favourites even where decode used
  others: Qwen3-30B-A3B's hit rate was 0.92 against LRU's 0.96 (call 39), 0.985 with GreedyDual (call 40). The
  other way on DeepSeek-V2-Lite with skewed routing: 0.50 with fixed priorities (call 37), 0.41 with
  GreedyDual (call 41; LRU 0.35), where a bonus of one pool turnover lets a popular expert go after a few idle
  steps.
- `decode_step(graphs, model_graph, moe_layers, temperature, top_k, states, model_state, experts, token,
  positions, caches, root, step, pool_gu, pool_dn, table) -> (token [B], positions + 1, step + 1, caches,
  pool_gu, pool_dn, table)`: one step of the model on token [B] at positions [B, 1] (graphs, model_graph,
  moe_layers and sampling static; caches, pool and table donated). `experts[m]` is the m-th MoE layer's experts
  in pinned host memory: (gate_up [E,D,2F], down [E,F,D]) whole-layer stacks, or (gate_ups, downs) tuples of E
  per-expert arrays. Per MoE layer: the route program's attention, router and shared experts; the layer's
  distinct activated experts (at most min(B*K, E)); its misses copied first (`expert_store.pull_traced`: from
  stacks, all at once; from per-expert arrays, one after another); then the distinct experts run in one batched
  call, each weighted over the rows that chose it, and each miss is kept or not by the rules above. Sampling
  matches `programs.next_token` with key fold_in(root, step).
- `fits(pool, picks)`: whether the pool can serve a layer of `picks` distinct experts this way (more slots than
  picks, so a layer's misses always find a victim that is not one of its hits).
Numbers equal the host-driven engine's within float tolerance: same programs for attention and routing, the same
expert function, a per-expert sum in float32.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pdscope_jax.generation.generator import sample
from pdscope_jax.models.layers import expert_ffn
from pdscope_jax.engine.programs import dense_layer, moe_route
from pdscope_jax.store.expert_store import pull_traced
from pdscope_jax.store.slot_pool import SlotPool

PROTECTED = np.iinfo(np.int32).max  # `keep` of this layer's hit slots while it places its misses
F32 = jnp.float32


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PoolTable:
    slot_of: jax.Array  # [Lm, E] int32
    owner: jax.Array  # [S] int32
    keep: jax.Array  # [S] int32
    bonus: jax.Array  # [Lm, E] int32
    clock: jax.Array  # [] int32
    counts: jax.Array  # [3] int32: activated, hits, evictions
    routed: jax.Array  # [Lm, E] int32: rows routed to each expert


def fits(pool: SlotPool, picks: int) -> bool:
    return pool.num_slots > picks


def upload(pool: SlotPool, moe_layers: tuple[int, ...], bonus: np.ndarray | None,
           device: jax.Device) -> PoolTable:
    """The pool's table on `device`; `bonus` [Lm, E] non-negative int32 (None: zeros, LRU; see the module
    docstring). A resident's `keep` is its last use (the pool's LRU clock) plus its bonus."""
    e = pool.num_experts
    position = {layer: m for m, layer in enumerate(moe_layers)}
    slot_of = np.stack([pool.slot_of(layer) for layer in moe_layers]).astype(np.int32)
    owner = np.where(pool.owner_layer >= 0,
                     np.array([position.get(int(l), 0) for l in pool.owner_layer]) * e + pool.owner_expert, -1)
    bonus = np.zeros(slot_of.shape, np.int32) if bonus is None else np.asarray(bonus, np.int32)
    keep = np.where(owner >= 0, pool.last_use + bonus.reshape(-1)[np.maximum(owner, 0)], -1)
    clock = int(pool.last_use.max(initial=0))
    table = PoolTable(slot_of, owner.astype(np.int32), keep.astype(np.int32), bonus, np.int32(clock),
                      np.zeros(3, np.int32), np.zeros(slot_of.shape, np.int32))
    return jax.device_put(table, device)


def download(table: PoolTable, pool: SlotPool, moe_layers: tuple[int, ...]) -> dict[str, int]:
    """Write the table back into `pool`'s host bookkeeping (each resident's last use: its `keep` less its
    bonus). -> {activated, hits, evictions} since upload."""
    e = pool.num_experts
    owner, keep = np.asarray(table.owner), np.asarray(table.keep).astype(np.int64)
    clock = int(table.clock)
    last_use = keep - np.asarray(table.bonus).reshape(-1)[np.maximum(owner, 0)]
    pool.set_table(np.where(owner >= 0, np.asarray(moe_layers)[np.maximum(owner, 0) // e], -1),
                   np.where(owner >= 0, owner % e, -1), np.where(owner >= 0, last_use, 0), clock)
    activated, hits, evictions = (int(v) for v in np.asarray(table.counts))
    pool.evictions += evictions
    return {"activated": activated, "hits": hits, "evictions": evictions}


def _routed_experts(m, h, weights, ids, experts, pool_gu, pool_dn, table):
    """The routed output [N, D] f32 of MoE layer position m for rows h [N, D] routed to ids [N, K] with weights
    (see the module docstring); -> (y, pool_gu, pool_dn, table). Straight-line code, no loop: the layer's misses
    are copied at once and every pick's weights come out of that copy's program as one array (hits read from
    their slots) before any slot is written, every distinct expert runs in one batched call, and the misses, most
    worth first, are paired with the slots least worth keeping (a hit slot never among them). A loop over the
    picks cost the H200 a kernel chain per pick (and XLA:CPU a copy of the whole pool per layer); unrolled, the
    GPU build copied the pool per layer."""
    num_layers, num_experts = table.slot_of.shape
    num_slots = table.keep.shape[0]
    size = min(ids.size, num_experts)
    picks = jnp.unique(ids.reshape(-1), size=size, fill_value=-1)  # ascending; -1 pads the end
    valid = picks >= 0
    picks = jnp.where(valid, picks, picks[0])  # a pad repeats the first pick, with no weight and no count
    slots = table.slot_of[m, picks]
    miss = valid & (slots < 0)
    clock = table.clock + 1
    worth = clock + table.bonus[m, picks]
    order = jnp.argsort(jnp.where(miss, -worth, PROTECTED), stable=True)  # misses first, most worth first
    picks, valid, miss, slots, worth = (a[order] for a in (picks, valid, miss, slots, worth))
    rest = (pool_gu, pool_dn, jnp.maximum(slots, 0))  # after the misses: hits (and pads) from their slots
    gate_ups, downs = pull_traced(experts, picks, jnp.sum(miss, dtype=jnp.int32), rest)
    chose = (ids[None] == picks[:, None, None]) & valid[:, None, None]  # [U, N, K]: row n chose pick u
    coeff = jnp.sum(jnp.where(chose, weights[None], 0.0), axis=2)  # [U, N]
    rows = jnp.broadcast_to(h, (picks.shape[0], *h.shape))  # [U, N, D]: a batch dimension on both sides, so the
    outputs = jax.vmap(expert_ffn)(rows, gate_ups, downs).astype(F32)  # weights are not transposed (call 40)
    y = jnp.sum(jnp.where(valid[:, None, None], coeff[:, :, None] * outputs, 0.0), axis=0)

    hit = valid & ~miss
    parked = jnp.where(hit, slots, num_slots)  # out of range: dropped
    keep = table.keep.at[parked].set(PROTECTED, mode="drop")
    victims = jax.lax.top_k(-keep, picks.shape[0])[1]  # the slots least worth keeping, least first
    kept = miss & (worth > keep[victims])  # the i-th miss against the i-th victim
    target = jnp.where(kept, victims, num_slots + jnp.arange(picks.shape[0]))  # distinct; out of range: dropped
    evicted = jnp.where(kept, table.owner[victims], -1)
    slot_of = table.slot_of.at[jnp.where(evicted >= 0, evicted // num_experts, num_layers),
                               evicted % num_experts].set(-1, mode="drop")
    slot_of = slot_of.at[jnp.where(kept, m, num_layers), picks].set(victims, mode="drop")
    owner = table.owner.at[target].set(m * num_experts + picks, mode="drop")
    keep = keep.at[target].set(worth, mode="drop").at[parked].set(worth, mode="drop")  # hits: their own worth back
    pool_gu = pool_gu.at[target].set(gate_ups, mode="drop", unique_indices=True)
    pool_dn = pool_dn.at[target].set(downs, mode="drop", unique_indices=True)
    routed = table.routed.at[m, picks].add(jnp.sum(chose, axis=(1, 2), dtype=jnp.int32))
    counts = table.counts + jnp.stack([jnp.sum(valid), jnp.sum(hit), jnp.sum(evicted >= 0)]).astype(jnp.int32)
    return y, pool_gu, pool_dn, PoolTable(slot_of, owner, keep, table.bonus, clock, counts, routed)


def decode_step(graphs, model_graph, moe_layers, temperature, top_k, states, model_state, experts, token, positions,
                caches, root, step, pool_gu, pool_dn, table):
    model = nnx.merge(model_graph.graphdef, model_state)
    x = model.embed(token[:, None])  # [B, 1, D]
    rows = token.shape[0]
    caches = list(caches)
    for i, (graph, state) in enumerate(zip(graphs, states)):
        if i not in moe_layers:
            x, caches[i] = dense_layer(graph, state, x, positions, caches[i])
            continue
        m = moe_layers.index(i)
        x, h, weights, ids, _, shared, caches[i] = moe_route(graph, state, x, positions, caches[i], rows, False)
        y, pool_gu, pool_dn, table = _routed_experts(m, h, weights, ids, experts[m], pool_gu, pool_dn, table)
        x = x + (y.astype(x.dtype) + shared).reshape(x.shape)
    logits = model.logits(x)[:, 0]
    token = sample(logits, jax.random.fold_in(root, step), temperature, top_k)
    return token, positions + 1, step + 1, tuple(caches), pool_gu, pool_dn, table


def build_decode_step():
    """`decode_step` jitted: graphs, model graph, MoE layer indices and sampling static; caches, pool and table
    donated."""
    return jax.jit(decode_step, static_argnums=(0, 1, 2, 3, 4), donate_argnums=(10, 13, 14, 15))
