"""The offload engine over several accelerators against the plain model, imported by the tests and by their child
processes: a tiny float32 model of a preset, its plain logits and greedy tokens against those of `OffloadRunner`s
over `accelerators` devices, for each policy and pool size asked."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pdscope_jax import models
from pdscope_jax.engine.runner import OffloadRunner
from pdscope_jax.generation.generator import Generator
from pdscope_jax.presets import preset
from pdscope_jax.runtime import RuntimeConfig

TOL = 1e-4
POLICIES = ("gpu", "static", "ondemand", "greedy", "fate", "pdscope")


def pools(cfg, accelerators: int) -> dict[str, int]:
    """Slots per accelerator: few (evictions, CPU experts), two layers of the share (double buffering), all."""
    share = cfg.num_experts // accelerators
    return {"small": 3, "double": 2 * share + 2, "all": share * len(cfg.moe_layers)}


def compare(name: str, accelerators: int, cases, batch: int = 1, prompt: int = 20, new: int = 5,
            quant: str | None = None, seed: int = 0, **rc) -> list[dict]:
    """Per (policy, pool name) in `cases`: {"policy", "pool", "logits_diff": max |engine - plain| over the prompt,
    "tokens_equal", "accelerators": the engine's count, "devices": its shards' device ids, "shard_experts": experts
    per layer of each shard's pool, "owned": {layer: each shard's experts (the model's ids)}, "host_bytes": each
    shard's host copies, "bytes_moved": each accelerator's copies in the generation,
    "decode_steps" / "device_steps": host-planned and one-program decode steps, "accelerator_moves": plans the
    cross-accelerator balance changed (`sched.across`)}."""
    cfg = preset(name)
    if quant is not None:
        cfg = cfg.replace(expert_quant=quant)
    model = models.build(cfg, nnx.Rngs(seed), jnp.float32)
    ids = np.random.default_rng(seed).integers(0, cfg.vocab_size, (batch, prompt)).astype(np.int32)
    plain = Generator(model)
    logits, tokens = plain.logits(ids), plain.generate(ids, new).tokens
    sizes = pools(cfg, accelerators)
    out = []
    for policy, pool in cases:
        options = {"hot_per_layer": 1} if policy == "static" else {}
        config = RuntimeConfig(gpu_memory="1GB", expert_pool=sizes[pool] * cfg.expert_bytes(4), policy=policy,
                               policy_options=options, max_seq_len=64, max_batch=batch, **rc)
        runner = OffloadRunner(model, config, accelerators=accelerators)
        result = {"policy": policy, "pool": pool,
                  "logits_diff": float(np.abs(runner.logits(ids) - logits).max()),
                  "tokens_equal": bool(np.array_equal(runner.generate(ids, new).tokens, tokens))}
        stats = runner.stats
        result.update(accelerators=stats["accelerators"],
                      devices=[jax.tree.leaves(shard.pool.gate_up)[0].devices().pop().id for shard in runner.shards],
                      shard_experts=[shard.pool.num_experts for shard in runner.shards],
                      owned={layer: [shard.experts[layer].tolist() for shard in runner.shards]
                             for layer in cfg.moe_layers},
                      host_bytes=[shard.store.host_bytes for shard in runner.shards],
                      bytes_moved=[a["bytes_moved"] for a in stats["per_accelerator"]],
                      decode_steps=stats["decode"]["steps"], device_steps=stats["decode"]["device_steps"],
                      accelerator_moves=sum(stats[p]["accelerator_moves"] for p in ("prefill", "decode")))
        out.append(result)
    return out


def check(result: dict, accelerators: int, experts: int) -> None:
    """The engine gave the plain model's numbers, its experts split evenly over `accelerators` distinct devices."""
    where = f"{result['policy']} ({result['pool']} pool)"
    assert result["logits_diff"] <= TOL, where
    assert result["tokens_equal"], where
    assert result["accelerators"] == accelerators, where
    assert len(set(result["devices"])) == accelerators, where
    assert result["shard_experts"] == [experts // accelerators] * accelerators, where
    assert len(set(result["host_bytes"])) == 1, where  # each accelerator's host copies: an equal share
    if accelerators > 1:
        assert result["device_steps"] == 0, where  # one-program decode runs on one accelerator only

