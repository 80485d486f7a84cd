"""Check `export_gguf.py` against llama.cpp: the exported model's logits equal the project's on the tiny presets.

What: per family, export the tiny preset's bench weights (seeded random, `--workloads`), evaluate one prompt of
token ids with llama.cpp (`llama_logits`, built as in export_gguf.py's docstring) and with the project's plain
whole-model path (`Generator(model).logits`) on the same weights in float32, and compare every position's logits:
max |diff|, the median over positions of each position's max |diff| (robust to the odd position whose top-k
routing has a near tie that bf16 rounding flips), positions over 1e-2, max |logit| (the scale) and the share of
positions whose argmax agrees. For scale, the project's own bfloat16 model against its float32 one is reported
beside it (`project_bf16_vs_f32_*`). Random init attends almost uniformly, which hides RoPE mistakes: `--gains 8`
adds a stress variant whose q / k projections are 8x larger (same weights otherwise, on both sides; see `sharpen`),
where a wrong rotation raises the median by about two orders of magnitude. An f32 file takes llama.cpp's bf16
activation rounding out (exact mapping: float32-level agreement); q8_0 / q4_0 rows include their quantization.
Beside the four tiny presets, `MODELS` adds custom configs for mapping paths no preset takes (`VARIANTS`).
Writes the rows as JSON (`--json`: "checks", with command, commit, weights, machine) and prints one line per row.

Usage (repository root): python benchmarks/check_gguf_export.py --llama-logits /tmp/llama/llama_logits
    [--families tiny-deepseek-v2-lite ...] [--types bf16 q8_0 q4_0] [--workloads uniform skewed] [--gains 1 8]
    [--prompt 128] [--kv f32] [--json PATH]
"""

from __future__ import annotations

import argparse
import itertools
import json
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import export_gguf  # noqa: E402

FAMILIES = ("tiny-deepseek-v2-lite", "tiny-moonlight-16b-a3b", "tiny-qwen3-30b-a3b", "tiny-mixtral-8x7b")
# Mapping paths no preset takes (custom ModelConfigs, "<preset>+<variant>"): q LoRA (attn_q_a / attn_q_b), tied
# embeddings (no output tensor), one kv head per query head (the llama permutation of k over every head).
VARIANTS = {"q_lora": dict(q_lora_rank=32), "tied": dict(tie_word_embeddings=True), "mha": dict(num_kv_heads=4)}
# reference-moe: the package's small trained DeepSeek-V2-style model (its checkpoint, uniform workload only), whose
# peaked attention and decisive routing test the mapping harder than random init does.
MODELS = FAMILIES + ("tiny-deepseek-v2-lite+q_lora", "tiny-moonlight-16b-a3b+q_lora", "tiny-qwen3-30b-a3b+tied",
                     "tiny-mixtral-8x7b+mha", "reference-moe")


def model_config(name: str):
    """(ModelConfig, checkpoint directory or None) of a model name (`api.resolve`), or of "<preset>+<variant>" (a
    preset changed as `VARIANTS` says)."""
    from pdscope_jax.api import resolve
    from pdscope_jax.presets import preset

    base, _, variant = name.partition("+")
    if not variant:
        return resolve(name)
    if variant not in VARIANTS:
        raise SystemExit(f"unknown variant {variant!r} in {name!r}; known: {', '.join(VARIANTS)}")
    return preset(base).replace(**VARIANTS[variant], name=name), None


def llama_cpp_logits(binary: str, gguf_path: Path, ids: np.ndarray, kv: str, threads: int) -> np.ndarray:
    """[T, V] float32 logits of every position from `llama_logits`."""
    out = gguf_path.with_suffix(".logits")
    cmd = [binary, str(gguf_path), str(out), "--kv", kv, "--threads", str(threads), *map(str, ids.tolist())]
    run = subprocess.run(cmd, capture_output=True, text=True)
    if run.returncode != 0:
        raise RuntimeError(f"llama_logits failed ({run.returncode}): {run.stderr.strip()[-2000:]}")
    t, v = map(int, run.stdout.split())
    return np.fromfile(out, np.float32).reshape(t, v)


def sharpen(cfg, gain: float):
    """`transform(path, array)` of the stress variant: query and key projections (MLA: q and the rope-key columns of
    kv_a_proj_with_mqa; its latent columns are RMS-normalised anyway) times `gain`, so attention scores grow by
    gain^2 and attention is peaked instead of nearly uniform, which makes RoPE, head-order and YaRN mistakes show
    at every position. Qwen3 normalises q and k per head, which undoes a scaled projection: there the q / k norm
    scales grow instead, by gain / 4 (normalised q / k of random init are already several times larger than raw
    projections; gain 8 then peaks attention about as much in every family). None for gain 1. Values stay in the
    arrays' dtype (rounded once)."""
    if gain == 1:
        return None
    rope = cfg.qk_rope_head_dim

    def transform(path: str, array):
        x = np.asarray(array, np.float32)
        if path.endswith(("q_proj.kernel", "k_proj.kernel", "q_b_proj.kernel")):
            return (x * gain).astype(array.dtype)
        if path.endswith(("q_norm.weight", "k_norm.weight")):
            return (x * max(gain / 4, 1.0)).astype(array.dtype)
        if path.endswith("kv_a_proj_with_mqa.kernel"):
            return np.concatenate([x[..., :-rope], x[..., -rope:] * gain], -1).astype(array.dtype)
        return array

    return transform


def project_logits(cfg, checkpoint, seed: int, workload: str, ids: np.ndarray,
                   transform=None) -> tuple[np.ndarray, np.ndarray]:
    """([T, V] logits of the bench weights (rewritten by `transform` if given) run in float32, the same run in
    bfloat16) by the plain model."""
    import jax
    import jax.numpy as jnp

    from pdscope_jax import models
    from pdscope_jax.generation.generator import Generator

    shapes, loader = export_gguf.weights_loader(cfg, checkpoint, seed, workload, jnp.bfloat16)
    flat = loader(list(shapes), lambda _: jax.sharding.SingleDeviceSharding(jax.devices()[0]))
    if transform is not None:
        flat = {p: jnp.asarray(transform(p, np.asarray(v))) for p, v in flat.items()}
    f32 = {p: v.astype(jnp.float32) for p, v in flat.items()}
    out = Generator(models.from_flat(cfg, jnp.float32, f32)).logits(ids[None])[0]
    bf16 = Generator(models.from_flat(cfg, jnp.bfloat16, flat)).logits(ids[None])[0]
    return out, bf16


def check(model, binary: str, gtype: str, seed: int, workload: str, prompt: int, kv: str, threads: int,
          workdir: Path, gain: float = 1.0) -> dict:
    """One row: `model` (a `model_config` name, or a (ModelConfig, checkpoint or None) pair) exported as `gtype`,
    compared on `prompt` token ids."""
    cfg, checkpoint = model_config(model) if isinstance(model, str) else model
    name = model if isinstance(model, str) else cfg.name
    ids = np.random.default_rng(seed).integers(0, cfg.vocab_size, prompt).astype(np.int32)
    path = workdir / f"{name}.{gtype}.gguf"
    transform = sharpen(cfg, gain)
    info = export_gguf.export(cfg, path, gtype, seed, workload, checkpoint, log=None, transform=transform)
    theirs = llama_cpp_logits(binary, path, ids, kv, threads)
    ours, ours_bf16 = project_logits(cfg, checkpoint, seed, workload, ids, transform)
    per_position = np.abs(theirs - ours).max(-1)  # [T]
    reference = np.abs(ours_bf16 - ours).max(-1)
    return {"model": name, "weights": "checkpoint" if checkpoint else "random",
            "arch": export_gguf.ARCH[cfg.model_type], "type": gtype, "workload": workload,
            "attention_gain": gain, "prompt_tokens": int(prompt), "max_abs_diff": float(per_position.max()),
            "median_position_max_abs_diff": float(np.median(per_position)),
            "positions_over_1e-2": int((per_position > 1e-2).sum()),
            "max_abs_logit": float(np.abs(ours).max()),
            "argmax_agreement": float((theirs.argmax(-1) == ours.argmax(-1)).mean()),
            "project_bf16_vs_f32_max_abs": float(reference.max()),
            "project_bf16_vs_f32_median_position_max_abs": float(np.median(reference)),
            "project_bf16_vs_f32_positions_over_1e-2": int((reference > 1e-2).sum()),
            "bf16_fallback_tensors": len(info["bf16_fallback"]), "gguf_bytes": info["bytes"]}


def _commit() -> str:
    """HEAD of this checkout, short, with "+dirty" when anything differs from it."""
    def git(*a):
        return subprocess.run(["git", *a], cwd=HERE.parent, capture_output=True, text=True).stdout.strip()

    head = git("rev-parse", "--short", "HEAD") or "unknown"
    return head + ("+dirty" if git("status", "--porcelain") else "")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-logits", required=True, help="the built benchmarks/llama_logits.cc")
    parser.add_argument("--families", nargs="+", default=list(MODELS), help="preset names, or PRESET+VARIANT")
    parser.add_argument("--types", nargs="+", default=["bf16"], choices=export_gguf.TYPES)
    parser.add_argument("--workloads", nargs="+", default=["uniform"], choices=["uniform", "skewed"])
    parser.add_argument("--gains", nargs="+", type=float, default=[1.0],
                        help="1: the bench's weights; G > 1: also a stress variant with q/k projections times G")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--prompt", type=int, default=128, help="prompt length in tokens")
    parser.add_argument("--kv", default="f32", choices=["f32", "f16"], help="llama.cpp's KV cache type")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path, default=None, help="write the rows here")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for gtype, workload, gain, name in itertools.product(args.types, args.workloads, args.gains, args.families):
            if (workload != "uniform" or gain != 1) and model_config(name)[1] is not None:
                continue  # a checkpoint is run as trained: workloads and the stress variant are for random weights
            row = check(name, args.llama_logits, gtype, args.seed, workload, args.prompt, args.kv,
                        args.threads, Path(tmp), gain)
            rows.append(row)
            print(f"{name:30s} {row['arch']:9s} {gtype:4s} {workload:7s} gain {gain:g}: max|diff| "
                  f"{row['max_abs_diff']:.2e}"
                  f" (median per position {row['median_position_max_abs_diff']:.1e}, "
                  f"{row['positions_over_1e-2']} positions > 1e-2; logits up to {row['max_abs_logit']:.2f};"
                  f" project bf16 vs f32 {row['project_bf16_vs_f32_max_abs']:.1e}), argmax agreement "
                  f"{row['argmax_agreement']:.3f}", flush=True)
    result = {"what": "logits of llama.cpp on benchmarks/export_gguf.py's GGUF export against the project's plain "
                      "model (float32, same weights): tiny presets, custom variants and the trained reference-moe, "
                      "every position of one prompt of token ids",
              "command": shlex.join(["python", "benchmarks/check_gguf_export.py", *(sys.argv[1:] if argv is None
                                                                                  else argv)]),
              "commit": _commit(),
              "weights": f"random (seeded, seed {args.seed}); reference-moe: its trained checkpoint",
              "machine": "development VM, 2 cores, CPU",
              "llama_cpp": f"{args.llama_logits} (benchmarks/llama_logits.cc against .peers/llama.cpp.tgz built for "
                           f"the CPU), KV cache {args.kv}, {args.threads} threads",
              "model": ", ".join(dict.fromkeys(args.families)),
              "checks": rows, "seconds": round(time.perf_counter() - start, 1)}
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
