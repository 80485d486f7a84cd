"""Layers shared by every MoE family: norms, rotary embeddings, attention, MLPs, MoE block, decoder skeleton.

Contract:
- Routed-expert math lives in `models.experts`; `expert_ffn` and `combine_experts` are re-exported here, and
  `MoE.routed_output` runs `combine_experts` with `slot_of = None`: expert e in slot e (the offload engine passes
  its slot maps).
- `DecoderLayer` exposes `attend`, `mlp_input`, `is_moe` and `mlp`; `MoE` exposes `route`, `shared_output`,
  `routed_output` and `experts.weights()` (docs/ARCHITECTURE.md). Families plug in their attention and router.
- Weights are stored as [in, out] (`x @ W`); parameter names follow the Hugging Face module names so the
  checkpoint maps stay readable. Nothing here reads files or knows a family by name.

Letters: B batch, T tokens, S cached positions, N flattened tokens, D hidden, V vocab, H heads, G query heads
per kv head, E routed experts, K top-k, F expert intermediate.
"""

from __future__ import annotations

import functools
import math
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pdscope_jax.config import ModelConfig
from pdscope_jax.kernels import gather_matvec
from pdscope_jax.quant.formats import QuantizedWeight, quantize, scheme
from pdscope_jax.weights.spec import Source
from pdscope_jax.models.cache import KVCache, init_kv_cache, update_cache
from pdscope_jax.models.experts import F32, combine_experts, expert_ffn  # noqa: F401 (expert_ffn re-exported)


DENSE_KERNEL_MAX_ROWS = 4  # the kernel reads the weights once per row: beyond a few rows XLA's matmul wins


class Linear(nnx.Linear):
    """nnx.Linear whose products of at most DENSE_KERNEL_MAX_ROWS rows (decode) run through
    `kernels.gather_matvec` on a CUDA GPU, which reads the weights once where XLA's one-row product reaches a
    fraction of the memory's speed; other shapes and backends run nnx.Linear itself. Same parameters, same
    rounding (float32 sums, one rounding to `dtype`)."""

    def takes_kernel(self, rows: int) -> bool:
        """Whether a product of `rows` rows runs through the kernel (on a CUDA GPU)."""
        kernel = self.kernel[...]
        return (rows <= DENSE_KERNEL_MAX_ROWS and kernel.dtype == jnp.dtype(self.dtype)
                and gather_matvec.supported(rows, *kernel.shape, kernel.dtype))

    def __call__(self, x: jax.Array) -> jax.Array:
        kernel = self.kernel[...]
        rows = math.prod(x.shape[:-1])
        if not self.takes_kernel(rows):
            return super().__call__(x)

        def in_place(x, kernel):
            y = gather_matvec.gather_matvec(x.reshape(rows, -1), kernel[None], jnp.zeros(rows, jnp.int32))
            y = y.astype(self.dtype).reshape(*x.shape[:-1], -1)
            return y if self.bias is None else y + self.bias[...]

        return gather_matvec.on_gpu(in_place, lambda x, _: nnx.Linear.__call__(self, x), x, kernel)


def linear(d_in: int, d_out: int, rngs: nnx.Rngs, dtype, bias: bool = False) -> Linear:
    return Linear(d_in, d_out, use_bias=bias, dtype=dtype, param_dtype=dtype, rngs=rngs)


class RMSNorm(nnx.Module):
    """x * rsqrt(mean(x^2) + eps) in float32, cast back to x's dtype, then times the weight."""

    def __init__(self, dim: int, eps: float, dtype):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(F32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return self.weight[...] * normed.astype(x.dtype)


# ---- rotary embeddings -------------------------------------------------------------------------------------
def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


@functools.lru_cache(maxsize=None)
def rope_parameters(cfg: ModelConfig, dim: int) -> tuple[np.ndarray, float]:
    """(inv_freq float32 [dim/2], attention_factor): plain RoPE, or YaRN when the config says so.

    YaRN blends interpolated and extrapolated frequencies with a linear ramp between the correction dims of
    beta_fast / beta_slow rotations, and scales cos/sin by the attention factor (mscale ratio).
    """
    base = np.float32(cfg.rope_theta)
    pos_freqs = base ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim))
    extrapolation = (1.0 / pos_freqs).astype(np.float32)
    scaling = cfg.rope_scaling_dict
    if scaling is None:
        return extrapolation, 1.0
    original_max = scaling.get("original_max_position_embeddings", cfg.max_position_embeddings)
    factor = scaling.get("factor") or cfg.max_position_embeddings / original_max
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = yarn_get_mscale(factor, mscale) / yarn_get_mscale(factor, mscale_all_dim)
        else:
            attention_factor = yarn_get_mscale(factor)
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original_max / (rotations * 2 * math.pi)) / (2 * math.log(cfg.rope_theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
    extrapolation_weight = (1 - ramp).astype(np.float32)
    interpolation = (1.0 / (np.float32(factor) * pos_freqs)).astype(np.float32)
    inv_freq = interpolation * (1 - extrapolation_weight) + extrapolation * extrapolation_weight
    return inv_freq.astype(np.float32), float(attention_factor)


def rope_cos_sin(cfg: ModelConfig, dim: int, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """cos, sin float32 [B, T, dim/2] for integer positions [B, T]."""
    inv_freq, attention_factor = rope_parameters(cfg, dim)
    angles = positions.astype(F32)[..., None] * jnp.asarray(inv_freq)  # [B, T, dim/2]
    return jnp.cos(angles) * attention_factor, jnp.sin(angles) * attention_factor


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array, interleaved: bool) -> jax.Array:
    """Rotate x [B, T, H, dim] by cos/sin [B, T, dim/2].

    `interleaved=False` pairs dimension i with i + dim/2 (Llama layout); `interleaved=True` pairs 2i with 2i+1
    (DeepSeek layout) and returns the rotated pairs as [all first members, all second members]. That output
    permutation is the same for queries and keys, so their dot products are unchanged.
    """
    xf = x.astype(F32)
    if interleaved:
        x1, x2 = xf[..., 0::2], xf[..., 1::2]
    else:
        half = x.shape[-1] // 2
        x1, x2 = xf[..., :half], xf[..., half:]
    c, s = cos[:, :, None, :], sin[:, :, None, :]
    return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(x.dtype)


# ---- attention ---------------------------------------------------------------------------------------------
def causal_mask(q_positions: jax.Array, k_positions: jax.Array) -> jax.Array:
    """[B, T, S] True where key position <= query position."""
    return k_positions[:, None, :] <= q_positions[:, :, None]


def attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, scale: float) -> jax.Array:
    """Grouped-query attention. q [B,T,H,Dk], k [B,S,Hkv,Dk], v [B,S,Hkv,Dv], mask [B,T,S] -> [B,T,H,Dv].

    Query head h reads kv head h // (H / Hkv). Scores and softmax are float32.
    """
    b, t, h, dk = q.shape
    hkv = k.shape[2]
    qg = q.reshape(b, t, hkv, h // hkv, dk)  # [B, T, Hkv, G, Dk]
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=F32) * scale  # [B, Hkv, G, T, S]
    scores = jnp.where(mask[:, None, None], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v, preferred_element_type=F32)  # [B, T, Hkv, G, Dv]
    return out.reshape(b, t, h, v.shape[-1]).astype(q.dtype)


class GQAAttention(nnx.Module):
    """Multi-head attention with grouped kv heads, Llama-layout RoPE and optional per-head q/k RMSNorm."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, dtype):
        d, h, hkv, dh = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.cfg = cfg
        self.q_proj = linear(d, h * dh, rngs, dtype, cfg.attention_bias)
        self.k_proj = linear(d, hkv * dh, rngs, dtype, cfg.attention_bias)
        self.v_proj = linear(d, hkv * dh, rngs, dtype, cfg.attention_bias)
        self.o_proj = linear(h * dh, d, rngs, dtype, cfg.attention_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(dh, cfg.rms_norm_eps, dtype)
            self.k_norm = RMSNorm(dh, cfg.rms_norm_eps, dtype)

    def __call__(self, x: jax.Array, positions: jax.Array, cache: KVCache | None):
        cfg = self.cfg
        b, t, _ = x.shape
        q = self.q_proj(x).reshape(b, t, cfg.num_heads, cfg.head_dim)
        k = self.k_proj(x).reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
        v = self.v_proj(x).reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
        if cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = rope_cos_sin(cfg, cfg.head_dim, positions)
        q, k = apply_rope(q, cos, sin, interleaved=False), apply_rope(k, cos, sin, interleaved=False)
        if cache is None:
            k_pos = positions
        else:
            cache, k_pos = update_cache(cache, (k, v), positions)
            k, v = cache
        out = attention(q, k, v, causal_mask(positions, k_pos), cfg.head_dim**-0.5)
        return self.o_proj(out.reshape(b, t, -1)), cache


# ---- MLPs and the MoE block -------------------------------------------------------------------------------
class DenseMLP(nnx.Module):
    """SwiGLU MLP with separate gate/up/down projections (dense layers and shared experts). Products of at most
    DENSE_KERNEL_MAX_ROWS rows run on a CUDA GPU as two `kernels.gather_matvec` calls where it takes the shapes:
    gate and up in one call, the activation computed by the down call (gate and up summed in float32 until the
    activation is rounded, where the three projections' own path rounds each to the model's dtype first)."""

    def __init__(self, d: int, f: int, rngs: nnx.Rngs, dtype):
        self.gate_proj = linear(d, f, rngs, dtype)
        self.up_proj = linear(d, f, rngs, dtype)
        self.down_proj = linear(f, d, rngs, dtype)

    def _projections(self, x: jax.Array) -> jax.Array:
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))

    def __call__(self, x: jax.Array) -> jax.Array:
        projections = (self.gate_proj, self.up_proj, self.down_proj)
        gate, up, down = (p.kernel[...] for p in projections)
        rows, d = math.prod(x.shape[:-1]), gate.shape[0]
        if not all(p.bias is None and p.takes_kernel(rows) for p in projections):
            return self._projections(x)

        def in_place(x, gate, up, down):
            picks = jnp.zeros(rows, jnp.int32)
            y = gather_matvec.swiglu_ffn(x.reshape(rows, d), (gate[None], up[None]), down[None], picks)
            return y.astype(self.down_proj.dtype).reshape(*x.shape[:-1], d)

        return gather_matvec.on_gpu(in_place, lambda x, *_: self._projections(x), x, gate, up, down)


class Experts(nnx.Module):
    """Routed experts of one layer, stacked: gate_up [E, D, 2F] (gate columns first), down [E, F, D]. Quantized
    (`quant`, a `quant.formats` scheme name) each is stored as integers (`gate_up`, `down`) and scales
    (`gate_up_scale`, `down_scale`); `weights()` gives (gate_up, down) as arrays or QuantizedWeights whose compute
    dtype is the model's."""

    def __init__(self, num_experts: int, d: int, f: int, rngs: nnx.Rngs, dtype, quant: str | None = None):
        init = nnx.initializers.normal(0.02)
        self.quant, self.dtype = quant, jnp.dtype(dtype)
        gate_up = init(rngs.params(), (num_experts, d, 2 * f), dtype)
        down = init(rngs.params(), (num_experts, f, d), dtype)
        if quant is None:
            self.gate_up, self.down = nnx.Param(gate_up), nnx.Param(down)
            return
        gate_up, down = quantize(gate_up, quant), quantize(down, quant)
        self.gate_up, self.gate_up_scale = nnx.Param(gate_up.q), nnx.Param(gate_up.scale)
        self.down, self.down_scale = nnx.Param(down.q), nnx.Param(down.scale)

    def weights(self) -> tuple:
        if self.quant is None:
            return self.gate_up[...], self.down[...]
        s = scheme(self.quant)
        return (QuantizedWeight(self.gate_up[...], self.gate_up_scale[...], s, self.dtype),
                QuantizedWeight(self.down[...], self.down_scale[...], s, self.dtype))


# ---- routing math ------------------------------------------------------------------------------------------
def router_logits(h: jax.Array, kernel: jax.Array) -> jax.Array:
    """h [N, D] @ kernel [D, E] in float32 -> [N, E]."""
    return jnp.dot(h.astype(F32), kernel.astype(F32), preferred_element_type=F32)


def softmax_topk(logits: jax.Array, k: int, normalize: bool) -> tuple[jax.Array, jax.Array]:
    """Softmax over experts, top-k, optionally renormalised to sum 1. -> (weights [N,K] f32, ids [N,K] int32)."""
    weights, ids = jax.lax.top_k(jax.nn.softmax(logits.astype(F32), axis=-1), k)
    if normalize:
        weights = weights / weights.sum(axis=-1, keepdims=True)
    return weights, ids.astype(jnp.int32)


def keep_top_groups(scores: jax.Array, n_group: int, topk_group: int,
                    group_score: Callable[[jax.Array], jax.Array]) -> jax.Array:
    """[N, E] -> [N, E] bool: experts whose group is among the topk_group best by `group_score` ([N,G,E/G] -> [N,G])."""
    n, e = scores.shape
    per_group = group_score(scores.reshape(n, n_group, e // n_group))  # [N, G]
    _, best = jax.lax.top_k(per_group, topk_group)
    keep = jnp.zeros((n, n_group), bool).at[jnp.arange(n)[:, None], best].set(True)
    return jnp.repeat(keep, e // n_group, axis=1)


class SoftmaxTopkRouter(nnx.Module):
    """Softmax over all experts, top-k, renormalised when `norm_topk_prob` (Qwen3-MoE, Mixtral)."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, dtype):
        self.k, self.normalize = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.kernel = nnx.Param(nnx.initializers.normal(0.02)(rngs.params(), (cfg.hidden_size, cfg.num_experts), dtype))

    def __call__(self, h: jax.Array) -> tuple[jax.Array, jax.Array]:
        return softmax_topk(router_logits(h, self.kernel[...]), self.k, self.normalize)


class MoE(nnx.Module):
    """Routed experts plus optional shared experts. `gate` is the family's router: h [N,D] -> (weights, ids)."""

    def __init__(self, cfg: ModelConfig, gate: nnx.Module, rngs: nnx.Rngs, dtype):
        self.num_experts = cfg.num_experts
        self.gate = gate
        self.experts = Experts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, rngs, dtype,
                               cfg.expert_quant)
        self.has_shared = cfg.num_shared_experts > 0
        if self.has_shared:
            f_shared = cfg.moe_intermediate_size * cfg.num_shared_experts
            self.shared_experts = DenseMLP(cfg.hidden_size, f_shared, rngs, dtype)

    def route(self, h: jax.Array) -> tuple[jax.Array, jax.Array]:
        return self.gate(h)

    def shared_output(self, h: jax.Array) -> jax.Array:
        return self.shared_experts(h) if self.has_shared else jnp.zeros_like(h)

    def routed_output(self, h: jax.Array, weights: jax.Array, expert_ids: jax.Array) -> jax.Array:
        return combine_experts(h, weights, expert_ids, *self.experts.weights(), None)  # expert e in slot e

    def __call__(self, x: jax.Array) -> jax.Array:
        h = x.reshape(-1, x.shape[-1])  # [N, D]
        weights, ids = self.route(h)
        return (self.routed_output(h, weights, ids) + self.shared_output(h)).reshape(x.shape)


# ---- decoder skeleton --------------------------------------------------------------------------------------
class DecoderLayer(nnx.Module):
    """Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg: ModelConfig, self_attn: nnx.Module, mlp: nnx.Module, dtype):
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.self_attn = self_attn
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.mlp = mlp
        self.is_moe = isinstance(mlp, MoE)

    def attend(self, x: jax.Array, positions: jax.Array, layer_cache):
        out, layer_cache = self.self_attn(self.input_layernorm(x), positions, layer_cache)
        return x + out, layer_cache

    def mlp_input(self, x: jax.Array) -> jax.Array:
        return self.post_attention_layernorm(x)

    def __call__(self, x: jax.Array, positions: jax.Array, layer_cache):
        x, layer_cache = self.attend(x, positions, layer_cache)
        return x + self.mlp(self.mlp_input(x)), layer_cache


class CausalLM(nnx.Module):
    """Embedding, decoder layers, final norm, lm_head (absent when tied to the embedding).

    `__call__(input_ids [B,T], positions [B,T], cache=None) -> (logits [B,T,V] float32, cache)`; without a
    cache it is a causal full-sequence forward and returns None for the cache. Caches hold one entry per layer
    and store position p at index p.
    """

    def __init__(self, cfg: ModelConfig, layers: list[DecoderLayer], init_layer_cache, rngs: nnx.Rngs, dtype):
        self.config = cfg
        self.embed = nnx.Embed(cfg.vocab_size, cfg.hidden_size, dtype=dtype, param_dtype=dtype, rngs=rngs)
        self.layers = nnx.List(layers)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        if not cfg.tie_word_embeddings:
            self.lm_head = linear(cfg.hidden_size, cfg.vocab_size, rngs, dtype)
        self._init_layer_cache = init_layer_cache

    def init_cache(self, batch: int, max_len: int, dtype) -> tuple:
        return tuple(self._init_layer_cache(self.config, batch, max_len, dtype) for _ in self.layers)

    def logits(self, x: jax.Array) -> jax.Array:
        """Final hidden states [B,T,D] -> float32 logits [B,T,V]."""
        h = self.norm(x)
        w = self.embed.embedding[...].T if self.config.tie_word_embeddings else self.lm_head.kernel[...]
        return jnp.dot(h, w, preferred_element_type=F32)

    def hidden(self, input_ids: jax.Array, positions: jax.Array, cache=None):
        """Embedding and decoder layers: -> (hidden states [B,T,D] before the final norm, cache)."""
        x = self.embed(input_ids)
        new_cache = []
        for i, layer in enumerate(self.layers):
            x, layer_cache = layer(x, positions, None if cache is None else cache[i])
            new_cache.append(layer_cache)
        return x, None if cache is None else tuple(new_cache)

    def __call__(self, input_ids: jax.Array, positions: jax.Array, cache=None):
        x, cache = self.hidden(input_ids, positions, cache)
        return self.logits(x), cache


# ---- checkpoint maps ---------------------------------------------------------------------------------------
def linear_sources(path: str, hf: str, bias: bool = False) -> dict[str, Source]:
    """nnx.Linear at `path` from the HF nn.Linear `hf` ([out, in] -> [in, out])."""
    out = {f"{path}.kernel": Source.single(f"{hf}.weight", transpose=True)}
    if bias:
        out[f"{path}.bias"] = Source.single(f"{hf}.bias")
    return out


def expert_sources(path: str, hf: str, num_experts: int, names: tuple[str, str, str]) -> dict[str, Source]:
    """Stacked experts at `path` from per-expert HF linears `hf.E.{gate,up,down}` named by `names`."""
    gate, up, down = names
    return {
        f"{path}.gate_up": Source.stack(
            [(f"{hf}.{e}.{gate}.weight", f"{hf}.{e}.{up}.weight") for e in range(num_experts)], transpose=True),
        f"{path}.down": Source.stack([(f"{hf}.{e}.{down}.weight",) for e in range(num_experts)], transpose=True),
    }


def dense_mlp_sources(path: str, hf: str) -> dict[str, Source]:
    out: dict[str, Source] = {}
    for name in ("gate_proj", "up_proj", "down_proj"):
        out.update(linear_sources(f"{path}.{name}", f"{hf}.{name}"))
    return out


def skeleton_sources(cfg: ModelConfig) -> dict[str, Source]:
    """Embedding, final norm, lm_head and each layer's two RMSNorms (same HF names in every family)."""
    out = {"embed.embedding": Source.single("model.embed_tokens.weight"),
           "norm.weight": Source.single("model.norm.weight")}
    if not cfg.tie_word_embeddings:
        out.update(linear_sources("lm_head", "lm_head"))
    for i in range(cfg.num_layers):
        for norm in ("input_layernorm", "post_attention_layernorm"):
            out[f"layers.{i}.{norm}.weight"] = Source.single(f"model.layers.{i}.{norm}.weight")
    return out


def build_gqa_moe(cfg: ModelConfig, rngs: nnx.Rngs, dtype) -> CausalLM:
    """Every layer GQA attention + a softmax top-k routed MoE (Qwen3-MoE, Mixtral; q/k norms per cfg.qk_norm)."""
    layers = [
        DecoderLayer(cfg, GQAAttention(cfg, rngs, dtype),
                     MoE(cfg, SoftmaxTopkRouter(cfg, rngs, dtype), rngs, dtype), dtype)
        for _ in range(cfg.num_layers)
    ]
    return CausalLM(cfg, layers, init_kv_cache, rngs, dtype)


def gqa_moe_sources(cfg: ModelConfig, moe: str, expert_names: tuple[str, str, str]) -> dict[str, Source]:
    """HF keys of a `build_gqa_moe` model whose MoE block is `model.layers.L.<moe>` with experts `E.<names>`."""
    out = skeleton_sources(cfg)
    for i in range(cfg.num_layers):
        p, hf = f"layers.{i}", f"model.layers.{i}"
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            out.update(linear_sources(f"{p}.self_attn.{name}", f"{hf}.self_attn.{name}", cfg.attention_bias))
        if cfg.qk_norm:
            for name in ("q_norm", "k_norm"):
                out[f"{p}.self_attn.{name}.weight"] = Source.single(f"{hf}.self_attn.{name}.weight")
        out.update(linear_sources(f"{p}.mlp.gate", f"{hf}.{moe}.gate"))
        out.update(expert_sources(f"{p}.mlp.experts", f"{hf}.{moe}.experts", cfg.num_experts, expert_names))
    return out
