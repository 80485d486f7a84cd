"""Model registry and conversions between an NNX model and flat `{"a.b.c": array}` parameter dicts.

Contract:
- `build(cfg, rngs, dtype) -> CausalLM` picks the family by `cfg.model_type`.
- `checkpoint_sources(cfg)` is the family's map from parameter paths to Hugging Face tensors.
- `abstract_state(cfg, dtype)` gives `{path: jax.ShapeDtypeStruct}` through `nnx.eval_shape` (no memory).
- `to_flat(model)` / `from_flat(cfg, dtype, flat)` convert between a model and its flat parameter dict; paths
  are the NNX state paths joined with '.', the same keys the weights package reads and writes.
"""

from __future__ import annotations

import functools

from types import ModuleType

import jax
import jax.numpy as jnp
from flax import nnx

from pdscope_jax.config import ModelConfig
from pdscope_jax.models import deepseek, mixtral, qwen3_moe
from pdscope_jax.models.layers import CausalLM
from pdscope_jax.weights.spec import Source

FAMILIES: dict[str, ModuleType] = {
    "deepseek_v2": deepseek,
    "deepseek_v3": deepseek,
    "qwen3_moe": qwen3_moe,
    "mixtral": mixtral,
}


def family(cfg: ModelConfig) -> ModuleType:
    try:
        return FAMILIES[cfg.model_type]
    except KeyError:
        raise ValueError(f"no model family for model_type {cfg.model_type!r}; known: {sorted(FAMILIES)}") from None


def build(cfg: ModelConfig, rngs: nnx.Rngs, dtype=jnp.bfloat16) -> CausalLM:
    return family(cfg).build(cfg, rngs, jnp.dtype(dtype))


def checkpoint_sources(cfg: ModelConfig) -> dict[str, Source]:
    return family(cfg).checkpoint_sources(cfg)


def _path(parts: tuple) -> str:
    return ".".join(str(p) for p in parts)


def abstract_model(cfg: ModelConfig, dtype) -> CausalLM:
    """A fresh model of shapes only (ShapeDtypeStruct parameters): traced once per (cfg, dtype), then merged from
    new Variables each call (callers replace values in place: a shared Variable would carry that to the next)."""
    graphdef, state = _abstract_parts(cfg, jnp.dtype(dtype).name)
    return nnx.merge(graphdef, jax.tree.map(lambda leaf: leaf, state))


@functools.lru_cache(maxsize=8)
def _abstract_parts(cfg: ModelConfig, dtype_name: str):
    # tracing a model's construction takes about a second at real sizes, and one load asks up to three times
    return nnx.split(nnx.eval_shape(lambda: build(cfg, _OneKey(), jnp.dtype(dtype_name))))


class _OneKey:
    """Stands in for `nnx.Rngs` where only shapes are built: every stream gives one key. nnx.Rngs counts its draws
    in a Variable, and inside a trace each count's update makes flax ask the traced count for its sharding, whose
    error message walks the trace so far: quadratic in the model's size (docs/MEASUREMENTS.md)."""

    def __init__(self):
        self.key = jax.random.key(0)

    def __call__(self, *args, **kwargs):
        return self.key

    def __getattr__(self, stream: str):
        if stream.startswith("__"):
            raise AttributeError(stream)
        return self


def abstract_state(cfg: ModelConfig, dtype) -> dict[str, jax.ShapeDtypeStruct]:
    return {_path(p): v.get_value() for p, v in nnx.to_flat_state(nnx.state(abstract_model(cfg, dtype)))}


def to_flat(model: CausalLM) -> dict[str, jax.Array]:
    return {_path(p): v.get_value() for p, v in nnx.to_flat_state(nnx.state(model))}


def from_flat(cfg: ModelConfig, dtype, flat: dict[str, jax.Array]) -> CausalLM:
    """A model whose parameters are exactly `flat` (every path present, shapes as built)."""
    graphdef, state = nnx.split(abstract_model(cfg, dtype))
    flat_state = nnx.to_flat_state(state)
    expected = {_path(p) for p, _ in flat_state}
    if expected != set(flat):
        missing, extra = sorted(expected - set(flat)), sorted(set(flat) - expected)
        raise ValueError(f"parameters do not match the model: missing {missing[:10]}, unexpected {extra[:10]}")
    for p, var in flat_state:
        want, got = var.get_value(), flat[_path(p)]
        if tuple(got.shape) != tuple(want.shape):
            raise ValueError(f"{_path(p)}: shape {tuple(got.shape)}, model expects {tuple(want.shape)}")
        var.set_value(got)
    return nnx.merge(graphdef, nnx.from_flat_state(flat_state))
