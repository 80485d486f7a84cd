"""Mixtral: grouped-query attention, every layer a routed MoE of SwiGLU experts (no shared experts).

Contract: `build(cfg, rngs, dtype) -> CausalLM` for model type `mixtral`; `checkpoint_sources(cfg)` maps the
Hugging Face layout (`model.layers.L.block_sparse_moe.experts.E.w1/w3/w2.weight` = gate/up/down, router
`block_sparse_moe.gate.weight`). Router: softmax in float32, top-k, always renormalised. The MoE lives at
`layers.L.mlp` like in every other family; only the checkpoint names differ. No sliding window.
"""

from __future__ import annotations

from flax import nnx

from pdscope_jax.config import ModelConfig
from pdscope_jax.models.layers import CausalLM, build_gqa_moe, gqa_moe_sources
from pdscope_jax.weights.spec import Source


def build(cfg: ModelConfig, rngs: nnx.Rngs, dtype) -> CausalLM:
    return build_gqa_moe(cfg, rngs, dtype)


def checkpoint_sources(cfg: ModelConfig) -> dict[str, Source]:
    return gqa_moe_sources(cfg, "block_sparse_moe", ("w1", "w3", "w2"))
