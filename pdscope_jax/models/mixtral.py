"""Mixtral: grouped-query attention, every layer a routed MoE of SwiGLU experts (no shared experts).

Contract: `build(cfg, rngs, dtype) -> CausalLM` for model type `mixtral`; `checkpoint_sources(cfg)` maps the
Hugging Face layout (`model.layers.L.block_sparse_moe.experts.E.w1/w3/w2.weight` = gate/up/down, router
`block_sparse_moe.gate.weight`). Router: softmax in float32, top-k, always renormalised. The MoE lives at
`layers.L.mlp` like in every other family; only the checkpoint names differ. No sliding window.
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
        out.update(linear_sources(f"{p}.mlp.gate", f"{hf}.block_sparse_moe.gate"))
        out.update(expert_sources(f"{p}.mlp.experts", f"{hf}.block_sparse_moe.experts", cfg.num_experts,
                                  ("w1", "w3", "w2")))
    return out
