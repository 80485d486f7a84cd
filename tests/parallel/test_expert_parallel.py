"""Expert parallelism (pdscope_jax.parallel) on the suite's two CPU devices: every family's logits and greedy
tokens equal the plain model's (float32, 1e-4), each device holding E/2 experts; int8 experts split with their
scales; indivisible E and a mesh without the "experts" axis are refused."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ep_reference import FAMILIES, TOL, check, compare
from pdscope_jax import models
from pdscope_jax.generation.generator import Generator
from pdscope_jax.parallel import ExpertParallelError, expert_mesh, expert_parallel, expert_parallel_generator
from pdscope_jax.presets import preset


@pytest.mark.parametrize("name", FAMILIES)
def test_two_devices_match_plain_model(name):
    devices = jax.devices("cpu")
    assert len(devices) == 2  # tests/conftest.py
    check(compare(name, devices))


def test_quantized_experts_split_with_their_scales():
    cfg = preset("tiny-qwen3-30b-a3b").replace(expert_quant="int8")
    model = models.build(cfg, nnx.Rngs(0), jnp.float32)
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (1, 8)).astype(np.int32)
    ep = expert_parallel_generator(model, expert_mesh(jax.devices("cpu")))
    np.testing.assert_allclose(ep.logits(ids), Generator(model).logits(ids), atol=TOL, rtol=0)
    experts = ep.state["layers"][0]["mlp"]["experts"]
    for name in ("gate_up", "gate_up_scale", "down", "down_scale"):
        assert {s.data.shape[0] for s in experts[name].get_value().addressable_shards} == {cfg.num_experts // 2}


def test_indivisible_experts_are_refused():
    cfg = preset("tiny-qwen3-30b-a3b").replace(num_experts=5)
    model = models.build(cfg, nnx.Rngs(0), jnp.float32)
    with pytest.raises(ExpertParallelError, match=r"E=5 .* N=2 devices .*use N in \[1, 5\]"):
        expert_parallel(model, expert_mesh(jax.devices("cpu")))


def test_mesh_without_expert_axis_is_refused():
    model = models.build(preset("tiny-mixtral-8x7b"), nnx.Rngs(0), jnp.float32)
    mesh = jax.sharding.Mesh(jax.devices("cpu"), ("data",))
    with pytest.raises(ExpertParallelError, match="one named 'experts'"):
        expert_parallel(model, mesh)
