"""Train the project's reference MoE: a small DeepSeek-V2 (MLA, shared + routed experts) on Python source.

Run from the repository root, with the package importable (`pip install -e .` or `PYTHONPATH=.`):
    python scripts/train_reference_moe.py                      # the reference (sized for one GPU)
    python scripts/train_reference_moe.py --smoke [--out DIR]  # tiny model, 20 steps, CPU-sized (CI)
In order:
1. Corpus (`pdscope_jax.text.corpus`): the interpreter's stdlib `.py` files split 95/5 by path hash into train /
   held-out, plus out-of-domain text (the first source found; recorded); a byte-level BPE `tokenizer.json`
   trained on the train split, `<|endoftext|>` (id 0) ending every document and serving as bos/eos.
2. The model: `pdscope_jax.models.build` on `ModelConfig.from_hf(REFERENCE_CONFIG)` (`SMOKE_CONFIG` with --smoke).
3. Training: float32 master weights, forward and backward in `--compute-dtype`, AdamW (`make_optimizer`),
   linear warm-up then cosine decay to 10% (`lr_at`) over `--epochs` passes of the train split (more passes
   memorise the stdlib: held-out loss rises), capped by `--steps` and `--max-seconds` (the horizon is re-fixed
   after timing the first steps so the schedule ends where the budget does). Loss: next-token cross-entropy
   plus `--balance-coef` times the expert balance loss (`balance_loss`), kept small so that routing stays
   learned and skewed. Train / held-out / out-of-domain losses every `--eval-every` steps.
4. Export in the Hugging Face layout into `--out` (default pdscope_jax/assets/reference-moe/): config.json,
   bf16 safetensors under the hub keys (`hf_tensors`, sharded above `--max-shard-mb`: `write_safetensors`),
   tokenizer.json.
5. Checks: `pdscope_jax.load(out)` must give the logits of the trained model with its weights rounded to bf16
   (`reload_check`, tolerance `RELOAD_TOLERANCE`); then routing statistics on held-out text (`routing_stats`).
Writes `--results-dir`/reference_moe_training.json (everything above, the loss curve, timings, the command,
greedy and sampled generations) and reference_moe_training.png; exit status 1 when the reload check fails.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
from flax import nnx
from safetensors.numpy import save_file
from tokenizers import Tokenizer, decoders, models as bpe_models, pre_tokenizers, trainers

import pdscope_jax
from pdscope_jax import models
from pdscope_jax.text import corpus
from pdscope_jax.config import ModelConfig
from pdscope_jax.models.layers import router_logits
from pdscope_jax.phaseper.collect import walk

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = Path(pdscope_jax.__file__).resolve().parent / "assets" / "reference-moe"
DEFAULT_RESULTS = REPO / "benchmarks" / "results"
EOS = "<|endoftext|>"
RELOAD_TOLERANCE = 2e-3
PROMPTS = ("def ", "import os\n", "class ", "for i in range(")

# The Hugging Face config.json of the reference model (DeepSeek-V2 layout and field names).
REFERENCE_CONFIG = {
    "architectures": ["DeepseekV2ForCausalLM"],
    "model_type": "deepseek_v2",
    "vocab_size": 8192,
    "hidden_size": 160,
    "intermediate_size": 512,
    "moe_intermediate_size": 64,
    "num_hidden_layers": 13,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "n_routed_experts": 32,
    "n_shared_experts": 2,
    "num_experts_per_tok": 4,
    "topk_method": "greedy",
    "scoring_func": "softmax",
    "norm_topk_prob": False,
    "routed_scaling_factor": 1.0,
    "n_group": 1,
    "topk_group": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": None,
    "kv_lora_rank": 64,
    "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 16,
    "v_head_dim": 32,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "rope_scaling": None,
    "max_position_embeddings": 2048,
    "attention_bias": False,
    "tie_word_embeddings": False,
    "bos_token_id": 0,
    "eos_token_id": 0,
    "torch_dtype": "bfloat16",
}
# --smoke: every feature of the reference at toy size (the trace writer needs >= 2 MoE layers).
SMOKE_CONFIG = {
    **REFERENCE_CONFIG,
    "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32,
    "num_hidden_layers": 3, "n_routed_experts": 8, "n_shared_experts": 1, "num_experts_per_tok": 2,
    "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny model, 20 steps, small corpus subset, tmp output")
    p.add_argument("--out", type=Path, help=f"checkpoint directory (default {DEFAULT_OUT}; --smoke: a tmp dir)")
    p.add_argument("--results-dir", type=Path, help=f"JSON + PNG directory (default {DEFAULT_RESULTS}; --smoke: --out)")
    p.add_argument("--max-seconds", type=float, default=300.0, help="wall-time budget of the training loop")
    p.add_argument("--epochs", type=float, default=6.0,
                   help="passes over the train split (the schedule's length unless --steps or the time cap is shorter)")
    p.add_argument("--steps", type=int, default=20000, help="cap on optimizer steps")
    p.add_argument("--batch", type=int, default=64, help="sequences per step")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--lr", type=float, default=2e-3, help="peak learning rate")
    p.add_argument("--warmup", type=int, default=100, help="warm-up steps")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--balance-coef", type=float, default=1e-3, help="weight of the expert balance loss")
    p.add_argument("--compute-dtype", choices=("bfloat16", "float32"), default="bfloat16")
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--eval-windows", type=int, default=256, help="held-out / out-of-domain windows per eval")
    p.add_argument("--stats-windows", type=int, default=512, help="held-out windows for routing statistics")
    p.add_argument("--max-shard-mb", type=float, default=12.0,
                   help="largest safetensors file; bigger checkpoints are sharded with an index (default 12 MB, "
                        "so each file stays under a 16 MiB transfer limit)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.smoke:
        for name, value in dict(steps=20, batch=8, seq_len=64, warmup=5, eval_every=10, eval_windows=8,
                                stats_windows=16, lr=3e-3).items():
            if getattr(args, name) == p.get_default(name):
                setattr(args, name, value)
        if args.out is None:
            args.out = Path(tempfile.mkdtemp(prefix="reference-moe-smoke-"))
    args.out = args.out or DEFAULT_OUT
    args.results_dir = args.results_dir or (args.out if args.smoke else DEFAULT_RESULTS)
    return args


# ---- tokenizer and data -----------------------------------------------------------------------------------
def train_tokenizer(docs: list[corpus.Document], vocab_size: int) -> Tokenizer:
    tok = Tokenizer(bpe_models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], min_frequency=2,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([d.text for d in docs], trainer)
    return tok


def eval_batches(stream: np.ndarray, length: int, windows: int, batch: int) -> np.ndarray:
    """Consecutive windows [count, batch, length]; at least one batch (short texts repeat their windows)."""
    w = corpus.chunk_windows(stream, length, windows)
    if len(w) < batch:
        w = np.resize(w, (batch, length))
    count = len(w) // batch
    return w[: count * batch].reshape(count, batch, length)


# ---- model, loss, step ------------------------------------------------------------------------------------
def param_count(state) -> int:
    return int(sum(np.prod(x.shape) for x in jax.tree.leaves(state)))


def init_params(cfg: ModelConfig, seed: int):
    """(graphdef, float32 state) of the family's own initialisation, run as one compiled program."""
    graphdef, _ = nnx.split(models.abstract_model(cfg, jnp.float32))
    state = jax.jit(lambda: nnx.state(models.build(cfg, nnx.Rngs(seed), jnp.float32)))()
    return graphdef, state


def balance_loss(model, walked, num_experts: int) -> jax.Array:
    """Mean over MoE layers of E * sum_i f_i * P_i (1 when routing is uniform).

    f_i: fraction of the N*K top-k assignments that went to expert i (no gradient); P_i: mean over tokens of
    the router's softmax probability of i, recomputed from the router input `a` and the router kernel.
    """
    layers = [layer for layer in model.layers if layer.is_moe]
    m, n, k = walked.experts.shape
    total = 0.0
    for pos, layer in enumerate(layers):
        probs = jax.nn.softmax(router_logits(walked.a[pos], layer.mlp.gate.kernel[...]), axis=-1)  # [N, E]
        f = jnp.zeros((num_experts,), jnp.float32).at[walked.experts[pos].reshape(-1)].add(1.0) / (n * k)
        total = total + num_experts * jnp.sum(jax.lax.stop_gradient(f) * probs.mean(axis=0))
    return total / m


def make_fns(graphdef, cast, tx, balance_coef: float, num_experts: int):
    """Jitted train step and eval loss over (params, ...) with the graphdef closed over."""

    def losses(params, batch):
        model = nnx.merge(graphdef, cast(params))
        ids, targets = batch[:, :-1], batch[:, 1:]
        positions = jnp.broadcast_to(jnp.arange(ids.shape[1], dtype=jnp.int32), ids.shape)
        walked = walk(model, ids, positions)
        ce = optax.softmax_cross_entropy_with_integer_labels(walked.logits, targets).mean()
        return ce, balance_loss(model, walked, num_experts)

    def objective(params, batch):
        ce, bal = losses(params, batch)
        return ce + balance_coef * bal, (ce, bal)

    def train_step(params, opt_state, batch, lr):
        (_, (ce, bal)), grads = jax.value_and_grad(objective, has_aux=True)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, jax.tree.map(lambda u: -lr * u, updates))
        grad_norm = jnp.sqrt(sum(jnp.sum(jnp.square(g.astype(jnp.float32))) for g in jax.tree.leaves(grads)))
        return params, opt_state, jnp.stack([ce, bal, grad_norm])

    def eval_loss(params, batch):
        return losses(params, batch)[0]

    return jax.jit(train_step, donate_argnums=(0, 1)), jax.jit(eval_loss)


def make_optimizer(weight_decay: float) -> optax.GradientTransformation:
    """AdamW without its learning rate: the step multiplies by -lr (decoupled decay scales with lr too)."""

    def decay_mask(params):  # matrices only; norms' scales keep their value
        return jax.tree.map(lambda x: x.ndim >= 2, params)

    return optax.chain(optax.clip_by_global_norm(1.0), optax.scale_by_adam(b1=0.9, b2=0.95, eps=1e-8),
                       optax.add_decayed_weights(weight_decay, decay_mask))


def lr_at(step: int, peak: float, warmup: int, horizon: int) -> float:
    """Linear warm-up to `peak` over `warmup` steps, then cosine decay to peak / 10 at `horizon`."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, horizon - warmup))
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


# ---- export -----------------------------------------------------------------------------------------------
def hf_tensors(cfg: ModelConfig, flat: dict[str, np.ndarray], dtype=ml_dtypes.bfloat16) -> dict[str, np.ndarray]:
    """The inverse of the family's `checkpoint_sources`: hub keys -> [out, in] tensors in `dtype`."""
    sources = models.checkpoint_sources(cfg)
    if set(sources) != set(flat):
        raise ValueError(f"checkpoint_sources and the model disagree: "
                         f"{sorted(set(sources) ^ set(flat))[:10]}")
    out: dict[str, np.ndarray] = {}
    for path, source in sources.items():
        value = np.asarray(flat[path], np.float32)
        groups = list(value) if source.stacked else [value]
        if len(groups) != len(source.keys):
            raise ValueError(f"{path}: {len(groups)} stacked entries for {len(source.keys)} key groups")
        for keys, part in zip(source.keys, groups):
            if part.shape[-1] % len(keys):
                raise ValueError(f"{path}: last axis {part.shape[-1]} does not split into {len(keys)} tensors")
            for key, piece in zip(keys, np.split(part, len(keys), axis=-1)):
                if key in out:
                    raise ValueError(f"hub key {key} is produced twice")
                out[key] = np.ascontiguousarray(piece.T if source.transpose else piece).astype(dtype)
    return out


def write_safetensors(out_dir: Path, tensors: dict[str, np.ndarray], max_shard_bytes: int) -> list[Path]:
    """model.safetensors, or model-0000i-of-0000n.safetensors + model.safetensors.index.json when the tensors
    exceed `max_shard_bytes` (filled in key order). Earlier model*.safetensors* files in `out_dir` are removed
    first, so the loader never sees a stale single file beside a new index."""
    for old in out_dir.glob("model*.safetensors*"):
        old.unlink()
    shards, current, size = [], {}, 0
    for key, value in tensors.items():
        if current and size + value.nbytes > max_shard_bytes:
            shards.append(current)
            current, size = {}, 0
        current[key] = value
        size += value.nbytes
    shards.append(current)
    if len(shards) == 1:
        names = ["model.safetensors"]
    else:
        names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
        index = {"metadata": {"total_size": int(sum(v.nbytes for v in tensors.values()))},
                 "weight_map": {key: name for name, shard in zip(names, shards) for key in shard}}
        (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=1) + "\n")
    for name, shard in zip(names, shards):
        save_file(shard, str(out_dir / name), metadata={"format": "pt"})
    return [out_dir / name for name in names]


def export(out_dir: Path, hf_config: dict, cfg: ModelConfig, flat: dict[str, np.ndarray], tok: Tokenizer,
           max_shard_bytes: int) -> dict:
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = hf_tensors(cfg, flat)
    files = write_safetensors(out_dir, tensors, max_shard_bytes)
    (out_dir / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    tok.save(str(out_dir / "tokenizer.json"))
    return {"dir": str(out_dir), "tensors": len(tensors), "files": [f.name for f in files],
            "safetensors_bytes": sum(f.stat().st_size for f in files),
            "tokenizer_bytes": (out_dir / "tokenizer.json").stat().st_size}


def bf16_round(flat: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {k: np.asarray(v, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32) for k, v in flat.items()}


def model_from(cfg: ModelConfig, flat: dict[str, np.ndarray]):
    """A float32 model holding exactly `flat`."""
    return models.from_flat(cfg, jnp.float32, {k: jnp.asarray(v, jnp.float32) for k, v in flat.items()})


def reload_check(out_dir: Path, cfg: ModelConfig, flat: dict[str, np.ndarray], ids: np.ndarray) -> dict:
    """Logits of `pdscope_jax.load(out_dir)` against the in-memory weights (bf16-rounded and unrounded).

    Runs at "highest" matmul precision: GPUs otherwise multiply float32 in TF32, and two separately compiled
    programs of the same model then differ by far more than a weights mismatch would.
    """
    with jax.default_matmul_precision("highest"):
        return _reload_check(out_dir, cfg, flat, ids)


def _reload_check(out_dir: Path, cfg: ModelConfig, flat: dict[str, np.ndarray], ids: np.ndarray) -> dict:
    loaded = pdscope_jax.load(str(out_dir), dtype="float32")
    got = np.asarray(loaded.logits(ids), np.float32)
    positions = jnp.broadcast_to(jnp.arange(ids.shape[1], dtype=jnp.int32), ids.shape)
    forward = jax.jit(lambda graphdef, state: nnx.merge(graphdef, state)(jnp.asarray(ids), positions)[0],
                      static_argnums=0)
    want = np.asarray(forward(*nnx.split(model_from(cfg, bf16_round(flat)))))
    raw = np.asarray(forward(*nnx.split(model_from(cfg, flat))))
    diff = float(np.abs(got - want).max())
    return {
        "max_abs_diff_vs_bf16_weights": diff,
        "tolerance": RELOAD_TOLERANCE,
        "ok": bool(diff <= RELOAD_TOLERANCE),
        "max_abs_diff_vs_f32_weights": float(np.abs(got - raw).max()),
        "top1_agreement_vs_f32_weights": float((got.argmax(-1) == raw.argmax(-1)).mean()),
        "logit_scale": float(np.abs(raw).max()),
        "loaded": loaded,
    }


# ---- routing statistics -----------------------------------------------------------------------------------
def routed_experts(graphdef, state, windows: np.ndarray, batch: int) -> np.ndarray:
    """Selected experts of every MoE layer for every token of `windows` [W, T]: [M, W*T, K] int32."""

    @jax.jit
    def experts_of(state, ids):
        positions = jnp.broadcast_to(jnp.arange(ids.shape[1], dtype=jnp.int32), ids.shape)
        return walk(nnx.merge(graphdef, state), ids, positions).experts

    parts = [np.asarray(experts_of(state, jnp.asarray(windows[i:i + batch])))
             for i in range(0, len(windows) - batch + 1, batch)]
    return np.concatenate(parts, axis=1)


def multi_hot(e: np.ndarray, num_experts: int) -> np.ndarray:
    """[N, K] ids -> [N, E] float32 with a 1 per chosen expert."""
    out = np.zeros((e.shape[0], num_experts), np.float32)
    np.put_along_axis(out, e, 1.0, axis=1)
    return out


def routing_stats(experts: np.ndarray, num_experts: int) -> dict:
    """Routing statistics of experts [M, N, K]: per-layer expert popularity and its skew, the inter-layer affinity
    P(expert j at layer l+1 | expert i at layer l), and how well that table alone predicts the next layer's
    experts (recall@K), against always guessing the K most popular experts.

    The affinity table is estimated on the first half of the tokens and its recall@K measured on the second.
    """
    m, n, k = experts.shape
    counts = np.stack([np.bincount(experts[l].reshape(-1), minlength=num_experts) for l in range(m)])  # [M, E]
    share = counts / counts.sum(axis=1, keepdims=True)  # [M, E]
    sorted_share = -np.sort(-share, axis=1)
    entropy = -(share * np.log(np.maximum(share, 1e-12))).sum(1) / math.log(num_experts)
    top_quarter = sorted_share[:, : max(1, num_experts // 4)].sum(1)
    half = n // 2
    affinity, recall, baseline = [], [], []
    for l in range(m - 1):
        cur, nxt = multi_hot(experts[l], num_experts), multi_hot(experts[l + 1], num_experts)
        joint = cur[:half].T @ nxt[:half]  # [E, E] co-activations
        cond = joint / np.maximum(cur[:half].sum(0)[:, None], 1.0)  # P(j at l+1 | i at l)
        affinity.append(cond)
        scores = cur[half:] @ cond  # [N/2, E]: summed conditionals of the token's experts
        guess = np.argsort(-scores, axis=1)[:, :k]
        recall.append(float(np.take_along_axis(nxt[half:], guess, axis=1).sum(1).mean() / k))
        popular = np.argsort(-nxt[:half].sum(0))[:k]
        baseline.append(float(nxt[half:, popular].sum(1).mean() / k))
    return {
        "tokens": int(n),
        "counts": counts.tolist(),
        "normalized_entropy": np.round(entropy, 4).tolist(),
        "top_quarter_share": np.round(top_quarter, 4).tolist(),
        "max_over_uniform": np.round(sorted_share[:, 0] * num_experts, 3).tolist(),
        "min_over_uniform": np.round(sorted_share[:, -1] * num_experts, 3).tolist(),
        "unused_experts": int((counts == 0).sum()),
        "mean_normalized_entropy": round(float(entropy.mean()), 4),
        "mean_top_quarter_share": round(float(top_quarter.mean()), 4),
        "affinity_recall_at_k": [round(r, 4) for r in recall],
        "popularity_recall_at_k": [round(r, 4) for r in baseline],
        "mean_affinity_recall_at_k": round(float(np.mean(recall)), 4) if recall else None,
        "mean_popularity_recall_at_k": round(float(np.mean(baseline)), 4) if baseline else None,
        "affinity": [np.round(c, 4).tolist() for c in affinity],
    }


def plot(path: Path, log: list[dict], stats: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(17, 4.6))
    steps = [r["step"] for r in log]
    for key, label in (("train_loss", "train"), ("heldout_loss", "held-out"), ("ood_loss", "out-of-domain")):
        pts = [(s, r[key]) for s, r in zip(steps, log) if r.get(key) is not None]
        if pts:
            axes[0].plot(*zip(*pts), marker=".", label=label)
    axes[0].set(xlabel="step", ylabel="cross-entropy (nats/token)", title="loss")
    axes[0].legend()
    counts = np.asarray(stats["counts"], np.float64)
    rel = counts / counts.sum(1, keepdims=True) * counts.shape[1]
    im = axes[1].imshow(rel, aspect="auto", cmap="magma")
    axes[1].set(xlabel="expert", ylabel="MoE layer", title="expert popularity (x uniform), held-out")
    fig.colorbar(im, ax=axes[1])
    if stats["affinity"]:
        mid = len(stats["affinity"]) // 2
        im = axes[2].imshow(np.asarray(stats["affinity"][mid]), aspect="auto", cmap="viridis")
        axes[2].set(xlabel=f"expert j at MoE layer {mid + 1}", ylabel=f"expert i at MoE layer {mid}",
                    title="affinity P(j | i)")
        fig.colorbar(im, ax=axes[2])
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def generations(loaded: pdscope_jax.Runner, prompts: tuple[str, ...], max_new_tokens: int,
                seed: int) -> list[dict]:
    """Greedy and sampled (temperature 0.8, top-50) continuations of each prompt, through the public Runner."""
    out = []
    for prompt in prompts:
        for mode, temperature in (("greedy", 0.0), ("sampled", 0.8)):
            result = loaded.generate(prompt, max_new_tokens=max_new_tokens, temperature=temperature,
                                     top_k=None if temperature == 0.0 else 50, seed=seed)
            out.append({"prompt": prompt, "mode": mode, "text": prompt + result.text[0]})
    return out


# ---- main -------------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t_start = time.perf_counter()
    timings, t_mark = {}, [t_start]

    def mark(name: str) -> None:  # wall seconds of each stage, for the results
        now = time.perf_counter()
        timings[name] = round(now - t_mark[0], 1)
        t_mark[0] = now

    hf_config = SMOKE_CONFIG if args.smoke else REFERENCE_CONFIG
    cfg = ModelConfig.from_hf(hf_config, name="reference-moe")
    print(f"jax {jax.__version__} on {jax.devices()[0].platform} ({jax.devices()[0].device_kind}); "
          f"python {platform.python_version()}", flush=True)

    data = corpus.load_corpus(heldout_fraction=0.05, seed=args.seed, max_files=40 if args.smoke else None)
    print(f"corpus: {data.summary()} (out-of-domain source: {data.ood_source})", flush=True)
    tok = train_tokenizer(data.train, cfg.vocab_size)
    eos = tok.token_to_id(EOS)
    streams = {name: corpus.token_stream(corpus.tokenizer_encoder(tok), docs, eos)
               for name, docs in (("train", data.train), ("heldout", data.heldout), ("ood", data.ood))}
    length = args.seq_len + 1
    evals = {name: eval_batches(streams[name], length, args.eval_windows, args.batch) for name in ("heldout", "ood")
             if len(streams[name]) >= length}
    print("tokens: " + ", ".join(f"{k} {len(v):,}" for k, v in streams.items()), flush=True)
    mark("data_and_tokenizer")

    master_graphdef, params = init_params(cfg, args.seed)
    compute = jnp.dtype(args.compute_dtype)
    graphdef, abstract = nnx.split(models.abstract_model(cfg, compute))
    dtypes = jax.tree.map(lambda x: x.dtype, abstract)

    def cast(p):  # float32 master weights -> the compute model's dtypes (routers stay float32)
        return jax.tree.map(lambda x, d: x.astype(d), p, dtypes)

    n_params = param_count(params)
    print(f"model: {n_params:,} parameters ({n_params * 2 / 1e6:.1f} MB in bf16), "
          f"{len(cfg.moe_layers)} MoE layers x {cfg.num_experts} experts, top-{cfg.num_experts_per_tok}", flush=True)

    tx = make_optimizer(args.weight_decay)
    opt_state = tx.init(params)
    train_step, eval_loss = make_fns(graphdef, cast, tx, args.balance_coef, cfg.num_experts)
    rng = np.random.default_rng(args.seed)

    def evaluate(params) -> dict:
        return {f"{name}_loss": float(np.mean([eval_loss(params, jnp.asarray(b)) for b in batches]))
                for name, batches in evals.items()}

    log, pending = [], []
    t_loop = time.perf_counter()
    deadline = t_loop + args.max_seconds
    epoch_steps = len(streams["train"]) / (args.batch * args.seq_len)
    horizon = max(1, min(args.steps, math.ceil(args.epochs * epoch_steps)))
    step_seconds, calibrate_at = None, min(horizon, 40)
    step, t_calib = 0, None
    log.append({"step": 0, "seconds": 0.0, "train_loss": None, **evaluate(params)})  # compiles the eval
    while step < horizon:
        if step == 3:  # the first steps compile; time from here
            jax.block_until_ready(params)
            t_calib = time.perf_counter()
        if step == calibrate_at and step > 3:
            jax.block_until_ready(params)
            step_seconds = (time.perf_counter() - t_calib) / (step - 3)
            t_eval = time.perf_counter()
            evaluate(params)
            per_step = step_seconds + (time.perf_counter() - t_eval) / args.eval_every
            horizon = min(horizon, step + int(0.97 * (deadline - time.perf_counter()) / per_step))
            print(f"step time {step_seconds * 1e3:.1f} ms; training for {horizon} steps", flush=True)
        lr = lr_at(step, args.lr, args.warmup, horizon)
        batch = corpus.sample_windows(streams["train"], length, args.batch, rng)
        params, opt_state, metrics = train_step(params, opt_state, jnp.asarray(batch), jnp.float32(lr))
        pending.append(metrics)
        if len(pending) >= 2:  # at most two steps in flight, so the wall clock tracks the device
            pending[-2].block_until_ready()
        step += 1
        if step % args.eval_every == 0 or step == horizon or time.perf_counter() > deadline:
            m = np.asarray(jax.device_get(pending))  # [S, 3]: ce, balance, grad norm
            pending = []
            t_eval = time.perf_counter()
            row = {"step": step, "seconds": round(t_eval - t_loop, 2), "lr": lr,
                   "train_loss": float(m[:, 0].mean()), "balance_loss": float(m[:, 1].mean()),
                   "grad_norm": float(m[:, 2].mean()), **evaluate(params)}
            row["eval_seconds"] = round(time.perf_counter() - t_eval, 3)
            log.append(row)
            print(f"step {step:5d} {row['seconds']:7.1f}s lr {lr:.2e} train {row['train_loss']:.3f} "
                  f"balance {row['balance_loss']:.3f} " + " ".join(
                      f"{k[:-5]} {v:.3f}" for k, v in row.items() if k in ("heldout_loss", "ood_loss")), flush=True)
            if time.perf_counter() > deadline:
                break
    jax.block_until_ready(params)
    train_seconds = time.perf_counter() - t_loop
    mark("init_and_train")
    if step_seconds is None and t_calib is not None and step > 3:  # too few steps to calibrate (--smoke)
        step_seconds = (train_seconds - (t_calib - t_loop)) / (step - 3)

    flat = {k: np.asarray(v, np.float32) for k, v in models.to_flat(nnx.merge(master_graphdef, params)).items()}
    exported = export(args.out, hf_config, cfg, flat, tok, int(args.max_shard_mb * 1e6))
    print(f"saved {exported}", flush=True)
    mark("export")

    check_ids = evals["heldout"][0][:2, : args.seq_len] if "heldout" in evals else \
        corpus.chunk_windows(streams["train"], args.seq_len, 2)
    reload = reload_check(args.out, cfg, flat, check_ids)
    loaded = reload.pop("loaded")
    print(f"reload: {reload}", flush=True)
    mark("reload_check")

    # The saved weights (bf16-rounded), computed in float32.
    stats_graphdef, stats_state = nnx.split(model_from(cfg, bf16_round(flat)))
    windows = corpus.chunk_windows(streams["heldout"], args.seq_len, args.stats_windows)
    stats = routing_stats(routed_experts(stats_graphdef, stats_state, windows, min(args.batch, len(windows))),
                          cfg.num_experts)
    print(f"routing on {stats['tokens']:,} held-out tokens: normalized entropy "
          f"{stats['mean_normalized_entropy']}, top-quarter share {stats['mean_top_quarter_share']}, unused "
          f"{stats['unused_experts']}, affinity recall@K {stats['mean_affinity_recall_at_k']} vs popularity "
          f"{stats['mean_popularity_recall_at_k']}", flush=True)
    mark("routing_stats")

    samples = generations(loaded, PROMPTS[:1] if args.smoke else PROMPTS, 16 if args.smoke else 48, args.seed)
    for s in samples:
        print(f"--- {s['mode']} {s['prompt']!r}\n{s['text']}", flush=True)
    mark("generations")

    steps_done = step
    results = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]) if argv is None else
        " ".join(["python", "scripts/train_reference_moe.py", *argv]),
        "smoke": args.smoke,
        "jax": jax.__version__, "python": platform.python_version(),
        "device": f"{jax.devices()[0].platform}: {jax.devices()[0].device_kind}",
        "hf_config": hf_config,
        "parameters": n_params,
        "corpus": {**data.summary(), "heldout_fraction": 0.05, "split_seed": args.seed,
                   "stdlib": str(corpus.stdlib_root())},
        "tokenizer": {"kind": "byte-level BPE (tokenizers)", "vocab_size": tok.get_vocab_size(), "eos": EOS,
                      "tokens": {k: int(len(v)) for k, v in streams.items()},
                      "chars_per_token_train": round(data.summary()["train_chars"] / max(1, len(streams["train"])), 3)},
        "training": {
            "steps": steps_done, "horizon": horizon, "batch": args.batch, "seq_len": args.seq_len,
            "tokens_seen": steps_done * args.batch * args.seq_len, "epochs_target": args.epochs,
            "epochs": round(steps_done * args.batch * args.seq_len / max(1, len(streams["train"])), 2),
            "lr": args.lr, "warmup": args.warmup, "weight_decay": args.weight_decay,
            "balance_coef": args.balance_coef, "compute_dtype": args.compute_dtype, "master_dtype": "float32",
            "step_ms": None if step_seconds is None else round(step_seconds * 1e3, 2),
            "tokens_per_second": None if step_seconds is None else round(args.batch * args.seq_len / step_seconds),
            "train_seconds": round(train_seconds, 1),
            "max_seconds": args.max_seconds,
        },
        "final": log[-1],
        "loss_curve": log,
        "export": exported,
        "reload": reload,
        "routing_heldout": stats,
        "generations": samples,
    }
    args.results_dir.mkdir(parents=True, exist_ok=True)
    results["timings"] = timings
    results["total_seconds"] = round(time.perf_counter() - t_start, 1)
    json_path = args.results_dir / "reference_moe_training.json"
    json_path.write_text(json.dumps(results, indent=1) + "\n")
    plot(args.results_dir / "reference_moe_training.png", log, stats)
    print(f"wrote {json_path} and reference_moe_training.png in {results['total_seconds']} s", flush=True)
    print(json.dumps({"train_loss": log[-1]["train_loss"], "heldout_loss": log[-1].get("heldout_loss"),
                      "ood_loss": log[-1].get("ood_loss"), "steps": steps_done, "reload_ok": reload["ok"],
                      "safetensors_bytes": exported["safetensors_bytes"]}))
    return 0 if reload["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
