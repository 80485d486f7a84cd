import json
import math
from pathlib import Path

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file

from pdscope_jax import models
from pdscope_jax.config import ModelConfig
from pdscope_jax.phaseper.collect import Walk
from pdscope_jax.presets import preset
from pdscope_jax.weights.checkpoint import load_state, open_checkpoint
from script_import import import_script

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "train_reference_moe.py"


@pytest.fixture(scope="module")
def script():
    """The entry point, loaded by path; loading it puts scripts/ on sys.path for its stages `reference_moe`."""
    return import_script(SCRIPT)


@pytest.fixture(scope="module")
def train(script):
    return script.train


@pytest.fixture(scope="module")
def checkpoint(script):
    return script.checkpoint


def test_reference_config_meets_the_brief(script):
    cfg = ModelConfig.from_hf(script.REFERENCE_CONFIG)
    assert cfg.model_type == "deepseek_v2" and cfg.uses_mla and cfg.kv_lora_rank > 0
    assert len(cfg.moe_layers) >= 12 and cfg.num_experts >= 32 and cfg.num_experts_per_tok >= 4
    assert cfg.num_shared_experts > 0
    shapes = models.abstract_state(cfg, jnp.bfloat16)
    nbytes = sum(math.prod(s.shape) * 2 for s in shapes.values())
    assert nbytes <= 40e6


@pytest.mark.parametrize("name", ["tiny-deepseek-v2-lite", "tiny-qwen3-30b-a3b"])
def test_hf_tensors_is_the_inverse_of_checkpoint_sources(checkpoint, tmp_path, name):
    cfg = preset(name)
    flat = {k: np.asarray(v) for k, v in models.to_flat(models.build(cfg, nnx.Rngs(3), jnp.float32)).items()}
    tensors = checkpoint.hf_tensors(cfg, flat, dtype=np.float32)
    if cfg.model_type == "deepseek_v2":
        layer = cfg.moe_layers[0]
        f, d = cfg.moe_intermediate_size, cfg.hidden_size
        assert tensors[f"model.layers.{layer}.mlp.experts.0.gate_proj.weight"].shape == (f, d)  # [out, in]
        assert tensors[f"model.layers.{layer}.mlp.experts.{cfg.num_experts - 1}.down_proj.weight"].shape == (d, f)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    shapes = models.abstract_state(cfg, jnp.float32)
    loaded = load_state(open_checkpoint(tmp_path), models.checkpoint_sources(cfg), shapes, lambda path: None)
    assert set(loaded) == set(flat)
    for path, value in flat.items():
        np.testing.assert_array_equal(np.asarray(loaded[path]), value, err_msg=path)


def test_balance_loss_is_one_when_uniform_and_e_over_k_when_collapsed(train):
    cfg = preset("tiny-deepseek-v2-lite")
    model = models.build(cfg, nnx.Rngs(0), jnp.float32)
    e, k, d, n = cfg.num_experts, cfg.num_experts_per_tok, cfg.hidden_size, 16
    m = len(cfg.moe_layers)
    u = np.zeros((d,), np.float32)
    u[0] = 1.0
    a = jnp.broadcast_to(jnp.asarray(u), (m, n, d))
    top = jnp.broadcast_to(jnp.arange(k, dtype=jnp.int32), (m, n, k))
    walked = Walk(None, None, a, jnp.full((m, n, k), 1.0 / k), top)
    moe = [layer.mlp for layer in model.layers if layer.is_moe]
    for mlp in moe:
        mlp.gate.kernel[...] = jnp.zeros((d, e), jnp.float32)
    assert float(train.balance_loss(model, walked, e)) == pytest.approx(1.0, rel=1e-6)
    for mlp in moe:  # router sends every token to experts 0..K-1 with probability 1/K each
        mlp.gate.kernel[...] = jnp.zeros((d, e), jnp.float32).at[0, :k].set(100.0)
    assert float(train.balance_loss(model, walked, e)) == pytest.approx(e / k, rel=1e-4)


def test_learning_rate_warms_up_then_decays_to_a_tenth(train):
    lrs = [train.lr_at(s, 1.0, 10, 100) for s in range(100)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert all(b <= a for a, b in zip(lrs[10:], lrs[11:]))
    assert train.lr_at(100, 1.0, 10, 100) == pytest.approx(0.1)


def test_routing_stats_popularity_and_affinity(checkpoint):
    e, k, n = 8, 2, 400
    rng = np.random.default_rng(0)
    first = np.stack([rng.choice(4, k, replace=False) for _ in range(n)])  # only experts 0..3 at layer 0
    experts = np.stack([first, (first + 4) % e, first]).astype(np.int32)  # [M=3, N, K], fully predictable
    stats = checkpoint.routing_stats(experts, e)
    counts = np.asarray(stats["counts"])
    assert counts.shape == (3, e) and (counts.sum(1) == n * k).all()
    assert (counts[0, 4:] == 0).all() and stats["unused_experts"] == 3 * 4
    assert stats["affinity_recall_at_k"] == [1.0, 1.0]
    assert all(r < 0.75 for r in stats["popularity_recall_at_k"])
    cond = np.asarray(stats["affinity"][0])  # P(j at 1 | i at 0) is 1 for j = i + 4
    np.testing.assert_allclose(cond[np.arange(4), np.arange(4) + 4], 1.0)
    assert stats["top_quarter_share"][0] == pytest.approx(0.5, abs=0.05)


def test_write_safetensors_shards_with_an_index(checkpoint, tmp_path):
    tensors = {f"t{i}": np.full((100,), i, np.float32) for i in range(5)}  # 400 bytes each
    (tmp_path / "model.safetensors").write_bytes(b"stale")
    files = checkpoint.write_safetensors(tmp_path, tensors, max_shard_bytes=1000)
    assert [f.name for f in files] == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert not (tmp_path / "model.safetensors").exists()
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert index["weight_map"] == {"t0": files[0].name, "t1": files[0].name, "t2": files[1].name,
                                   "t3": files[1].name, "t4": files[2].name}
    assert checkpoint.write_safetensors(tmp_path, tensors, max_shard_bytes=10_000)[0].name == "model.safetensors"
    assert not (tmp_path / "model.safetensors.index.json").exists()


def test_smoke_run_trains_exports_and_reloads(script, tmp_path):
    # A small shard limit makes the smoke checkpoint sharded, so the reload check goes through the index.
    assert script.main(["--smoke", "--out", str(tmp_path), "--max-shard-mb", "0.2"]) == 0
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["model_type"] == "deepseek_v2" and config["architectures"] == ["DeepseekV2ForCausalLM"]
    weight_map = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(weight_map.values())) >= 2
    assert "model.layers.2.mlp.experts.7.down_proj.weight" in weight_map
    assert "model.layers.1.mlp.gate.weight" in weight_map
    key = "model.layers.1.mlp.experts.0.gate_proj.weight"
    with safe_open(str(tmp_path / weight_map[key]), framework="numpy") as f:
        gate = f.get_tensor(key)
    assert gate.dtype == ml_dtypes.bfloat16 and gate.shape == (config["moe_intermediate_size"], config["hidden_size"])
    assert (tmp_path / "tokenizer.json").exists() and (tmp_path / "reference_moe_training.png").stat().st_size > 0

    results = json.loads((tmp_path / "reference_moe_training.json").read_text())
    assert results["reload"]["ok"] and results["reload"]["max_abs_diff_vs_bf16_weights"] <= 2e-3
    curve = results["loss_curve"]
    assert curve[0]["step"] == 0 and curve[-1]["step"] == results["training"]["steps"] == 20
    assert curve[-1]["train_loss"] < math.log(config["vocab_size"])  # it learned something in 20 steps
    assert all(math.isfinite(curve[-1][key]) for key in ("heldout_loss", "ood_loss"))
    routing = results["routing_heldout"]
    assert np.asarray(routing["counts"]).shape == (2, config["n_routed_experts"])
    assert results["corpus"]["ood_source"] in ("common-licenses", "doc-copyright", "stdlib-text")
    assert results["generations"] and results["generations"][0]["text"].startswith("def ")
