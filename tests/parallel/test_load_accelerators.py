"""`load(..., accelerators=N)` and `pdscope-jax generate --accelerators N`: the whole model over N of the suite's
two CPU devices, routed experts split E/N per device, gives the one-device model's logits and tokens (float32,
1e-4); settings that cannot work are refused before any weight is read, each problem named (the offload engine over
several accelerators: test_offload_accelerators.py)."""

import jax
import numpy as np
import pytest

import pdscope_jax
from pdscope_jax.cli import generate as generate_cli
from pdscope_jax.errors import InputError

MODEL = "tiny-deepseek-v2-lite"
IDS = np.random.default_rng(0).integers(0, 256, (2, 7)).astype(np.int32)


@pytest.fixture(scope="module")
def one_device():
    return pdscope_jax.load(MODEL, dtype="float32", compile_cache=False)


def test_two_accelerators_give_the_one_device_models_logits_and_tokens(one_device):
    split = pdscope_jax.load(MODEL, dtype="float32", compile_cache=False, accelerators=2)
    np.testing.assert_allclose(split.logits(IDS), one_device.logits(IDS), atol=1e-4, rtol=0)
    np.testing.assert_array_equal(split.generate(IDS, 6).tokens, one_device.generate(IDS, 6).tokens)
    for layer in split.model.layers:
        if layer.is_moe:  # each device holds E/2 experts of the layer
            shards = layer.mlp.experts.gate_up.get_value().addressable_shards
            assert sorted(s.device.id for s in shards) == [d.id for d in jax.devices()[:2]]
            assert {s.data.shape[0] for s in shards} == {split.config.num_experts // 2}


def test_one_accelerator_is_the_plain_model(one_device):
    runner = pdscope_jax.load(MODEL, dtype="float32", compile_cache=False, accelerators=1)
    np.testing.assert_array_equal(runner.logits(IDS), one_device.logits(IDS))


@pytest.mark.parametrize("kwargs, message", [
    (dict(accelerators=3), r"accelerators=3, but this process sees 2 device\(s\)"),
    (dict(accelerators=0), "accelerators must be a positive integer"),
    (dict(accelerators=3, policy="pdscope"), r"accelerators=3, but this process sees 2 device\(s\)"),
])
def test_impossible_accelerator_settings_are_named(kwargs, message):
    with pytest.raises(InputError, match=message):
        pdscope_jax.load(MODEL, dtype="float32", compile_cache=False, **kwargs)


def test_generate_cli_runs_the_split_model(capsys, one_device):
    assert generate_cli.main([MODEL, "--dtype", "float32", "--ids", "5,6,7", "--new-tokens", "4",
                              "--accelerators", "2"]) == 0
    printed = capsys.readouterr().out.splitlines()[0]
    expected = one_device.generate(np.array([[5, 6, 7]], np.int32), 4).tokens[0]
    assert printed == ",".join(str(t) for t in expected)
