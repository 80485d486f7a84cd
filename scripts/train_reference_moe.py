"""Train the project's reference MoE: a small DeepSeek-V2 (MLA, shared + routed experts) on Python source.

Run from the repository root, with the package importable (`pip install -e .` or `PYTHONPATH=.`):
    python scripts/train_reference_moe.py                      # the reference (sized for one GPU)
    python scripts/train_reference_moe.py --smoke [--out DIR]  # tiny model, 20 steps, CPU-sized (CI)
In order (the stages live in scripts/reference_moe/, this file owns the flags and the results):
1. Corpus and tokenizer (scripts/reference_moe/data.py): the interpreter's stdlib `.py` files split 95/5 by path
   hash into train / held-out, plus out-of-domain text (the first source found; recorded); a byte-level BPE
   `tokenizer.json` trained on the train split, `<|endoftext|>` (id 0) ending every document and as bos/eos.
2. The model: `pdscope_jax.models.build` on `ModelConfig.from_hf(REFERENCE_CONFIG)` (`SMOKE_CONFIG` with --smoke).
3. Training (scripts/reference_moe/train.py): float32 master weights, forward and backward in `--compute-dtype`,
   AdamW, linear warm-up then cosine decay to 10% over `--epochs` passes of the train split (more passes
   memorise the stdlib: held-out loss rises), capped by `--steps` and `--max-seconds` (the horizon is re-fixed
   after timing the first steps so the schedule ends where the budget does). Loss: next-token cross-entropy
   plus `--balance-coef` times the expert balance loss, kept small so that routing stays learned and skewed.
   Train / held-out / out-of-domain losses every `--eval-every` steps.
4. Export (scripts/reference_moe/checkpoint.py) in the Hugging Face layout into `--out` (default
   pdscope_jax/assets/reference-moe/): config.json, bf16 safetensors under the hub keys (sharded above
   `--max-shard-mb`), tokenizer.json.
5. Checks: `pdscope_jax.load(out)` must give the logits of the trained model with its weights rounded to bf16;
   then routing statistics on held-out text, and greedy and sampled generations.
Writes `--results-dir`/reference_moe_training.json (everything above, the loss curve, timings, the command,
the generations) and reference_moe_training.png; exit status 1 when the reload check fails.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

# The stages are the sibling package `reference_moe`; put this folder first also when loaded by path (tests).
_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

import pdscope_jax  # noqa: E402
from pdscope_jax import models  # noqa: E402
from pdscope_jax.config import ModelConfig  # noqa: E402
from pdscope_jax.text import corpus  # noqa: E402
from reference_moe import checkpoint, data as data_stage, train  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = Path(pdscope_jax.__file__).resolve().parent / "assets" / "reference-moe"
DEFAULT_RESULTS = REPO / "benchmarks" / "results"
DEFAULT_ROUTING = DEFAULT_OUT.parent / "reference-moe-routing.json"  # package data: the skewed workload's targets
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
    p.add_argument("--routing-out", type=Path, help=f"held-out routing statistics, the skewed workload's targets "
                                                       f"(default {DEFAULT_ROUTING}; --smoke: --results-dir)")
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

    prepared = data_stage.prepare(cfg.vocab_size, args.seq_len, args.eval_windows, args.batch, args.seed,
                                  args.smoke)
    data, tok, streams, evals = prepared.corpus, prepared.tok, prepared.streams, prepared.evals
    mark("data_and_tokenizer")

    master_graphdef, params = train.init_params(cfg, args.seed)
    compute = jnp.dtype(args.compute_dtype)
    graphdef, abstract = nnx.split(models.abstract_model(cfg, compute))
    dtypes = jax.tree.map(lambda x: x.dtype, abstract)

    def cast(p):  # float32 master weights -> the compute model's dtypes (routers stay float32)
        return jax.tree.map(lambda x, d: x.astype(d), p, dtypes)

    n_params = train.param_count(params)
    print(f"model: {n_params:,} parameters ({n_params * 2 / 1e6:.1f} MB in bf16), "
          f"{len(cfg.moe_layers)} MoE layers x {cfg.num_experts} experts, top-{cfg.num_experts_per_tok}", flush=True)

    tx = train.make_optimizer(args.weight_decay)
    opt_state = tx.init(params)
    train_step, eval_loss = train.make_fns(graphdef, cast, tx, args.balance_coef, cfg.num_experts)
    rng = np.random.default_rng(args.seed)

    def evaluate(params) -> dict:
        return {f"{name}_loss": float(np.mean([eval_loss(params, jnp.asarray(b)) for b in batches]))
                for name, batches in evals.items()}

    fitted = train.fit(args, params, opt_state, train_step, evaluate, streams["train"], rng)
    params, log, steps_done, horizon = fitted.params, fitted.log, fitted.steps, fitted.horizon
    step_seconds, train_seconds = fitted.step_seconds, fitted.train_seconds
    mark("init_and_train")

    flat = {k: np.asarray(v, np.float32) for k, v in models.to_flat(nnx.merge(master_graphdef, params)).items()}
    exported = checkpoint.export(args.out, hf_config, cfg, flat, tok, int(args.max_shard_mb * 1e6))
    print(f"saved {exported}", flush=True)
    mark("export")

    check_ids = evals["heldout"][0][:2, : args.seq_len] if "heldout" in evals else \
        corpus.chunk_windows(streams["train"], args.seq_len, 2)
    reload = checkpoint.reload_check(args.out, cfg, flat, check_ids)
    loaded = reload.pop("loaded")
    print(f"reload: {reload}", flush=True)
    mark("reload_check")

    # The saved weights (bf16-rounded), computed in float32.
    stats_graphdef, stats_state = nnx.split(checkpoint.model_from(cfg, checkpoint.bf16_round(flat)))
    windows = corpus.chunk_windows(streams["heldout"], args.seq_len, args.stats_windows)
    experts = checkpoint.routed_experts(stats_graphdef, stats_state, windows, min(args.batch, len(windows)))
    stats = checkpoint.routing_stats(experts, cfg.num_experts)
    print(f"routing on {stats['tokens']:,} held-out tokens: normalized entropy "
          f"{stats['mean_normalized_entropy']}, top-quarter share {stats['mean_top_quarter_share']}, unused "
          f"{stats['unused_experts']}, affinity recall@K {stats['mean_affinity_recall_at_k']} vs popularity "
          f"{stats['mean_popularity_recall_at_k']}", flush=True)
    mark("routing_stats")

    samples = checkpoint.generations(loaded, PROMPTS[:1] if args.smoke else PROMPTS, 16 if args.smoke else 48,
                                     args.seed)
    for s in samples:
        print(f"--- {s['mode']} {s['prompt']!r}\n{s['text']}", flush=True)
    mark("generations")

    results = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]) if argv is None else
        " ".join(["python", "scripts/train_reference_moe.py", *argv]),
        "smoke": args.smoke,
        "jax": jax.__version__, "python": platform.python_version(),
        "device": f"{jax.devices()[0].platform}: {jax.devices()[0].device_kind}",
        "hf_config": hf_config,
        "parameters": n_params,
        "corpus": {**data.summary(), "heldout_fraction": data_stage.HELDOUT_FRACTION, "split_seed": args.seed,
                   "stdlib": str(corpus.stdlib_root())},
        "tokenizer": {"kind": "byte-level BPE (tokenizers)", "vocab_size": tok.get_vocab_size(),
                      "eos": data_stage.EOS,
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
    routing = args.routing_out or (args.results_dir / DEFAULT_ROUTING.name if args.smoke else DEFAULT_ROUTING)
    routing.write_text(json.dumps({"what": "the reference MoE's held-out routing statistics (the skewed workload's "
                                           "targets)", "source": f"routing_heldout of {json_path.name}",
                                   "commit": results.get("commit"), "routing_heldout": stats}, indent=1) + "\n")
    checkpoint.plot(args.results_dir / "reference_moe_training.png", log, stats)
    print(f"wrote {json_path} and reference_moe_training.png in {results['total_seconds']} s", flush=True)
    print(json.dumps({"train_loss": log[-1]["train_loss"], "heldout_loss": log[-1].get("heldout_loss"),
                      "ood_loss": log[-1].get("ood_loss"), "steps": steps_done, "reload_ok": reload["ok"],
                      "safetensors_bytes": exported["safetensors_bytes"]}))
    return 0 if reload["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
