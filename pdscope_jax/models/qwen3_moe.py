"""Qwen3-MoE: grouped-query attention with per-head q/k RMSNorm, every layer a routed MoE (no shared experts).

Contract: `build(cfg, rngs, dtype) -> CausalLM` for model type `qwen3_moe`; `checkpoint_sources(cfg)` maps the
Hugging Face layout (`model.layers.L.mlp.experts.E.{gate,up,down}_proj.weight`, router `mlp.gate.weight`,
`self_attn.{q,k}_norm.weight`). Router: softmax over experts in float32, top-k, renormalised when
`norm_topk_prob` (transformers' Qwen3MoeTopKRouter).
"""

from __future__ import annotations

from flax import nnx

from pdscope_jax.config import ModelConfig
from pdscope_jax.models.layers import CausalLM, build_gqa_moe, gqa_moe_sources
from pdscope_jax.weights.spec import Source


def build(cfg: ModelConfig, rngs: nnx.Rngs, dtype) -> CausalLM:
    return build_gqa_moe(cfg, rngs, dtype)


def checkpoint_sources(cfg: ModelConfig) -> dict[str, Source]:
    return gqa_moe_sources(cfg, "mlp", ("gate_proj", "up_proj", "down_proj"))
