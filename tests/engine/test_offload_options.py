"""Engine switches against the plain model: synchronous I/O, per-expert GPU programs, hot tables from counts,
AdaptSched's prefill streaming, the planner's own time, recorded activation counts; named cost tables."""

import json

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from pdscope_jax import models
from pdscope_jax.generation.generator import Generator
from pdscope_jax.engine.runner import OffloadRunner, analytic_costs
from pdscope_jax.phaseper.traces import PHASES, load_traces, write_synthetic_traces
from pdscope_jax.presets import preset
from pdscope_jax.runtime import RuntimeConfig
from pdscope_jax.sched import CostTableError, activation_counts, load_cost_table
from pdscope_jax.sched.hot import HotTableError, write_layer_stats


@pytest.fixture(scope="module")
def ref():
    cfg = preset("tiny-deepseek-v2-lite")
    model = models.build(cfg, nnx.Rngs(0), jnp.float32)
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (1, 20)).astype(np.int32)
    return cfg, model, ids, Generator(model).generate(ids, 5).tokens


def _runner(ref, policy, slots, **rc):
    cfg, model = ref[0], ref[1]
    config = RuntimeConfig(gpu_memory="1GB", expert_pool=slots * cfg.expert_bytes(4), policy=policy,
                           max_seq_len=128, **rc)
    return OffloadRunner(model, config)


@pytest.mark.parametrize("policy", ["greedy", "pdscope"])
def test_sync_io_and_per_expert_programs_keep_parity(ref, policy):
    cfg, _, ids, tokens = ref
    runner = _runner(ref, policy, 2 * cfg.num_experts + 2, async_io=False, batched_gpu=False)
    np.testing.assert_array_equal(runner.generate(ids, 5).tokens, tokens)
    stats = runner.stats
    assert not stats["async_io"] and not stats["batched_gpu"]
    moved = stats["prefill"]["experts_prefetched"] + stats["decode"]["experts_prefetched"]
    if moved:  # every staged copy was waited for: all of it exposed
        for phase in ("prefill", "decode"):
            assert stats[phase]["exposed_transfer_seconds"] >= stats[phase]["transfer_seconds"] - 1e-9
    runner.set_policy(policy, async_io=True, batched_gpu=True)
    np.testing.assert_array_equal(runner.generate(ids, 5).tokens, tokens)
    assert runner.stats["async_io"] and runner.stats["batched_gpu"]


def test_pdscope_streams_whole_layers_in_prefill(ref):
    cfg, _, ids, tokens = ref
    runner = _runner(ref, "pdscope", 2 * cfg.num_experts + 2)
    np.testing.assert_array_equal(runner.generate(ids, 5).tokens, tokens)
    prefill = runner.stats["prefill"]
    assert runner.stats["double_buffering"]
    # 20 prompt tokens x top-3 hit most of the 8 experts: streaming the next layer pays under the analytic table
    assert prefill["experts_prefetched"] >= cfg.num_experts - 1
    assert prefill["planner_calls"] == len(cfg.moe_layers) and prefill["planner_ms_per_layer"] > 0


def test_hot_table_from_recorded_counts(ref, tmp_path):
    cfg, _, ids, tokens = ref
    runner = _runner(ref, "static", 6)
    runner.generate(ids, 5)
    counts = runner.activation_counts
    assert counts["prefill"][cfg.moe_layers[0]].sum() == ids.size * cfg.num_experts_per_tok
    assert counts["decode"][cfg.moe_layers[0]].sum() == 4 * cfg.num_experts_per_tok
    path = write_layer_stats(tmp_path / "layer_stats.json", cfg.moe_layers, counts)
    loaded = activation_counts(tmp_path)  # the directory holding layer_stats.json
    for layer in cfg.moe_layers:
        np.testing.assert_array_equal(loaded[layer], counts["prefill"][layer] + counts["decode"][layer])
    runner.set_policy("static", {"hot_per_layer": 2}, hot_table=str(path))
    for layer in cfg.moe_layers:  # the two most used experts of each layer are preloaded
        total = loaded[layer]
        hottest = np.sort(np.lexsort((np.arange(total.size), -total))[:2])
        np.testing.assert_array_equal(np.flatnonzero(runner.pool.resident(layer)), hottest)
    np.testing.assert_array_equal(runner.generate(ids, 5).tokens, tokens)
    runner.set_policy("static", hot_table=str(path))  # default: the whole pool (6 slots), 2 per layer
    assert all(runner.pool.resident(layer).sum() == 6 // len(cfg.moe_layers) for layer in cfg.moe_layers)
    wide = _runner(ref, "pdscope", 12, hot_table=str(path))  # default: a quarter of the 12 slots, 1 per layer
    for layer in cfg.moe_layers:
        np.testing.assert_array_equal(np.flatnonzero(wide.pool.resident(layer)), [np.argmax(loaded[layer])])
    np.testing.assert_array_equal(wide.generate(ids, 5).tokens, tokens)
    with pytest.raises(HotTableError, match="none of"):
        activation_counts(_only_phase(tmp_path, path, "prefill"), phases=["decode"])


def test_hot_table_from_a_trace_directory(tmp_path):
    directory = write_synthetic_traces(tmp_path / "traces", layers=(1, 2, 3), num_experts=8, k=2,
                                       prefill_steps=(32, 32), decode_steps=8)
    counts = activation_counts(directory)
    traces = load_traces(directory)
    for layer in (1, 2, 3):
        want = sum(np.bincount(traces.layer(phase, layer)["e"].reshape(-1), minlength=8) for phase in PHASES)
        np.testing.assert_array_equal(counts[layer], want)
    decode_only = activation_counts(directory, phases=["decode"])
    assert decode_only[1].sum() == 8 * 2


def _only_phase(tmp_path, path, phase):
    """A layer_stats file holding one phase, written the way the project writes one (sealed)."""
    stats = json.loads(path.read_text())
    layers = stats["layers"]
    counts = {phase: dict(zip(layers, stats["phases"][phase]["expert_counts"]))}
    return write_layer_stats(tmp_path / "one_phase.json", layers, counts)


def test_cost_table_by_name_or_path(ref, tmp_path, monkeypatch):
    cfg = ref[0]
    monkeypatch.setenv("PDSCOPE_JAX_COSTS", str(tmp_path))
    table = analytic_costs(cfg, 4)
    table.save(tmp_path / "tiny-cpu.json")
    assert load_cost_table("tiny-cpu") == table and load_cost_table(tmp_path / "tiny-cpu.json") == table
    with pytest.raises(CostTableError, match="known: tiny-cpu"):
        load_cost_table("missing")
    runner = _runner(ref, "pdscope", 6, cost_table="tiny-cpu")
    assert runner.costs == table



def test_start_backends_restores_the_callers_cores_and_checks_the_count():
    import os

    from pdscope_jax.runtime import start_backends

    cores = os.sched_getaffinity(0)
    start_backends(1)  # backends already run under pytest: only the affinity dance happens
    assert os.sched_getaffinity(0) == cores
    with pytest.raises(ValueError, match=r"xla_cpu_cores must lie in \[1, "):
        start_backends(len(cores) + 1)
    assert os.sched_getaffinity(0) == cores
