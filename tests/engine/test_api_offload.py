"""`pdscope_jax.load(..., policy=...)`: the offloaded runner behind the public API."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import pdscope_jax
from pdscope_jax import models
from pdscope_jax.engine.runner import OffloadRunner
from pdscope_jax.presets import preset
from pdscope_jax.runtime import RuntimeConfig


def test_static_through_load_keeps_experts_resident():
    """Without explicit options, static fills the pool with hot experts, so some decode experts run there."""
    runner = pdscope_jax.load("tiny-deepseek-v2-lite", dtype="float32", policy="static", gpu_memory="1GB",
                              max_seq_len=128)
    runner.generate(np.arange(1, 9, dtype=np.int32)[None], max_new_tokens=4)
    decode = runner.stats["decode"]
    assert decode["gpu_experts"] > 0 and decode["experts_loaded_now"] == 0
    # building the engine, by stages in their order, each timed
    assert list(runner.startup_seconds) == ["budget", "weights and expert store", "non-expert weights",
                                            "slot pool and programs", "policy"]
    assert all(seconds >= 0 for seconds in runner.startup_seconds.values())
    assert runner.startup_seconds["weights and expert store"] > 0


def test_offloaded_generate_warms_each_shape_once_and_matches_plain():
    """Warm-up decodes two tokens, yet compiles what a longer run needs; a run whose programs are the same (another
    token count, same KV cache length) is not warmed again."""
    ids = np.arange(3, 15, dtype=np.int32)[None]
    plain = pdscope_jax.load("tiny-qwen3-30b-a3b", dtype="float32").generate(ids, max_new_tokens=6)
    runner = pdscope_jax.load("tiny-qwen3-30b-a3b", dtype="float32", policy="ondemand", gpu_memory="1GB",
                              expert_pool="40KB", max_seq_len=128)
    first = runner.generate(ids, max_new_tokens=6)
    assert runner.engine.warmed_shapes == {runner.engine.program_shape(1, 12, 6)}
    compiled = runner.engine.compiled_programs["total"]
    second = runner.generate(ids, max_new_tokens=5)
    assert runner.engine.program_shape(1, 12, 5) == runner.engine.program_shape(1, 12, 6)
    assert len(runner.engine.warmed_shapes) == 1
    assert runner.engine.compiled_programs["total"] == compiled  # no compilation inside the timed runs
    np.testing.assert_array_equal(first.tokens, plain.tokens)
    np.testing.assert_array_equal(second.tokens, plain.tokens[:, :5])


def test_warmup_compiles_every_mix_of_gpu_and_cpu_parts():
    """Warm-up runs dummy tokens, whose routing may never give a layer only GPU experts, or only CPU ones; a real
    prompt may. Every mix of the layer combination's parts is compiled for every shape warm-up saw."""
    cfg = preset("tiny-deepseek-v2-lite")
    runner = pdscope_jax.load("tiny-deepseek-v2-lite", dtype="float32", policy="static", gpu_memory="1GB",
                              expert_pool=len(cfg.moe_layers) * cfg.expert_bytes(4), max_seq_len=128)
    engine = runner.engine
    engine.warmup(1, 12, 4)
    compiled = engine.compiled_programs["moe_combine"]
    shapes = engine._loop.step_shapes  # (batch, tokens, padded rows) of the steps warm-up ran
    assert {t for _, t, _ in shapes} == {16, 1}  # the prefill bucket and decode
    d, accel = cfg.hidden_size, engine.devices.accel
    for b, t, rows in shapes:
        x, shared, y_gpu, y_cpu = (jax.device_put(np.zeros(shape, np.float32), accel) for shape in
                                   ((b, t, d), (b * t, d), (rows, d), (rows, d)))
        for parts in ((y_gpu, None), (None, y_cpu), (y_gpu, y_cpu), (None, None)):
            engine._programs["moe_combine"](x, shared, *parts, None)  # few rows: the CPU part is whole
    assert engine.compiled_programs["moe_combine"] == compiled


class CountingPredictor:
    """Scores every expert alike and counts how often the engine asks."""

    def __init__(self, num_experts: int):
        self.calls = 0
        self.num_experts = num_experts

    def predict(self, layer, phase, a, w, e):
        self.calls += 1
        return np.full((a.shape[0], self.num_experts), 0.5, np.float32)


def test_predictor_feeds_pdscope_only():
    """ondemand reads no scores; fate keeps its own gate-based predictor; pdscope reads the predictor."""
    cfg = preset("tiny-deepseek-v2-lite")
    predictor = CountingPredictor(cfg.num_experts)
    rc = RuntimeConfig(gpu_memory="1GB", expert_pool=6 * cfg.expert_bytes(4), policy="ondemand", max_seq_len=64)
    engine = OffloadRunner(models.build(cfg, nnx.Rngs(0), jnp.float32), rc, predictor=predictor)
    ids = np.arange(1, 7, dtype=np.int32)[None]
    for policy in ("ondemand", "fate"):
        engine.set_policy(policy)
        engine.generate(ids, max_new_tokens=2)
        assert predictor.calls == 0, policy
    engine.set_policy("pdscope")
    engine.generate(ids, max_new_tokens=2)
    assert predictor.calls > 0


def test_progress_bars_nest_when_loading_an_offloaded_checkpoint(monkeypatch):
    """Above the size threshold the engine shows a bar over the MoE layers it takes into pinned memory while the
    checkpoint loader shows its own inside it, on the same console: the bars must nest (rich >= 14.1), and
    what loads must equal the plain model."""
    from pathlib import Path

    import pdscope_jax.engine.build as engine_module
    import pdscope_jax.weights.checkpoint as checkpoint_module

    bars = []

    class RecordingProgress(engine_module.Progress):
        def add_task(self, description, *args, **kwargs):
            bars.append((description, self.disable))
            return super().add_task(description, *args, **kwargs)

    monkeypatch.setattr(engine_module, "Progress", RecordingProgress)
    monkeypatch.setattr(engine_module, "PROGRESS_BYTES", 0)
    monkeypatch.setattr(checkpoint_module, "PROGRESS_BYTES", 0)
    path = Path(__file__).parents[1] / "data" / "deepseek_v2"
    ids = np.arange(1, 9, dtype=np.int32)[None]
    plain = pdscope_jax.load(str(path), dtype="float32").logits(ids)
    runner = pdscope_jax.load(str(path), dtype="float32", policy="ondemand", gpu_memory="1GB", max_seq_len=64)
    np.testing.assert_allclose(runner.logits(ids), plain, rtol=1e-5, atol=1e-5)
    assert bars == [("routed experts -> pinned host memory (MoE layers)", False)]
