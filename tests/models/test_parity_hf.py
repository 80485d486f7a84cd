"""Parity with Hugging Face transformers.

End to end: the tiny checkpoints in tests/data (scripts/make_reference.py) give float32 logits within 1e-4 of
transformers' and the same 8 greedy tokens. Per block (when torch and transformers are installed): the DeepSeek
routers and the YaRN rotary parameters of the published DeepSeek-V2-Lite config.
"""

import json
from importlib import resources
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import pdscope_jax
from pdscope_jax.config import ModelConfig
from pdscope_jax.models.deepseek import DeepseekRouter, softmax_scale
from pdscope_jax.models.layers import rope_parameters
from pdscope_jax.presets import preset

DATA = Path(__file__).parents[1] / "data"
CASES = sorted(p.name for p in DATA.iterdir() if (p / "reference.npz").exists())


def test_reference_cases_present():
    assert {"deepseek_v2", "deepseek_v3", "qwen3_moe", "mixtral"} <= set(CASES)


@pytest.mark.parametrize("case", CASES)
def test_logits_and_greedy_tokens_match_transformers(case):
    ref = np.load(DATA / case / "reference.npz")
    runner = pdscope_jax.load(DATA / case, dtype="float32")
    logits = runner.logits(ref["input_ids"])
    assert np.abs(logits - ref["logits"]).max() < 1e-4
    steps = ref["greedy_tokens"].shape[1]
    np.testing.assert_array_equal(runner.generate(ref["input_ids"], max_new_tokens=steps).tokens,
                                  ref["greedy_tokens"])


def _sorted_routes(weights, ids):
    order = np.argsort(ids, axis=1)
    return np.take_along_axis(weights, order, 1), np.take_along_axis(ids, order, 1)


@pytest.mark.parametrize("method", ["greedy", "group_limited_greedy", "noaux_tc"])
def test_deepseek_router_matches_transformers(method):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    kw = dict(hidden_size=32, n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2,
              routed_scaling_factor=2.5, norm_topk_prob=method == "noaux_tc")
    if method == "noaux_tc":
        hf_cfg = transformers.DeepseekV3Config(**kw)
        router = transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3TopkRouter(hf_cfg)
        ours = preset("tiny-moonlight-16b-a3b")
    else:
        hf_cfg = transformers.DeepseekV2Config(**kw, topk_method=method)
        router = transformers.models.deepseek_v2.modeling_deepseek_v2.DeepseekV2TopkRouter(hf_cfg)
        ours = preset("tiny-deepseek-v2-lite").replace(topk_method=method)
    cfg = ours.replace(hidden_size=32, num_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2,
                       routed_scaling_factor=2.5, norm_topk_prob=method == "noaux_tc")
    rng = np.random.default_rng(0)
    kernel = rng.normal(size=(32, 16)).astype(np.float32) / 4
    h = rng.normal(size=(200, 32)).astype(np.float32)
    gate = DeepseekRouter(cfg, nnx.Rngs(0))
    gate.kernel[...] = jnp.asarray(kernel)
    with torch.no_grad():
        router.weight.copy_(torch.from_numpy(kernel.T.copy()))
        if method == "noaux_tc":
            bias = rng.normal(size=16).astype(np.float32) * 0.1
            router.e_score_correction_bias.copy_(torch.from_numpy(bias))
            gate.e_score_correction_bias[...] = jnp.asarray(bias)
        _, hf_weights, hf_ids = router(torch.from_numpy(h))
    weights, ids = gate(jnp.asarray(h))
    want_w, want_ids = _sorted_routes(hf_weights.numpy(), hf_ids.numpy())
    got_w, got_ids = _sorted_routes(np.asarray(weights), np.asarray(ids))
    np.testing.assert_array_equal(got_ids, want_ids)
    np.testing.assert_allclose(got_w, want_w, rtol=1e-5, atol=1e-7)


def test_yarn_matches_transformers_on_deepseek_v2_lite():
    pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import yarn_apply_mscale

    hf = json.loads(resources.files("pdscope_jax.presets").joinpath("deepseek-v2-lite.json").read_text())
    hf_cfg = transformers.DeepseekV2Config(**hf)
    want_freq, want_factor = ROPE_INIT_FUNCTIONS["yarn"](hf_cfg)
    cfg = ModelConfig.from_hf(hf)
    inv_freq, factor = rope_parameters(cfg, cfg.qk_rope_head_dim)
    np.testing.assert_allclose(inv_freq, want_freq.numpy(), rtol=1e-6)
    assert factor == pytest.approx(want_factor)
    want_scale = yarn_apply_mscale(hf_cfg.rope_parameters, (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5)
    assert softmax_scale(cfg) == pytest.approx(want_scale) and softmax_scale(cfg) > 1.5 * 192 ** -0.5
