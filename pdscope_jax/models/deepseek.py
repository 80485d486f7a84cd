"""DeepSeek-V2 and DeepSeek-V3 / Moonlight: multi-head latent attention and routed + shared experts.

Contract: `build(cfg, rngs, dtype) -> CausalLM` for model types `deepseek_v2` and `deepseek_v3`;
`checkpoint_sources(cfg)` maps the Hugging Face key layout onto the parameters. Semantics follow the
transformers implementations:
- MLA: q from `q_proj` (or the `q_a_proj -> q_a_layernorm -> q_b_proj` LoRA when `q_lora_rank` is set); keys
  and values from a compressed latent (`kv_a_proj_with_mqa` -> RMSNorm, eps 1e-6) expanded by `kv_b_proj`,
  plus one rotary key shared by all heads (decoupled RoPE, DeepSeek's interleaved pair layout). The cache
  stores the latent and the rotated rope key only. Under YaRN the softmax scale gains mscale(factor,
  mscale_all_dim)^2 and cos/sin the YaRN attention factor. Queries of at most `LATENT_MAX_QUERY` tokens against
  a cache of at least `LATENT_MIN_CACHE` positions (decode at long contexts) attend in the latent space instead:
  `kv_b_proj`'s key half is folded into the query and its value half applied after the weighted sum, the same
  products in another order, so a step reads the cached latent and never expands every cached position into
  per-head keys and values.
- The first `first_k_dense` layers use a dense MLP, the rest a MoE with `num_shared_experts` shared experts.
- Router (float32): `greedy` (softmax top-k), `group_limited_greedy` (softmax, best groups by their max score),
  or `noaux_tc` (sigmoid; choice by score + e_score_correction_bias inside the best groups by the sum of each
  group's top-2; weights are the unbiased scores). Only `noaux_tc` renormalises when `norm_topk_prob`, as in
  transformers; all methods multiply by `routed_scaling_factor`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from pdscope_jax.config import ModelConfig
from pdscope_jax.models.cache import MLACache, init_mla_cache, update_cache
from pdscope_jax.models.layers import (
    F32, CausalLM, DecoderLayer, DenseMLP, MoE, RMSNorm, apply_rope, attention, causal_mask, dense_mlp_sources,
    expert_sources, keep_top_groups, linear, linear_sources, rope_cos_sin, router_logits, skeleton_sources,
    yarn_get_mscale,
)
from pdscope_jax.weights.spec import Source

TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")
LATENT_NORM_EPS = 1e-6  # transformers builds q_a_layernorm / kv_a_layernorm with the default eps
# Attending in the latent space costs fewer products than expanding the cache up to about this many query
# tokens (decode steps, batched or not, and the shortest prompt chunks), but more small programs a layer: on the
# GPU node expanding stayed faster at 576 cached positions and lost from about 1,000 (docs/MEASUREMENTS.md).
LATENT_MAX_QUERY = 16
LATENT_MIN_CACHE = 1024


def softmax_scale(cfg: ModelConfig) -> float:
    scale = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5
    scaling = cfg.rope_scaling_dict
    if scaling is not None and scaling.get("mscale_all_dim"):
        mscale = yarn_get_mscale(scaling["factor"], scaling["mscale_all_dim"])
        scale *= mscale * mscale
    return scale


class MLAttention(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, dtype):
        d, h = cfg.hidden_size, cfg.num_heads
        qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        self.cfg = cfg
        if cfg.q_lora_rank is None:
            self.q_proj = linear(d, h * qk, rngs, dtype)
        else:
            self.q_a_proj = linear(d, cfg.q_lora_rank, rngs, dtype, cfg.attention_bias)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, LATENT_NORM_EPS, dtype)
            self.q_b_proj = linear(cfg.q_lora_rank, h * qk, rngs, dtype)
        self.kv_a_proj_with_mqa = linear(d, cfg.kv_lora_rank + cfg.qk_rope_head_dim, rngs, dtype, cfg.attention_bias)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, LATENT_NORM_EPS, dtype)
        self.kv_b_proj = linear(cfg.kv_lora_rank, h * (cfg.qk_nope_head_dim + cfg.v_head_dim), rngs, dtype)
        self.o_proj = linear(h * cfg.v_head_dim, d, rngs, dtype, cfg.attention_bias)
        self.scale = softmax_scale(cfg)

    def __call__(self, x: jax.Array, positions: jax.Array, cache: MLACache | None):
        cfg = self.cfg
        b, t, _ = x.shape
        h, dn, dr = cfg.num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
        if cfg.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.reshape(b, t, h, dn + dr)
        q_nope, q_rope = q[..., :dn], q[..., dn:]
        compressed = self.kv_a_proj_with_mqa(x)  # [B, T, R + Dr]
        latent = self.kv_a_layernorm(compressed[..., : cfg.kv_lora_rank])  # [B, T, R]
        k_rope = compressed[..., cfg.kv_lora_rank:][:, :, None, :]  # [B, T, 1, Dr]
        cos, sin = rope_cos_sin(cfg, dr, positions)
        q_rope, k_rope = apply_rope(q_rope, cos, sin, True), apply_rope(k_rope, cos, sin, True)[:, :, 0]
        if cache is None:
            k_pos = positions
        else:
            cache, k_pos = update_cache(cache, (latent, k_rope), positions)
            latent, k_rope = cache
            if t <= LATENT_MAX_QUERY and latent.shape[1] >= LATENT_MIN_CACHE:
                out = self._attend_latent(q_nope, q_rope, latent, k_rope, causal_mask(positions, k_pos))
                return self.o_proj(out.reshape(b, t, -1)), cache
        s = latent.shape[1]
        kv = self.kv_b_proj(latent).reshape(b, s, h, dn + cfg.v_head_dim)  # [B, S, H, Dn + Dv]
        k = jnp.concatenate([kv[..., :dn], jnp.broadcast_to(k_rope[:, :, None, :], (b, s, h, dr))], axis=-1)
        q = jnp.concatenate([q_nope, q_rope], axis=-1)
        out = attention(q, k, kv[..., dn:], causal_mask(positions, k_pos), self.scale)  # [B, T, H, Dv]
        return self.o_proj(out.reshape(b, t, -1)), cache

    def _attend_latent(self, q_nope, q_rope, latent, k_rope, mask):
        """Attention against the cached latent [B, S, R] and rope key [B, S, Dr] without expanding them: the
        query's nope part folded through `kv_b_proj`'s key half (per head [R, Dn]), the probabilities' weighted
        latent through its value half. Scores and softmax float32, as `layers.attention`. -> [B, T, H, Dv].
        (Scored as two products, latent and rope, rather than one over their concatenation, which copies the
        whole cache every step: measured slower on the GPU node, docs/MEASUREMENTS.md.)"""
        cfg = self.cfg
        h, dn = cfg.num_heads, cfg.qk_nope_head_dim
        w = self.kv_b_proj.kernel[...].reshape(cfg.kv_lora_rank, h, dn + cfg.v_head_dim)
        q_latent = jnp.einsum("bthd,rhd->bthr", q_nope, w[..., :dn], preferred_element_type=F32).astype(latent.dtype)
        scores = (jnp.einsum("bthr,bsr->bhts", q_latent, latent, preferred_element_type=F32)
                  + jnp.einsum("bthd,bsd->bhts", q_rope, k_rope, preferred_element_type=F32)) * self.scale
        probs = jax.nn.softmax(jnp.where(mask[:, None], scores, -jnp.inf), axis=-1).astype(latent.dtype)
        context = jnp.einsum("bhts,bsr->bthr", probs, latent, preferred_element_type=F32).astype(latent.dtype)
        return jnp.einsum("bthr,rhd->bthd", context, w[..., dn:], preferred_element_type=F32).astype(q_nope.dtype)


class DeepseekRouter(nnx.Module):
    """h [N, D] -> (weights [N, K] float32, ids [N, K] int32); the kernel and bias are kept in float32."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        if cfg.topk_method not in TOPK_METHODS:
            raise ValueError(f"topk_method {cfg.topk_method!r} is not supported; supported: {TOPK_METHODS}")
        if cfg.scoring_func not in ("softmax", "sigmoid"):
            raise ValueError(f"scoring_func {cfg.scoring_func!r} is not supported (softmax or sigmoid)")
        self.cfg = cfg
        self.kernel = nnx.Param(nnx.initializers.normal(0.02)(rngs.params(), (cfg.hidden_size, cfg.num_experts), F32))
        if cfg.topk_method == "noaux_tc":
            self.e_score_correction_bias = nnx.Param(jnp.zeros((cfg.num_experts,), F32))

    def __call__(self, h: jax.Array) -> tuple[jax.Array, jax.Array]:
        cfg = self.cfg
        logits = router_logits(h, self.kernel[...])  # [N, E]
        scores = jax.nn.sigmoid(logits) if cfg.scoring_func == "sigmoid" else jax.nn.softmax(logits, axis=-1)
        k = cfg.num_experts_per_tok
        if cfg.topk_method == "noaux_tc":
            choice = scores + self.e_score_correction_bias[...]
            keep = keep_top_groups(choice, cfg.n_group, cfg.topk_group, lambda g: jax.lax.top_k(g, 2)[0].sum(-1))
            _, ids = jax.lax.top_k(jnp.where(keep, choice, -jnp.inf), k)
            weights = jnp.take_along_axis(scores, ids, axis=-1)
            if cfg.norm_topk_prob:
                weights = weights / (weights.sum(axis=-1, keepdims=True) + 1e-20)
        elif cfg.topk_method == "group_limited_greedy":
            keep = keep_top_groups(scores, cfg.n_group, cfg.topk_group, lambda g: g.max(-1))
            weights, ids = jax.lax.top_k(jnp.where(keep, scores, 0.0), k)
        else:
            weights, ids = jax.lax.top_k(scores, k)
        return weights * cfg.routed_scaling_factor, ids.astype(jnp.int32)


def build(cfg: ModelConfig, rngs: nnx.Rngs, dtype) -> CausalLM:
    layers = []
    for i in range(cfg.num_layers):
        if i < cfg.first_k_dense:
            mlp = DenseMLP(cfg.hidden_size, cfg.intermediate_size, rngs, dtype)
        else:
            mlp = MoE(cfg, DeepseekRouter(cfg, rngs), rngs, dtype)
        layers.append(DecoderLayer(cfg, MLAttention(cfg, rngs, dtype), mlp, dtype))
    return CausalLM(cfg, layers, init_mla_cache, rngs, dtype)


def checkpoint_sources(cfg: ModelConfig) -> dict[str, Source]:
    out = skeleton_sources(cfg)
    bias = cfg.attention_bias
    for i in range(cfg.num_layers):
        p, hf = f"layers.{i}", f"model.layers.{i}"
        attn, hf_attn = f"{p}.self_attn", f"{hf}.self_attn"
        if cfg.q_lora_rank is None:
            out.update(linear_sources(f"{attn}.q_proj", f"{hf_attn}.q_proj"))
        else:
            out.update(linear_sources(f"{attn}.q_a_proj", f"{hf_attn}.q_a_proj", bias))
            out[f"{attn}.q_a_layernorm.weight"] = Source.single(f"{hf_attn}.q_a_layernorm.weight")
            out.update(linear_sources(f"{attn}.q_b_proj", f"{hf_attn}.q_b_proj"))
        out.update(linear_sources(f"{attn}.kv_a_proj_with_mqa", f"{hf_attn}.kv_a_proj_with_mqa", bias))
        out[f"{attn}.kv_a_layernorm.weight"] = Source.single(f"{hf_attn}.kv_a_layernorm.weight")
        out.update(linear_sources(f"{attn}.kv_b_proj", f"{hf_attn}.kv_b_proj"))
        out.update(linear_sources(f"{attn}.o_proj", f"{hf_attn}.o_proj", bias))
        if i < cfg.first_k_dense:
            out.update(dense_mlp_sources(f"{p}.mlp", f"{hf}.mlp"))
            continue
        out.update(linear_sources(f"{p}.mlp.gate", f"{hf}.mlp.gate"))
        if cfg.topk_method == "noaux_tc":
            out[f"{p}.mlp.gate.e_score_correction_bias"] = Source.single(f"{hf}.mlp.gate.e_score_correction_bias")
        out.update(expert_sources(f"{p}.mlp.experts", f"{hf}.mlp.experts", cfg.num_experts,
                                  ("gate_proj", "up_proj", "down_proj")))
        if cfg.num_shared_experts:
            out.update(dense_mlp_sources(f"{p}.mlp.shared_experts", f"{hf}.mlp.shared_experts"))
    return out
