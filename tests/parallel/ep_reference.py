"""The expert-parallel tests' one comparison, imported by the tests and by their child processes: a tiny float32
model of a preset, its plain logits and greedy tokens against those of its expert-parallel copy over a mesh of
the given devices (one process or several: every process builds the same model from the same seed)."""

import jax.numpy as jnp
import numpy as np
from flax import nnx

from pdscope_jax import models
from pdscope_jax.generation.generator import Generator
from pdscope_jax.parallel import expert_mesh, expert_parallel_generator
from pdscope_jax.presets import preset

FAMILIES = ("tiny-deepseek-v2-lite", "tiny-qwen3-30b-a3b", "tiny-mixtral-8x7b", "tiny-moonlight-16b-a3b")
TOL = 1e-4
BATCH, PROMPT, NEW = 2, 10, 3


def compare(name: str, devices, tokens: bool = True, seed: int = 0) -> dict:
    """{"logits_diff": max |EP - plain| over the prompt's logits, "tokens_equal": greedy tokens agree (None when
    not asked), "shard_experts": experts in each of this process's gate_up shards, "experts": E, "devices": N,
    "original_untouched": the plain model's experts still on their one device}."""
    cfg = preset(name)
    model = models.build(cfg, nnx.Rngs(seed), jnp.float32)
    ids = np.random.default_rng(seed).integers(0, cfg.vocab_size, (BATCH, PROMPT)).astype(np.int32)
    plain = Generator(model)
    mesh = expert_mesh(devices)
    ep = expert_parallel_generator(model, mesh)
    out = {"logits_diff": float(np.abs(ep.logits(ids) - plain.logits(ids)).max()), "tokens_equal": None}
    if tokens:
        out["tokens_equal"] = bool(np.array_equal(ep.generate(ids, NEW).tokens, plain.generate(ids, NEW).tokens))
    layer = next(i for i, layer in enumerate(model.layers) if layer.is_moe)
    gate_up = ep.state["layers"][layer]["mlp"]["experts"]["gate_up"].get_value()
    out["shard_experts"] = sorted({s.data.shape[0] for s in gate_up.addressable_shards})
    out["experts"], out["devices"] = cfg.num_experts, mesh.size
    out["original_untouched"] = len(model.layers[layer].mlp.experts.gate_up.get_value().devices()) == 1
    return out


def check(result: dict) -> None:
    assert result["logits_diff"] <= TOL, result
    assert result["tokens_equal"] in (True, None), result
    assert result["shard_experts"] == [result["experts"] // result["devices"]], result
    assert result["original_untouched"], result
