import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from pdscope_jax.phaseper.predictor import (
    DeepPredictor,
    PredictorHParams,
    PredictorSet,
    build_network,
    encode_experts,
    param_bytes,
)

HP = PredictorHParams(dim=16, k=2, num_experts=8, proj_dim=8, hidden=12)


def _inputs(n, seed=0, hp=HP):
    rng = np.random.default_rng(seed)
    a = rng.normal(size=(n, hp.dim)).astype(np.float16)
    w = rng.random((n, hp.k)).astype(np.float32)
    e = np.stack([rng.choice(hp.num_experts, hp.k, replace=False) for _ in range(n)]).astype(np.int32)
    return a, w, e


def test_encode_experts_by_hand():
    w = jnp.array([[0.7, 0.3]])
    e = jnp.array([[2, 0]])
    np.testing.assert_allclose(np.asarray(encode_experts(w, e, 4)), [[0.3, 0, 0.7, 0, 1, 0, 1, 0]], rtol=1e-6)


def test_set_layout_kinds_and_shapes():
    pset = PredictorSet(HP, layers=[3, 4, 5, 6, 7, 8], groups=(2, 4), seed=0)
    assert pset.source_layers == (3, 4, 5, 6, 7)
    assert [pset.group(l) for l in pset.source_layers] == ["input", "input", "middle", "middle", "output"]
    assert [pset.kind(l) for l in pset.source_layers] == ["shallow", "shallow", "deep", "deep", "shallow"]
    assert len(pset.keys()) == 10 and pset.next_layer(5) == 6
    a, w, e = _inputs(5)
    for layer in pset.source_layers:
        probs = pset.predict("decode", layer, a, w, e)
        assert probs.shape == (5, 8) and probs.dtype == np.float32 and ((probs > 0) & (probs < 1)).all()
    # prefill and decode predictors are separate parameter sets
    assert not np.allclose(pset.predict("prefill", 3, a, w, e), pset.predict("decode", 3, a, w, e))


def test_gate_modulates_the_residual_block():
    model = build_network("deep", HP, seed=1)
    assert isinstance(model, DeepPredictor)
    a, w, e = _inputs(4)
    gated = np.asarray(model(a, w, e))
    model.gate.kernel[...] = jnp.zeros_like(model.gate.kernel[...])
    model.gate.bias[...] = jnp.full_like(model.gate.bias[...], -1e4)  # gate closed: block contributes 0
    a_n = model.stem.norm(jnp.asarray(a, jnp.float32))
    without_block = np.asarray(model.head(model.stem(a_n, w, e)) + model.stem.direct(jnp.asarray(a)))
    np.testing.assert_allclose(np.asarray(model(a, w, e)), without_block, rtol=1e-5, atol=1e-6)
    assert not np.allclose(gated, without_block)


def test_set_state_swaps_parameters():
    pset = PredictorSet(HP, layers=range(4), groups=(1, 2), seed=0)
    a, w, e = _inputs(3)
    before = pset.predict("prefill", 0, a, w, e)
    state = jax.tree.map(lambda x: x * 0, pset.state("prefill", 0))
    pset.set_state("prefill", 0, state)
    np.testing.assert_allclose(pset.predict("prefill", 0, a, w, e), 0.5)
    assert not np.allclose(before, 0.5)


@pytest.mark.parametrize("kind,lo,hi", [("shallow", 1.2, 2.0), ("deep", 2.5, 4.0)])
def test_sizes_at_full_width(kind, lo, hi):
    hp = PredictorHParams(dim=2048, k=6, num_experts=64)
    abstract = nnx.eval_shape(lambda: build_network(kind, hp, 0))
    mb = param_bytes(nnx.state(abstract)) / 2**20
    assert lo <= mb <= hi, mb


def test_padding_to_buckets_does_not_change_results():
    pset = PredictorSet(HP, layers=range(4), groups=(1, 2), seed=0)
    a, w, e = _inputs(5)
    whole = pset.predict("decode", 1, a, w, e)  # padded to 8 rows
    for i in range(5):
        np.testing.assert_allclose(pset.predict("decode", 1, a[i:i + 1], w[i:i + 1], e[i:i + 1])[0], whole[i],
                                   rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(jax.nn.sigmoid(pset.logits("decode", 1, a, w, e))), whole, rtol=1e-5)
    on_device = pset.predict("decode", 1, jnp.asarray(a), jnp.asarray(w), jnp.asarray(e))
    np.testing.assert_allclose(on_device, whole, rtol=1e-5)


def test_rejects_invalid_groups():
    with pytest.raises(ValueError, match="input_end < middle_end"):
        PredictorSet(HP, layers=range(4), groups=(2, 2))
    with pytest.raises(ValueError, match="at least 3"):
        PredictorSet(HP, layers=range(2), groups=(1, 1))


@pytest.mark.parametrize("kind", ["shallow", "deep"])
def test_the_linear_path_represents_the_next_gate(kind):
    """With the network's head at zero, the logits are the linear path's map of a itself (not normalised): a router's
    logits a @ W are one of the functions a predictor can be."""
    hp = PredictorHParams(dim=16, k=2, num_experts=8, proj_dim=8, hidden=12, linear=True)
    model = build_network(kind, hp, seed=0)
    gate = np.random.default_rng(1).normal(size=(16, 8)).astype(np.float32)
    model.head.kernel[...] = jnp.zeros_like(model.head.kernel[...])
    model.head.bias[...] = jnp.zeros_like(model.head.bias[...])
    model.stem.linear.kernel[...] = jnp.asarray(gate)
    model.stem.linear.bias[...] = jnp.zeros_like(model.stem.linear.bias[...])
    a, w, e = _inputs(4)
    np.testing.assert_allclose(np.asarray(model(a, w, e)), a.astype(np.float32) @ gate, rtol=1e-5, atol=1e-5)
    assert build_network(kind, dataclasses.replace(hp, linear=False), 0).stem.linear is None
