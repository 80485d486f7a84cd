"""Qwen3-MoE: grouped-query attention with per-head q/k RMSNorm, every layer a routed MoE (no shared experts).

Contract: `build(cfg, rngs, dtype) -> CausalLM` for model type `qwen3_moe`; `checkpoint_sources(cfg)` maps the
Hugging Face layout (`model.layers.L.mlp.experts.E.{gate,up,down}_proj.weight`, router `mlp.gate.weight`,
`self_attn.{q,k}_norm.weight`). Router: softmax over experts in float32, top-k, renormalised when
`norm_topk_prob` (transformers' Qwen3MoeTopKRouter).
"""

from __future__ import annotations

from flax import nnx

from pdscope_jax.config import ModelConfig
from pdscope_jax.models.cache import init_kv_cache
from pdscope_jax.models.layers import (
    CausalLM, DecoderLayer, GQAAttention, MoE, SoftmaxTopkRouter, expert_sources, linear_sources, skeleton_sources,
)
from pdscope_jax.weights.spec import Source


def build(cfg: ModelConfig, rngs: nnx.Rngs, dtype) -> CausalLM:
    layers = [
        DecoderLayer(cfg, GQAAttention(cfg, rngs, dtype), MoE(cfg, SoftmaxTopkRouter(cfg, rngs, dtype), rngs, dtype), dtype)
        for _ in range(cfg.num_layers)
    ]
    return CausalLM(cfg, layers, init_kv_cache, rngs, dtype)


def checkpoint_sources(cfg: ModelConfig) -> dict[str, Source]:
    out = skeleton_sources(cfg)
    for i in range(cfg.num_layers):
        p, hf = f"layers.{i}", f"model.layers.{i}"
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            out.update(linear_sources(f"{p}.self_attn.{name}", f"{hf}.self_attn.{name}", cfg.attention_bias))
        for name in ("q_norm", "k_norm"):
            out[f"{p}.self_attn.{name}.weight"] = Source.single(f"{hf}.self_attn.{name}.weight")
        out.update(linear_sources(f"{p}.mlp.gate", f"{hf}.mlp.gate"))
        out.update(expert_sources(f"{p}.mlp.experts", f"{hf}.mlp.experts", cfg.num_experts,
                                  ("gate_proj", "up_proj", "down_proj")))
    return out
