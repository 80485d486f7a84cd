"""`load(..., quantize=)`: the experts are quantized as they load, the plain model and the offload engine hold
the same quantized experts, and bad settings fail before any weight is read."""

import numpy as np
import pytest

import pdscope_jax
from pdscope_jax.api import check_quantizable
from pdscope_jax.presets import preset
from pdscope_jax.errors import InputError
from pdscope_jax.quant.formats import QuantizedWeight


@pytest.mark.parametrize("quant", ["int8", "int4"])
def test_plain_and_offloaded_hold_the_same_quantized_experts(quant):
    plain = pdscope_jax.load("tiny-qwen3-30b-a3b", dtype="float32", quantize=quant, compile_cache=False)
    offloaded = pdscope_jax.load("tiny-qwen3-30b-a3b", dtype="float32", quantize=quant, policy="ondemand",
                                 gpu_memory="1GB", max_seq_len=32, compile_cache=False)
    dense = pdscope_jax.load("tiny-qwen3-30b-a3b", dtype="float32", compile_cache=False)
    layer = plain.config.moe_layers[0]
    gate_up, _ = plain.model.layers[layer].mlp.experts.weights()
    assert isinstance(gate_up, QuantizedWeight) and gate_up.scheme.name == quant
    stored = offloaded.engine.store.host_weights(layer, 3)[0]
    np.testing.assert_array_equal(np.asarray(stored.q), np.asarray(gate_up.q[3]))
    # the same seed's dense weights, quantized: close to them, and not equal
    original = np.asarray(dense.model.layers[layer].mlp.experts.gate_up[...][3])
    restored = np.asarray(gate_up[3].dequantize())
    assert 0 < np.linalg.norm(restored - original) / np.linalg.norm(original) < (0.01 if quant == "int8" else 0.12)
    assert offloaded.engine.store.host_bytes == plain.config.expert_bytes() * plain.config.num_experts * len(
        plain.config.moe_layers)
    ids = np.arange(12).reshape(1, 12)
    np.testing.assert_allclose(offloaded.logits(ids), plain.logits(ids), atol=1e-4)


def test_bad_schemes_fail_before_anything_loads():
    with pytest.raises(InputError, match="quantize 'int2' is not a scheme; supported: int8, int4"):
        pdscope_jax.load("tiny-deepseek-v2-lite", quantize="int2")
    odd = preset("tiny-deepseek-v2-lite").replace(moe_intermediate_size=48)
    with pytest.raises(InputError, match="int4 needs every expert matrix's contraction size to be a multiple of 32"):
        check_quantizable(odd, "int4")
    check_quantizable(odd, "int8")  # per-channel int8 takes any size
