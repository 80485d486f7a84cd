"""engine.activations: the budget's activation figure comes from XLA's buffer assignment for the largest prefill
step, stays under the formula that bounds it, cannot miss what attention must hold, is used by the engine, and
is stored beside the persistent compilation cache."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pdscope_jax import models
from pdscope_jax.engine.activations import MARGIN, measure_activations
from pdscope_jax.engine.build import round_up
from pdscope_jax.generation.generator import CACHE_BUCKET
from pdscope_jax.presets import preset
from pdscope_jax.runtime import RuntimeConfig, RuntimeConfigError
from pdscope_jax.store.budget import activation_bytes
from test_offload_engine import Reference

BF16 = np.dtype(jnp.bfloat16)


def _measure_abstract(cfg, rc, dtype):
    """`measure_activations` as `engine.build.plan_budget` calls it, for a model of `dtype`."""
    abstract = models.abstract_model(cfg, dtype)
    kv = jax.eval_shape(lambda: abstract.init_cache(rc.max_batch, round_up(rc.max_seq_len, CACHE_BUCKET),
                                                    np.dtype(dtype)))
    return measure_activations(cfg, rc, abstract, kv, np.dtype(dtype), np.dtype(dtype))


def _measure(name: str, **rc):
    cfg = preset(name)
    config = RuntimeConfig(**rc)
    return cfg, config, _measure_abstract(cfg, config, jnp.bfloat16)


@pytest.mark.parametrize("name, max_seq_len", [("tiny-deepseek-v2-lite", 256), ("tiny-qwen3-30b-a3b", 256),
                                               ("tiny-mixtral-8x7b", 256), ("tiny-deepseek-v2-lite", 77)])
def test_measured_figure_is_the_largest_program_and_under_the_formula(name, max_seq_len):
    """77 tokens pad to a bucket of 128 rows: padded routing rows beside the step's unpadded ones."""
    cfg, rc, measured = _measure(name, max_seq_len=max_seq_len)
    peaks = dict(measured.peaks)
    assert {"gpu_experts", "moe_combine", "logits"} <= set(peaks)
    assert measured.bytes == int(MARGIN * max(peaks.values()))
    assert 0 < measured.bytes <= activation_bytes(cfg, rc, BF16.itemsize)
    assert _measure(name, max_seq_len=max_seq_len)[2] is measured  # compiled once per shapes in a process


def test_the_largest_step_pads_to_the_cache_length_not_the_next_bucket():
    """A step is padded to its bucket, capped at the rows the KV cache can hold (rounded up to PREFILL_ROUND): a
    4,096-token prompt with 64 new tokens reserves activations for 4,224 rows, not 8,192; a bucket under the cap
    stays; a batch's cap is its sequences' lengths together."""
    from pdscope_jax.runtime import PREFILL_ROUND, prefill_rows

    assert PREFILL_ROUND == 128
    rc = RuntimeConfig(max_seq_len=4160)
    assert prefill_rows(4160, rc, 1) == 4224 and prefill_rows(4097, rc, 1) == 4224
    assert prefill_rows(4096, rc, 1) == 4096 and prefill_rows(100, rc, 1) == 128
    batch = RuntimeConfig(max_batch=4, max_seq_len=300)
    assert prefill_rows(1200, batch, 4) == 1280 and prefill_rows(259, batch, 1) == 384
    assert prefill_rows(300, RuntimeConfig(max_seq_len=4096), 1) == 512  # far under the cap: the bucket
    capped = _measure("tiny-deepseek-v2-lite", max_seq_len=264)[2]  # 264 keys, 384 rows (its bucket: 512)
    at_384 = _measure("tiny-deepseek-v2-lite", max_seq_len=264, prefill_buckets=(16, 32, 64, 128, 256, 384, 512))[2]
    assert capped.bytes == at_384.bytes  # the same step as a bucket of 384 rows, which 512 rows would exceed


def test_full_size_attention_holds_its_score_matrix():
    """DeepSeek-V2-Lite at 4,096 tokens, compiled from shapes alone: the route program holds at least one float32
    score matrix (heads x T x T), and the whole figure stays below the formula's 7.7 GB."""
    cfg, rc, measured = _measure("deepseek-v2-lite", max_seq_len=4096)
    route = dict(measured.peaks)["moe_route_scored"]
    assert route >= cfg.num_heads * 4096 * 4096 * 4
    assert measured.bytes < activation_bytes(cfg, rc, BF16.itemsize)


def test_engine_budgets_the_measured_figure_unless_asked_for_the_estimate():
    ref = Reference("tiny-deepseek-v2-lite", batch=1, prompt=8, new=2)
    measured = ref.runner("ondemand", 5)
    assert measured.budget.activations_measured
    want = _measure_abstract(ref.cfg, measured.runtime, jnp.float32)  # Reference builds its model in float32
    assert measured.budget.activations == want.bytes
    estimated = ref.runner("ondemand", 5, activation_memory="estimated")
    assert not estimated.budget.activations_measured
    assert estimated.budget.activations == activation_bytes(ref.cfg, estimated.runtime, 4)
    assert "activations (measured)" in measured.budget.describe()
    every = len(ref.cfg.moe_layers) * ref.cfg.num_experts
    roomy = ref.runner("ondemand", every)  # every expert fits under the estimate: nothing to measure
    assert roomy.pool.num_slots == every and not roomy.budget.activations_measured
    with pytest.raises(RuntimeConfigError, match="activation_memory"):
        RuntimeConfig(activation_memory="guess")


def test_a_backend_without_memory_analysis_keeps_the_estimate(monkeypatch):
    from pdscope_jax.engine import build

    monkeypatch.setattr(build, "measure_activations", lambda *args: None)
    runner = Reference("tiny-deepseek-v2-lite", batch=1, prompt=8, new=2).runner("ondemand", 5)
    assert not runner.budget.activations_measured
    assert runner.budget.activations == activation_bytes(runner.config, runner.runtime, 4)


@pytest.fixture
def compile_cache_folder(tmp_path):
    """JAX's persistent compilation cache pointed at a fresh folder for the test, then put back as it was."""
    from jax.experimental.compilation_cache import compilation_cache

    before = jax.config.jax_compilation_cache_dir
    jax.config.update("jax_compilation_cache_dir", str(tmp_path))
    compilation_cache.reset_cache()
    yield tmp_path
    jax.config.update("jax_compilation_cache_dir", before)
    compilation_cache.reset_cache()


def test_the_figure_is_stored_with_the_compilation_cache_and_read_back(compile_cache_folder, monkeypatch):
    """A second process (here: the in-process results forgotten) reads the stored figure instead of compiling;
    a damaged file is measured again and rewritten; other code (another source digest) has a file of its own."""
    from pdscope_jax.artifacts import provenance
    from pdscope_jax.engine import activations

    monkeypatch.setattr(activations, "_RESULTS", {})
    cfg, rc, measured = _measure("tiny-qwen3-30b-a3b", max_seq_len=96)
    (stored,) = (compile_cache_folder / "activations").glob("*.json")
    assert not list(stored.parent.glob("*.tmp"))  # written whole

    def no_compiling(*args):
        raise AssertionError("compiled although the figure is stored")

    monkeypatch.setattr(activations, "_RESULTS", {})
    with monkeypatch.context() as patched:
        patched.setattr(activations, "_compile_and_read", no_compiling)
        assert _measure("tiny-qwen3-30b-a3b", max_seq_len=96)[2] == measured

    stored.write_text("{not json")
    monkeypatch.setattr(activations, "_RESULTS", {})
    assert _measure("tiny-qwen3-30b-a3b", max_seq_len=96)[2] == measured
    assert json.loads(stored.read_text())["bytes"] == measured.bytes

    monkeypatch.setattr(provenance, "source_digest", lambda: "other code")
    monkeypatch.setattr(activations, "_RESULTS", {})
    _measure("tiny-qwen3-30b-a3b", max_seq_len=96)
    assert len(list(stored.parent.glob("*.json"))) == 2

