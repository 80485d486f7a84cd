"""Quantized experts in the offload engine: every policy reproduces the plain model holding the same quantized
experts (float32 within 1e-4, the same tokens), through host decode, on-device decode (from per-expert arrays
and from layer stacks) and the CPU expert paths; the pool and the transfers count quantized bytes."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from pdscope_jax import models
from pdscope_jax.engine.runner import OffloadRunner
from pdscope_jax.generation.generator import Generator
from pdscope_jax.presets import preset
from pdscope_jax.quant.formats import QuantizedWeight
from pdscope_jax.runtime import RuntimeConfig

TOL = 1e-4


class QuantReference:
    def __init__(self, name: str, quant: str, prompt: int = 16, new: int = 6):
        self.cfg = preset(name).replace(expert_quant=quant)
        self.model = models.build(self.cfg, nnx.Rngs(0), jnp.float32)
        self.ids = np.random.default_rng(0).integers(0, self.cfg.vocab_size, (1, prompt)).astype(np.int32)
        self.new = new
        plain = Generator(self.model)
        self.logits = plain.logits(self.ids)
        self.tokens = plain.generate(self.ids, new).tokens

    def runner(self, policy: str, slots: int, stacks: bool = False, **rc) -> OffloadRunner:
        options = {"hot_per_layer": 2} if policy == "static" else {}
        config = RuntimeConfig(gpu_memory="1GB", expert_pool=slots * self.cfg.expert_bytes(), policy=policy,
                               policy_options=options, max_seq_len=64, **rc)
        return OffloadRunner(self.model, config, expert_stacks=stacks)

    def check(self, runner: OffloadRunner) -> None:
        np.testing.assert_allclose(runner.logits(self.ids), self.logits, atol=TOL, rtol=0)
        np.testing.assert_array_equal(runner.generate(self.ids, self.new).tokens, self.tokens)


@pytest.fixture(scope="module", params=["int8", "int4"])
def qds(request):
    return QuantReference("tiny-deepseek-v2-lite", request.param)


@pytest.mark.parametrize("policy", ["gpu", "static", "ondemand", "greedy", "fate", "pdscope"])
def test_every_policy_matches_the_quantized_plain_model(qds, policy):
    slots = qds.cfg.num_experts * len(qds.cfg.moe_layers) if policy == "gpu" else 5
    runner = qds.runner(policy, slots)
    assert isinstance(runner.pool.gate_up, QuantizedWeight) and runner.pool.gate_up.scheme.name == qds.cfg.expert_quant
    qds.check(runner)
    assert runner.store.bytes_moved % qds.cfg.expert_bytes() == 0  # transfers move whole quantized experts


@pytest.mark.parametrize("stacks", [False, True])
def test_decode_on_device_pulls_quantized_experts(qds, stacks):
    runner = qds.runner("ondemand", 5, stacks=stacks)
    qds.check(runner)
    decode = runner.stats["decode"]
    assert decode["device_steps"] == decode["steps"] == qds.new - 1
    assert decode["bytes_moved"] == decode["experts_loaded_now"] * qds.cfg.expert_bytes() > 0


@pytest.mark.parametrize("name", ["tiny-qwen3-30b-a3b", "tiny-mixtral-8x7b"])
def test_other_families_in_int4(name):
    ref = QuantReference(name, "int4")
    ref.check(ref.runner("pdscope", 5))
