"""Key/value caches, one entry per decoder layer, preallocated to a fixed length.

Contract: a cache is a tuple (one entry per layer) of NamedTuples of arrays, so it is a pytree that jit can
donate. Position p of every sequence lives at index p; entries past the written positions hold zeros and the
attention mask (key index <= query position) hides them.
- `KVCache` (GQA families): k, v [B, S, Hkv, Dh].
- `MLACache` (DeepSeek): the compressed latent after its RMSNorm [B, S, R] and the rotated shared rope key
  [B, S, Dr]; per-head keys and values are re-expanded from the latent when attending, never stored.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from pdscope_jax.config import ModelConfig


class KVCache(NamedTuple):
    k: jax.Array  # [B, S, Hkv, Dh]
    v: jax.Array  # [B, S, Hkv, Dh]


class MLACache(NamedTuple):
    latent: jax.Array  # [B, S, R]
    k_rope: jax.Array  # [B, S, Dr]


def init_kv_cache(cfg: ModelConfig, batch: int, max_len: int, dtype) -> KVCache:
    shape = (batch, max_len, cfg.num_kv_heads, cfg.head_dim)
    return KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))


def init_mla_cache(cfg: ModelConfig, batch: int, max_len: int, dtype) -> MLACache:
    return MLACache(jnp.zeros((batch, max_len, cfg.kv_lora_rank), dtype),
                    jnp.zeros((batch, max_len, cfg.qk_rope_head_dim), dtype))


def update_cache(cache, new: tuple[jax.Array, ...], positions: jax.Array):
    """Write each new [B, T, ...] array into the matching buffer of `cache` (a KVCache or MLACache) at the rows'
    positions [B, T]. Returns (the updated cache, key positions [B, S] of every cached index)."""
    cache = type(cache)(*(write_cache(buffer, x, positions) for buffer, x in zip(cache, new, strict=True)))
    b, s = cache[0].shape[:2]
    return cache, jnp.broadcast_to(jnp.arange(s, dtype=positions.dtype), (b, s))


def write_cache(buffer: jax.Array, new: jax.Array, positions: jax.Array) -> jax.Array:
    """Write new [B, T, ...] into buffer [B, S, ...] at each row's first position (positions [B, T])."""

    def write_row(buf, rows, start):
        return jax.lax.dynamic_update_slice_in_dim(buf, rows.astype(buf.dtype), start, axis=0)

    return jax.vmap(write_row)(buffer, new, positions[:, 0])
