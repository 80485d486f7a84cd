"""Seeded random weights: determinism, the init rule, dtype and placement."""

from __future__ import annotations

import jax
import ml_dtypes
import numpy as np
from jax.sharding import SingleDeviceSharding

from pdscope_jax.weights.random_init import init_kind, random_state

SHAPES = {
    "embed.embedding": jax.ShapeDtypeStruct((64, 32), ml_dtypes.bfloat16),
    "layers.0.input_layernorm.scale": jax.ShapeDtypeStruct((32,), ml_dtypes.bfloat16),
    "layers.0.mlp.gate.e_score_correction_bias": jax.ShapeDtypeStruct((8,), np.float32),
    "layers.0.mlp.experts.gate_up": jax.ShapeDtypeStruct((8, 32, 48), ml_dtypes.bfloat16),
    "layers.0.mlp.experts.down": jax.ShapeDtypeStruct((8, 24, 32), np.float32),
    "layers.1.mlp.experts.gate_up": jax.ShapeDtypeStruct((8, 32, 48), ml_dtypes.bfloat16),
}


def cpu(path: str) -> jax.sharding.Sharding:
    return SingleDeviceSharding(jax.devices("cpu")[0])


def host(state):
    return {k: np.asarray(v) for k, v in state.items()}


def test_same_seed_same_weights_other_seed_other_weights():
    a, b, c = (host(random_state(SHAPES, seed, cpu)) for seed in (0, 0, 1))
    for path in SHAPES:
        np.testing.assert_array_equal(a[path], b[path])
    assert not np.array_equal(a["embed.embedding"], c["embed.embedding"])
    assert not np.array_equal(a["layers.0.mlp.experts.gate_up"], a["layers.1.mlp.experts.gate_up"])
    # A parameter's value depends on its path only, not on which other parameters are generated.
    alone = host(random_state({"layers.0.mlp.experts.down": SHAPES["layers.0.mlp.experts.down"]}, 0, cpu))
    np.testing.assert_array_equal(alone["layers.0.mlp.experts.down"], a["layers.0.mlp.experts.down"])


def test_init_rule_and_dtypes():
    state = random_state(SHAPES, 3, cpu)
    for path, spec in SHAPES.items():
        assert state[path].shape == spec.shape and state[path].dtype == spec.dtype
    values = host(state)
    np.testing.assert_array_equal(values["layers.0.input_layernorm.scale"], np.ones(32, ml_dtypes.bfloat16))
    np.testing.assert_array_equal(values["layers.0.mlp.gate.e_score_correction_bias"], np.zeros(8, np.float32))
    for path in ("embed.embedding", "layers.0.mlp.experts.gate_up", "layers.0.mlp.experts.down"):
        x = values[path].astype(np.float32)
        assert abs(x.mean()) < 0.003 and 0.018 < x.std() < 0.022, path
    assert [init_kind(p) for p in ("norm.scale", "layers.1.self_attn.q_norm.scale", "lm_head.kernel",
                                   "layers.2.post_norm.bias")] == ["ones", "ones", "normal", "zeros"]


def test_generated_where_placement_says():
    devices = jax.devices("cpu")

    def placement(path):
        if ".experts." in path:
            return SingleDeviceSharding(devices[1], memory_kind="pinned_host")
        return SingleDeviceSharding(devices[0])

    state = random_state(SHAPES, 0, placement)
    for path, array in state.items():
        assert array.sharding == placement(path)
    np.testing.assert_array_equal(host(state)["layers.0.mlp.experts.down"],
                                  host(random_state(SHAPES, 0, cpu))["layers.0.mlp.experts.down"])
