"""Write tiny random Hugging Face checkpoints of the four families, with reference logits and greedy tokens.

Needs the `reference` extra (torch, transformers; imported only when it runs, so `--help` works without them).
Run from the repository root:

    python scripts/make_reference.py [--out tests/data] [CASE ...]

For each case in CASES it builds the transformers model in float32 from a seeded random init (scaled so that
routing and logits are far from uniform), saves it with `save_pretrained` (hub tensor names: per-expert tensors,
`mlp.gate.weight`, ...), rewrites config.json in the hub's layout (`rope_theta` and `rope_scaling` at top level
instead of transformers 5's `rope_parameters`; Qwen3-MoE's `num_experts`), reloads it from disk with
`from_pretrained` and records, in reference.npz:
    input_ids      int32 [B, T]
    logits         float32 [B, T, V], a full forward without cache
    greedy_tokens  int32 [B, 8], 8 greedy decoding steps of `generate` (KV cache; eos does not stop it)
Each case goes to <out>/<case>/ (safetensors, config.json, reference.npz); one JSON line per case is printed.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch

BATCH, TOKENS, GREEDY_STEPS = 2, 12, 8
COMMON = dict(vocab_size=96, hidden_size=32, num_attention_heads=4, rms_norm_eps=1e-6, tie_word_embeddings=False,
              hidden_act="silu", bos_token_id=1, eos_token_id=2, pad_token_id=0, max_position_embeddings=256)
MLA = dict(kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, num_key_value_heads=4,
           moe_intermediate_size=12, intermediate_size=40, n_routed_experts=8, n_shared_experts=1,
           first_k_dense_replace=1, num_hidden_layers=3)
YARN = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 32, "beta_slow": 1,
        "mscale": 0.707, "mscale_all_dim": 0.707}

# name -> (config class name, config kwargs, seed, shard into this many files or None)
CASES = {
    "deepseek_v2": ("DeepseekV2Config", dict(
        **COMMON, **MLA, q_lora_rank=None, rope_theta=10000.0, rope_scaling=YARN, num_experts_per_tok=3,
        topk_method="group_limited_greedy", n_group=4, topk_group=2, norm_topk_prob=False,
        routed_scaling_factor=1.5), 0, None),
    "deepseek_v2_qlora_sharded": ("DeepseekV2Config", dict(
        **COMMON, **MLA, q_lora_rank=24, rope_theta=10000.0, num_experts_per_tok=2, topk_method="greedy",
        n_group=1, topk_group=1, norm_topk_prob=False, routed_scaling_factor=1.0), 1, 2),
    "deepseek_v3": ("DeepseekV3Config", dict(
        **COMMON, **MLA, q_lora_rank=24, rope_theta=50000.0, num_experts_per_tok=3, n_group=4, topk_group=2,
        norm_topk_prob=True, routed_scaling_factor=2.5, scoring_func="sigmoid", topk_method="noaux_tc"), 2, None),
    "qwen3_moe": ("Qwen3MoeConfig", dict(
        **COMMON, num_hidden_layers=2, num_key_value_heads=2, head_dim=12, intermediate_size=40,
        moe_intermediate_size=16, num_experts=8, num_experts_per_tok=3, norm_topk_prob=True, rope_theta=1e6,
        decoder_sparse_step=1, mlp_only_layers=[]), 3, None),
    "mixtral": ("MixtralConfig", dict(
        **COMMON, num_hidden_layers=2, num_key_value_heads=2, head_dim=8, intermediate_size=24,
        num_local_experts=4, num_experts_per_tok=2, rope_theta=1e6, sliding_window=None), 4, None),
}


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Scaled random weights: unit-variance activations, peaked routers, norms away from one, non-zero biases."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            noise = torch.randn(tensor.shape, generator=gen, dtype=torch.float32)
            if name.endswith("e_score_correction_bias"):
                value = 0.1 * noise
            elif tensor.ndim == 1:  # RMSNorm scales
                value = 1.0 + 0.2 * noise
            elif "embed_tokens" in name:
                value = noise
            elif name.endswith("gate.weight") and tensor.shape[0] != tensor.shape[1]:  # routers [E, D]
                value = 3.0 * noise / math.sqrt(tensor.shape[-1])
            else:
                value = noise / math.sqrt(tensor.shape[-1])  # fan-in scaling of [.., out, in] weights
            tensor.copy_(value)


# transformers 5 writes some fields under its own names; published config.json files use these.
HUB_NAMES = {"qwen3_moe": {"num_local_experts": "num_experts"}}


def hub_config(path: Path) -> None:
    """Rewrite transformers 5's config.json in the layout of published checkpoints."""
    config = json.loads(path.read_text())
    for ours, hub in HUB_NAMES.get(config["model_type"], {}).items():
        config[hub] = config.pop(ours)
    rope = dict(config.pop("rope_parameters"))
    config["rope_theta"] = rope.pop("rope_theta")
    rope_type = rope.pop("rope_type", rope.get("type", "default"))
    config["rope_scaling"] = None if rope_type == "default" else {**rope, "type": rope_type}
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def make(name: str, out: Path) -> dict:
    import torch
    import transformers

    class_name, kwargs, seed, shards = CASES[name]
    torch.manual_seed(seed)
    config = getattr(transformers, class_name)(**kwargs)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager",
                                                          dtype=torch.float32)
    randomize(model, seed)
    target = out / name
    target.mkdir(parents=True, exist_ok=True)
    for old in target.glob("*.safetensors*"):
        old.unlink()
    save = {}
    if shards:
        total = sum(t.numel() * t.element_size() for t in model.state_dict().values())
        save["max_shard_size"] = int(total / shards * 1.1)
    model.save_pretrained(target, **save)
    hub_config(target / "config.json")
    (target / "generation_config.json").unlink(missing_ok=True)

    model = transformers.AutoModelForCausalLM.from_pretrained(target, attn_implementation="eager",
                                                              dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(1000 + seed)
    input_ids = torch.randint(3, config.vocab_size, (BATCH, TOKENS), generator=gen)
    with torch.no_grad():
        logits = model(input_ids).logits.float()
        model.generation_config.eos_token_id = None
        generated = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                                   max_new_tokens=GREEDY_STEPS, min_new_tokens=GREEDY_STEPS, pad_token_id=0)
    greedy = generated[:, TOKENS:]
    if not torch.equal(greedy[:, 0], logits[:, -1].argmax(-1)):
        raise RuntimeError(f"{name}: generate's first token is not the argmax of the forward's logits")
    np.savez(target / "reference.npz", input_ids=input_ids.numpy().astype(np.int32),
             logits=logits.numpy().astype(np.float32), greedy_tokens=greedy.numpy().astype(np.int32))
    files = sorted(p.name for p in target.glob("*.safetensors"))
    if shards and len(files) != shards:
        raise RuntimeError(f"{name}: expected {shards} shards, save_pretrained wrote {files}")
    return dict(name=name, files=files, logits_std=float(logits.std()),
                distinct_greedy=int(torch.unique(greedy).numel()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "tests" / "data")
    parser.add_argument("cases", nargs="*", default=list(CASES), help="subset of: " + ", ".join(CASES))
    args = parser.parse_args()
    import torch

    torch.use_deterministic_algorithms(True)
    for name in args.cases:
        print(json.dumps(make(name, args.out)))


if __name__ == "__main__":
    main()
