"""Routing traces from running a model layer by layer: PhasePer's offline step 1.

Contract
- `walk(model, input_ids [B,T], positions [B,T], cache) -> Walk` is the model's forward written with the
  decoder layers' documented pieces (`attend`, `mlp_input`, `mlp.route`, `mlp.shared_output`,
  `mlp.routed_output`, then `model.logits`), so that every MoE layer's routing is visible. Its logits equal
  `model(input_ids, positions, cache)`'s. With M the MoE layers in order and N = B*T (row-major):
    a        [M, N, D]  the MoE input h = layer.mlp_input(x), x being the residual stream after attention:
                        the post-attention normalised hidden state, i.e. exactly what the router sees;
    weights  [M, N, K]  float32 routing weights, as `route` returns them;
    experts  [M, N, K]  int32 selected experts.
  It is pure and traceable: the training script jits it inside its loss, collection jits it per phase.
- `collect_traces(model, prompts [P,T], writer, decode_steps, batch_size)`: per batch of prompts, one prefill
  pass over the whole prompts, then `decode_steps` greedy decode steps (one token per sequence, KV cache).
  Each forward's records go to `writer.add(phase, layer, a, w, e)` at once, per MoE layer, phase "prefill"
  or "decode"; only running sums stay in memory, so memory is bounded by one forward plus the writer's
  buffers. Returns `CollectStats`, per phase and over every token (not only those the writer keeps):
  per-expert token counts [M, E], each layer's mean hidden state (mean of `a`) [M, D], and the inter-layer
  similarity profile [M] (entry l: mean over tokens of cosine(a_l, a_{l-1}); entry 0 copies entry 1, the
  definition of `phaseper.groups.layer_similarity`). `write_stats` saves them as `layer_stats.json` (atomically,
  sealed with a checksum: `integrity`); `read_stats(directory)` reads it back, checked.

Letters: B batch, T tokens per sequence, N flattened tokens, D hidden, K top-k, E routed experts,
M MoE layers, P prompts.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pdscope_jax.artifacts import integrity
from pdscope_jax.phaseper.traces import PHASES, TraceError, TraceWriter

STATS_FILE = "layer_stats.json"
STATS_REMEDY = "collect the traces again (`pdscope-jax collect-traces`), which writes it"


class Walk(NamedTuple):
    logits: jax.Array  # [B, T, V] float32
    cache: tuple | None
    a: jax.Array  # [M, N, D]
    weights: jax.Array  # [M, N, K] float32
    experts: jax.Array  # [M, N, K] int32


def moe_layers(model) -> list[int]:
    """Decoder-layer indices of the MoE layers, in order."""
    return [i for i, layer in enumerate(model.layers) if layer.is_moe]


def walk(model, input_ids: jax.Array, positions: jax.Array, cache=None) -> Walk:
    x = model.embed(input_ids)  # [B, T, D]
    b, t, d = x.shape
    new_cache, a, weights, experts = [], [], [], []
    for i, layer in enumerate(model.layers):
        x, layer_cache = layer.attend(x, positions, None if cache is None else cache[i])
        new_cache.append(layer_cache)
        h = layer.mlp_input(x)
        if not layer.is_moe:
            x = x + layer.mlp(h)
            continue
        hn = h.reshape(b * t, d)  # [N, D]
        w, e = layer.mlp.route(hn)
        out = layer.mlp.routed_output(hn, w, e) + layer.mlp.shared_output(hn)
        x = x + out.reshape(b, t, d)
        a.append(hn)
        weights.append(w)
        experts.append(e)
    return Walk(model.logits(x), None if cache is None else tuple(new_cache),
                jnp.stack(a), jnp.stack(weights), jnp.stack(experts))


def _layer_sums(a: jax.Array) -> tuple[jax.Array, jax.Array]:
    """a [M, N, D] -> (sum over tokens of a [M, D] f32, sum over tokens of cosine(a_l, a_{l-1}) [M] f32)."""
    a32 = a.astype(jnp.float32)
    unit = a32 / jnp.maximum(jnp.linalg.norm(a32, axis=-1, keepdims=True), 1e-12)
    cos = jnp.sum(unit[1:] * unit[:-1], axis=-1).sum(axis=-1)  # [M-1]
    return a32.sum(axis=1), jnp.concatenate([cos[:1], cos])


def _step(graphdef, state, input_ids, positions, cache):
    """One jitted forward: last-position logits, the cache, the records and their running sums."""
    model = nnx.merge(graphdef, state)
    out = walk(model, input_ids, positions, cache)
    a_sum, cos_sum = _layer_sums(out.a)
    return out.logits[:, -1], out.cache, out.a, out.weights, out.experts, a_sum, cos_sum


_jit_step = jax.jit(_step, static_argnums=0, donate_argnums=4)


@dataclasses.dataclass
class PhaseStats:
    counts: np.ndarray  # [M, E] int64, tokens routed to each expert (a token counts once per chosen expert)
    a_sum: np.ndarray  # [M, D] float64
    cos_sum: np.ndarray  # [M] float64
    tokens: int = 0
    forwards: int = 0

    @classmethod
    def empty(cls, m: int, e: int, d: int) -> "PhaseStats":
        return cls(np.zeros((m, e), np.int64), np.zeros((m, d), np.float64), np.zeros((m,), np.float64))

    def add(self, experts: np.ndarray, a_sum: np.ndarray, cos_sum: np.ndarray) -> None:
        m, n, _ = experts.shape
        for l in range(m):
            self.counts[l] += np.bincount(experts[l].reshape(-1), minlength=self.counts.shape[1])
        self.a_sum += a_sum
        self.cos_sum += cos_sum
        self.tokens += n
        self.forwards += 1

    def mean_hidden(self) -> np.ndarray:
        return self.a_sum / max(self.tokens, 1)  # [M, D]

    def similarity(self) -> np.ndarray:
        return self.cos_sum / max(self.tokens, 1)  # [M]


@dataclasses.dataclass
class CollectStats:
    layers: list[int]  # decoder-layer indices of the MoE layers
    phases: dict[str, PhaseStats]
    seconds: float = 0.0

    def to_json(self) -> dict:
        return {
            "layers": self.layers,
            "seconds": round(self.seconds, 3),
            "phases": {
                phase: {
                    "tokens": s.tokens,
                    "forwards": s.forwards,
                    "expert_counts": s.counts.tolist(),
                    "similarity": [round(float(v), 6) for v in s.similarity()],
                    "mean_hidden": np.round(s.mean_hidden(), 6).tolist(),
                }
                for phase, s in self.phases.items()
            },
        }


def write_stats(stats: CollectStats, directory: str | Path) -> Path:
    path = Path(directory) / STATS_FILE
    integrity.remove_stale(path)  # temporaries of a killed earlier save
    integrity.atomic_write_json(path, integrity.seal(stats.to_json()))
    return path


def read_stats(directory: str | Path) -> dict:
    """The `CollectStats.to_json` dict in `<directory>/layer_stats.json`; a missing, unreadable or corrupt file
    (seal mismatch) raises `TraceError` naming it. Files without a seal (older versions) are accepted."""
    path = Path(directory) / STATS_FILE
    stats = integrity.read_json(path, TraceError, STATS_REMEDY)
    integrity.check_seal(stats, TraceError, path, STATS_REMEDY, required=False)
    return stats


def collect_traces(model, prompts: np.ndarray, writer: TraceWriter, decode_steps: int,
                   batch_size: int, progress=None) -> CollectStats:
    """Prefill each batch of prompts [P, T], then greedy-decode `decode_steps` tokens; see the module docstring.

    A last batch smaller than `batch_size` is dropped, so every forward has one shape per phase and compiles
    once. `progress(done_batches, total_batches)` is called after each batch when given.
    """
    cfg = model.config
    layers = moe_layers(model)
    if list(writer.layers) != layers:
        raise ValueError(f"the writer's layers {list(writer.layers)} are not the model's MoE layers {layers}")
    prompts = np.asarray(prompts, np.int32)
    batches = len(prompts) // batch_size
    if batches == 0:
        raise ValueError(f"{len(prompts)} prompts make no batch of {batch_size}")
    t = prompts.shape[1]
    graphdef, state = nnx.split(model)
    dtype = model.embed.embedding[...].dtype
    stats = CollectStats(layers, {p: PhaseStats.empty(len(layers), cfg.num_experts, cfg.hidden_size)
                                  for p in PHASES})
    start = time.perf_counter()

    def record(phase: str, outputs) -> None:
        a, w, e, a_sum, cos_sum = jax.device_get(outputs)
        for pos, layer in enumerate(layers):
            writer.add(phase, layer, a[pos], w[pos], e[pos])
        stats.phases[phase].add(e, a_sum, cos_sum)

    for i in range(batches):
        ids = jnp.asarray(prompts[i * batch_size:(i + 1) * batch_size])  # [B, T]
        positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), ids.shape)
        cache = model.init_cache(batch_size, t + decode_steps, dtype)
        last, cache, *outputs = _jit_step(graphdef, state, ids, positions, cache)
        record("prefill", outputs)
        for step in range(decode_steps):
            token = jnp.argmax(last, axis=-1).astype(jnp.int32)[:, None]  # [B, 1] greedy
            pos = jnp.full((batch_size, 1), t + step, jnp.int32)
            last, cache, *outputs = _jit_step(graphdef, state, token, pos, cache)
            record("decode", outputs)
        if progress is not None:
            progress(i + 1, batches)
    stats.seconds = time.perf_counter() - start
    return stats
