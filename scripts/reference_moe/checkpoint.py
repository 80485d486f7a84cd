"""What is done with the trained weights: Hugging Face export, and the checks and report on what was saved.

- `hf_tensors` / `write_safetensors` / `export`: the float32 flat state -> bf16 tensors under the hub keys (the
  inverse of the family's `checkpoint_sources`), sharded with an index above a size limit, with config.json
  and tokenizer.json, into one directory.
- `reload_check`: `pdscope_jax.load` of that directory must give the logits of the in-memory model with its
  weights rounded to bf16, within `RELOAD_TOLERANCE`.
- `routed_experts` / `routing_stats`: expert popularity, its skew and inter-layer affinity on held-out text.
- `generations`: greedy and sampled continuations through the public Runner; `plot`: loss curve and routing.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx
from safetensors.numpy import save_file
from tokenizers import Tokenizer

import pdscope_jax
from pdscope_jax import models
from pdscope_jax.config import ModelConfig
from pdscope_jax.phaseper.collect import walk

RELOAD_TOLERANCE = 2e-3

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
    """Writes the bf16 checkpoint, config.json and tokenizer.json into `out_dir`; returns what was written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = hf_tensors(cfg, flat)
    files = write_safetensors(out_dir, tensors, max_shard_bytes)
    (out_dir / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    tok.save(str(out_dir / "tokenizer.json"))
    return {"dir": str(out_dir), "tensors": len(tensors), "files": [f.name for f in files],
            "safetensors_bytes": sum(f.stat().st_size for f in files),
            "tokenizer_bytes": (out_dir / "tokenizer.json").stat().st_size}


def bf16_round(flat: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """float32 copies of `flat` rounded to bf16: the values a bf16 checkpoint holds."""
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
