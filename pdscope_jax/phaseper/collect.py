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
  definition of `phaseper.groups.layer_similarity`). `write_stats` saves them as `layer_stats.json`.
- `collect_traces_main(argv)`: the `pdscope-jax collect-traces` command: a model (preset with random
  weights, or a checkpoint directory), prompts cut from a `pdscope_jax.text.corpus` split with the model's
  tokenizer, traces written into `--out`.

Letters: B batch, T tokens per sequence, N flattened tokens, D hidden, K top-k, E routed experts,
M MoE layers, P prompts.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import tokenizers
from flax import nnx

from pdscope_jax.text import corpus
from pdscope_jax.phaseper.traces import PHASES, TraceWriter


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
    path = Path(directory) / "layer_stats.json"
    path.write_text(json.dumps(stats.to_json()))
    return path


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


# ---- command line -----------------------------------------------------------------------------------------
def _encoder(runner, vocab_size: int):
    """The checkpoint's tokenizer, or UTF-8 bytes (mod vocab) for a model without one (random weights)."""
    if runner.tokenizer is not None:
        return corpus.tokenizer_encoder(tokenizers.Tokenizer.from_file(str(runner.tokenizer.path))), "tokenizer.json"
    return (lambda texts: [np.frombuffer(t.encode(), np.uint8).astype(np.int32) % vocab_size for t in texts],
            "utf-8 bytes")


def collect_traces_main(argv: list[str] | None = None) -> int:
    """`pdscope-jax collect-traces`: see the module docstring; prints a summary and returns 0."""
    import pdscope_jax

    p = argparse.ArgumentParser(prog="pdscope-jax collect-traces",
                                description="Record PhasePer routing traces (prefill and decode kept apart).")
    p.add_argument("--model", required=True, help="preset name or checkpoint directory")
    p.add_argument("--weights", help="'random', or a safetensors directory for a preset (see pdscope_jax.load)")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32", "float16"))
    p.add_argument("--out", type=Path, required=True, help="new trace directory")
    p.add_argument("--split", default="train", choices=("train", "heldout", "ood"),
                   help="corpus split the prompts are cut from (pdscope_jax.text.corpus)")
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--decode-steps", type=int, default=32)
    p.add_argument("--batch", type=int, default=8, help="prompts per forward")
    p.add_argument("--max-prefill-tokens", type=int, default=65536, help="prefill tokens kept per layer")
    p.add_argument("--max-decode-tokens", type=int, default=16384, help="decode tokens kept per layer")
    p.add_argument("--seed", type=int, default=0, help="corpus split and prompt offsets")
    args = p.parse_args(argv)

    runner = pdscope_jax.load(args.model, weights=args.weights, seed=args.seed, dtype=args.dtype)
    model, cfg = runner.model, runner.config
    encode, encoding = _encoder(runner, cfg.vocab_size)
    data = corpus.load_corpus(seed=args.seed)
    docs = {"train": data.train, "heldout": data.heldout, "ood": data.ood}[args.split]
    if not docs:
        raise SystemExit(f"the {args.split!r} split is empty on this machine (out-of-domain source: {data.ood_source})")
    eos = cfg.eos_token_id if cfg.eos_token_id is not None and cfg.eos_token_id < cfg.vocab_size else 0
    stream = corpus.token_stream(encode, docs, eos)
    prompts = corpus.sample_windows(stream, args.prompt_len, args.prompts, np.random.default_rng(args.seed))
    source = data.ood_source if args.split == "ood" else "stdlib"
    description = (f"{args.model} ({args.dtype}), split {args.split} ({source}), {args.prompts} prompts x "
                   f"{args.prompt_len} tokens ({encoding}), {args.decode_steps} greedy decode steps, "
                   f"batch {args.batch}, seed {args.seed}")
    writer = TraceWriter(args.out, cfg.fingerprint(), moe_layers(model), cfg.hidden_size, cfg.num_experts_per_tok,
                         cfg.num_experts, description=description,
                         max_tokens={"prefill": args.max_prefill_tokens, "decode": args.max_decode_tokens})
    with writer:
        stats = collect_traces(model, prompts, writer, args.decode_steps, args.batch,
                               progress=lambda done, total: print(f"batch {done}/{total}", flush=True))
    write_stats(stats, args.out)
    summary = {phase: {"tokens": s.tokens, "forwards": s.forwards} for phase, s in stats.phases.items()}
    print(json.dumps({"out": str(args.out), "description": description, "seconds": round(stats.seconds, 2),
                      **summary}))
    return 0
