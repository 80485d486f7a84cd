"""The offload engine against the plain model: every policy, every path (double buffering, on-demand fallback,
CPU experts, eviction, chunked batched prefill, sampling), on two CPU devices with tiny float32 models."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from pdscope_jax import models
from pdscope_jax.generation.generator import Generator
from pdscope_jax.models import experts
from pdscope_jax.store.budget import BudgetError
from pdscope_jax.engine.runner import OffloadRunner, analytic_costs
from pdscope_jax.store.expert_store import is_expert_path
from pdscope_jax.store.slot_pool import SlotPool
from pdscope_jax.presets import preset
from pdscope_jax.runtime import RuntimeConfig
from pdscope_jax.weights.random_init import random_state

POLICIES = ("gpu", "static", "ondemand", "greedy", "fate", "pdscope")
TOL = 1e-4


class Reference:
    def __init__(self, name: str, batch: int, prompt: int, new: int, seed: int = 0):
        self.cfg = preset(name)
        self.model = models.build(self.cfg, nnx.Rngs(seed), jnp.float32)
        self.ids = np.random.default_rng(seed).integers(0, self.cfg.vocab_size, (batch, prompt)).astype(np.int32)
        self.new = new
        self.plain = Generator(self.model)
        self.logits = self.plain.logits(self.ids)
        self.tokens = self.plain.generate(self.ids, new).tokens

    def runner(self, policy: str, slots: int, **rc) -> OffloadRunner:
        options = {"hot_per_layer": 2} if policy == "static" else {}
        config = RuntimeConfig(gpu_memory="1GB", expert_pool=slots * self.cfg.expert_bytes(4), policy=policy,
                               policy_options=options, max_seq_len=128, **rc)
        return OffloadRunner(self.model, config)


@pytest.fixture(scope="module")
def ds():
    return Reference("tiny-deepseek-v2-lite", batch=1, prompt=20, new=6)


def _slots(ref: Reference, pool: str) -> int:
    e, layers = ref.cfg.num_experts, len(ref.cfg.moe_layers)
    return {"small": 5, "double": 2 * e + 2, "all": e * layers}[pool]


CASES = [("gpu", "all")] + [(policy, pool) for policy in POLICIES[1:] for pool in ("small", "double")]


@pytest.mark.parametrize("policy, pool", CASES)
def test_policy_matches_plain_model(ds, policy, pool):
    runner = ds.runner(policy, _slots(ds, pool))
    np.testing.assert_allclose(runner.logits(ds.ids), ds.logits, atol=TOL, rtol=0)
    out = runner.generate(ds.ids, ds.new)
    np.testing.assert_array_equal(out.tokens, ds.tokens)
    stats = runner.stats
    prefill, decode = stats["prefill"], stats["decode"]
    assert prefill["tokens"] == 2 * ds.ids.size and decode["tokens"] == ds.new - 1
    assert prefill["activated"] > 0 and decode["activated"] > 0
    assert prefill["gpu_experts"] + prefill["cpu_experts"] == prefill["activated"]
    assert stats["compiled_programs"]["total"] > 0
    if policy == "gpu":
        assert decode["hit_rate"] == 1.0 and prefill["cpu_experts"] == 0 and prefill["bytes_moved"] == 0
    if policy == "static":  # no transfers ever
        assert prefill["bytes_moved"] == decode["bytes_moved"] == 0 and prefill["cpu_experts"] > 0
    if policy == "ondemand" and pool == "double":  # the whole next layer streams during prefill
        assert stats["double_buffering"] and prefill["experts_prefetched"] > 0
        assert prefill["prefetch_accuracy"] is not None
    if policy == "ondemand" and pool == "small":  # fallback: on-demand loads, the rest on the CPU, evictions
        assert not stats["double_buffering"] and prefill["experts_prefetched"] == 0
        assert prefill["experts_loaded_now"] > 0 and prefill["cpu_experts"] > 0 and stats["evictions"] > 0
    if policy == "fate":
        assert prefill["experts_prefetched"] + decode["experts_prefetched"] > 0


@pytest.mark.parametrize("policy", POLICIES[1:])
def test_batched_tiles_over_the_pool_match_plain_model(ds, policy, monkeypatch):
    """With a pool of more slots than experts, prefill's experts run as batched tiles over the pool (the path
    the H200 takes; tiny experts normally skip it): the plain model's logits and tokens still."""
    monkeypatch.setattr(experts, "TILED_MIN_EXPERT_ELEMENTS", 0)
    runner = ds.runner(policy, _slots(ds, "double"))
    np.testing.assert_allclose(runner.logits(ds.ids), ds.logits, atol=TOL, rtol=0)
    np.testing.assert_array_equal(runner.generate(ds.ids, ds.new).tokens, ds.tokens)


def test_sampling_matches_plain_model(ds):
    runner = ds.runner("pdscope", 6)
    out = runner.generate(ds.ids, ds.new, temperature=0.8, top_k=5, seed=3)
    want = ds.plain.generate(ds.ids, ds.new, temperature=0.8, top_k=5, seed=3).tokens
    np.testing.assert_array_equal(out.tokens, want)


@pytest.fixture(scope="module")
def ds_batch():
    return Reference("tiny-deepseek-v2-lite", batch=2, prompt=40, new=4, seed=1)


@pytest.mark.parametrize("policy", ["ondemand", "greedy"])
def test_batched_chunked_prefill(ds_batch, policy):
    ref = ds_batch  # padding sits between the sequences' real tokens in the last chunk
    runner = ref.runner(policy, 7, max_batch=2, prefill_chunk=16)
    np.testing.assert_allclose(runner.logits(ref.ids), ref.logits, atol=TOL, rtol=0)
    np.testing.assert_array_equal(runner.generate(ref.ids, ref.new).tokens, ref.tokens)
    prefill = runner.stats["prefill"]
    assert prefill["steps"] == 2 * 3  # 40 tokens in chunks of 16, for logits and generate
    assert prefill["tokens"] == 2 * ref.ids.size and prefill["cpu_experts"] > 0


@pytest.mark.parametrize("name", ["tiny-qwen3-30b-a3b", "tiny-mixtral-8x7b"])
def test_other_families(name):
    ref = Reference(name, batch=1, prompt=12, new=3, seed=2)
    runner = ref.runner("fate", ref.cfg.num_experts // 2)
    np.testing.assert_allclose(runner.logits(ref.ids), ref.logits, atol=TOL, rtol=0)
    np.testing.assert_array_equal(runner.generate(ref.ids, ref.new).tokens, ref.tokens)
    assert runner.stats["prefill"]["cpu_experts"] > 0


class CountingPredictor:
    """Predicts the experts with the lowest ids; records what the engine passes in."""

    def __init__(self, num_experts: int):
        self.num_experts = num_experts
        self.calls = []

    def predict(self, layer, phase, a, w, e):
        self.calls.append((layer, phase, a.shape, w.shape, e.shape))
        scores = np.linspace(1.0, 0.1, self.num_experts, dtype=np.float32)
        return np.broadcast_to(scores, (a.shape[0], self.num_experts))  # [N, E], as PredictorSet gives


@pytest.mark.parametrize("slots", [6, "double"])
def test_predictor_hook_feeds_next_scores(ds, slots):
    """Both phases ask the predictor, also where the pool holds two whole layers (prefill may stream them)."""
    predictor = CountingPredictor(ds.cfg.num_experts)
    slots = _slots(ds, slots) if isinstance(slots, str) else slots
    rc = RuntimeConfig(gpu_memory="1GB", expert_pool=slots * ds.cfg.expert_bytes(4), policy="pdscope",
                       max_seq_len=128, device_decode=False)  # the host-planned decode asks the predictor
    runner = OffloadRunner(ds.model, rc, predictor=predictor)
    np.testing.assert_array_equal(runner.generate(ds.ids, ds.new).tokens, ds.tokens)
    layers = {call[0] for call in predictor.calls}
    assert layers == set(ds.cfg.moe_layers[:-1])  # every MoE layer with a successor
    assert {call[1] for call in predictor.calls} == {"prefill", "decode"}
    d, k = ds.cfg.hidden_size, ds.cfg.num_experts_per_tok
    assert (ds.ids.shape[1], d) in {call[2] for call in predictor.calls}
    assert all(call[3] == call[4] and call[3][1] == k for call in predictor.calls)
    assert runner.stats["prefill"]["experts_prefetched"] + runner.stats["decode"]["experts_prefetched"] > 0


def test_budget_failures_are_up_front_with_numbers(ds):
    with pytest.raises(BudgetError, match=r"non-expert weights .* MB.*budget 0\.1 MB"):
        OffloadRunner(ds.model, RuntimeConfig(gpu_memory="100KB", policy="ondemand", max_seq_len=128))
    with pytest.raises(BudgetError, match="policy 'gpu' keeps every expert resident"):
        ds.runner("gpu", 4)


def test_weights_dict_is_consumed_and_host_copy_single(ds):
    weights = models.to_flat(ds.model)
    n_before = len(weights)
    rc = RuntimeConfig(gpu_memory="1GB", expert_pool=5 * ds.cfg.expert_bytes(4), policy="ondemand", max_seq_len=128)
    abstract = models.abstract_model(ds.cfg, jnp.float32)
    runner = OffloadRunner(abstract, rc, weights)
    assert len(weights) == n_before - 2 * len(ds.cfg.moe_layers)  # expert stacks handed over
    assert runner.store.host_bytes_per_model_byte == 1.0
    assert runner.store.host_bytes == ds.cfg.routed_expert_bytes(4)
    np.testing.assert_allclose(runner.logits(ds.ids), ds.logits, atol=TOL, rtol=0)


def test_loader_is_called_per_expert_layer():
    cfg = preset("tiny-mixtral-8x7b")
    shapes = models.abstract_state(cfg, jnp.float32)
    plain = models.from_flat(cfg, jnp.float32, random_state(shapes, 5, lambda path: None))
    calls = []

    def loader(paths, placement):
        calls.append(sorted(paths))
        return random_state({p: shapes[p] for p in paths}, 5, placement)

    rc = RuntimeConfig(gpu_memory="1GB", expert_pool=3 * cfg.expert_bytes(4), policy="ondemand", max_seq_len=128)
    runner = OffloadRunner(models.abstract_model(cfg, jnp.float32), rc, loader)
    expert_calls = [c for c in calls if all(is_expert_path(p) for p in c)]
    assert len(calls) == 1 + len(cfg.moe_layers) and all(len(c) == 2 for c in expert_calls)
    assert not any(is_expert_path(p) for p in calls[0])
    ids = np.arange(10, dtype=np.int32)[None] * 7 % cfg.vocab_size
    np.testing.assert_allclose(runner.logits(ids), Generator(plain).logits(ids), atol=TOL, rtol=0)


def test_device_memory_flat_over_decode_steps(ds):
    runner = ds.runner("pdscope", 6)
    runner.track_memory = True
    runner.generate(ds.ids, 24)
    live = [m["live_array_bytes"] for m in runner.memory_trace]
    assert len(live) == 23 and max(live[2:]) == min(live[2:])
    assert max(live) <= runner.budget.total


def test_streaming_keeps_an_even_share_of_every_layer(monkeypatch):
    """A prefill that streams whole layers through two layer buffers takes the slots of experts beyond each other
    layer's even share: after it every layer but the last two keeps that share (its most routed experts), the
    next prefill streams only the rest of each layer, fewer than with least-recently-used slots, and the logits
    stay the plain model's."""
    cfg = preset("tiny-deepseek-v2-lite").replace(num_layers=7)  # six MoE layers of eight experts
    model = models.build(cfg, nnx.Rngs(0), jnp.float32)
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (1, 24)).astype(np.int32)
    want = Generator(model).logits(ids)
    e, moe = cfg.num_experts, cfg.moe_layers

    def run(prefer: bool):
        if not prefer:  # every slot by least recent use
            allocate = SlotPool.allocate
            monkeypatch.setattr(SlotPool, "allocate", lambda self, layer, experts, protect=(), prefer=None, low=False:
                                allocate(self, layer, experts, protect, low=low))
        config = RuntimeConfig(gpu_memory="1GB", expert_pool=(3 * e) * cfg.expert_bytes(4), policy="ondemand",
                               max_seq_len=128)
        runner = OffloadRunner(model, config)
        runner.logits(ids)
        routed = {layer: runner.activation_counts["prefill"][layer].copy() for layer in moe}
        resident = [np.flatnonzero(runner.pool.resident(layer)) for layer in moe]
        runner.reset_stats()
        np.testing.assert_allclose(runner.logits(ids), want, atol=TOL, rtol=TOL)
        monkeypatch.undo()
        return runner.pool.even_share, routed, resident, runner.stats["prefill"]["experts_prefetched"]

    share, routed, resident, streamed = run(True)
    assert share == (3 * e - 2 * e) // (len(moe) - 2) == 2
    assert [r.size for r in resident] == [share] * (len(moe) - 2) + [e, e]
    for layer, kept in zip(moe[:-2], resident):
        most_routed = np.sort(np.lexsort((np.arange(e), -routed[layer]))[:share])
        np.testing.assert_array_equal(kept, most_routed)
    assert streamed == len(moe) * (e - share)
    assert streamed < run(False)[3] <= len(moe) * e


@pytest.mark.parametrize("factor, calibrated", [(1e-6, True), (1e6, False)])
def test_cpu_costs_are_calibrated_in_situ_never_below_the_table(ds, factor, calibrated):
    """A table whose CPU times are far too small is scaled up by what the CPU experts measure; one whose times are
    far too large stays as it is (the scale never goes below 1). Numbers are unchanged either way. Each phase and
    step size keeps its own scale: the 20-token prompt's prefill (32 rows) and the one-row decode steps."""
    table = analytic_costs(ds.cfg, 4).with_cpu_scale(factor)
    config = RuntimeConfig(gpu_memory="1GB", expert_pool=5 * ds.cfg.expert_bytes(4), policy="greedy",
                           max_seq_len=128)
    runner = OffloadRunner(ds.model, config, cost_table=table)
    np.testing.assert_array_equal(runner.generate(ds.ids, ds.new).tokens, ds.tokens)
    assert runner.stats["prefill"]["cpu_experts"] > 0
    scales = runner.stats["cpu_cost_scale"]
    planner_table = runner._calibration.costs_for("prefill", 32)
    if calibrated:
        assert set(scales) == {"prefill 32", "decode 1"} and scales["prefill 32"] > 1.0
        np.testing.assert_allclose(planner_table.cpu_expert_seconds,
                                   np.asarray(table.cpu_expert_seconds) * round(scales["prefill 32"], 1))
        assert runner._calibration.costs_for("prefill", 64) is table  # another step size: nothing learned yet
    else:
        assert all(scale == 1.0 for scale in scales.values()) and planner_table is table
    runner.set_policy("greedy")  # the same policy (as a warm-up's fresh pool) keeps what was learned
    assert runner.stats["cpu_cost_scale"] == scales
    runner.reset_calibration()  # a compared run (bench label) starts from the table, as a new process does
    assert runner.stats["cpu_cost_scale"] == {} and runner._calibration.costs_for("prefill", 32) is table
    runner.generate(ds.ids, ds.new)
    runner.set_policy("ondemand")
    assert runner.stats["cpu_cost_scale"] == {}  # learned under another policy's load


def test_a_prompt_past_the_last_bucket_under_the_cache_pads_to_the_cache_length():
    """max_seq_len 264: a 259-token prompt's prefill step pads to 384 rows (the cache's length rounded up to
    `runtime.PREFILL_ROUND`), not to the next bucket's 512, keeps the plain model's tokens, and the budget's
    activations are measured for that step (`runtime.prefill_rows`)."""
    from pdscope_jax.runtime import prefill_rows

    ref = Reference("tiny-deepseek-v2-lite", batch=1, prompt=259, new=3)
    runner = OffloadRunner(ref.model, RuntimeConfig(gpu_memory="1GB", expert_pool=5 * ref.cfg.expert_bytes(4),
                                                    policy="ondemand", max_seq_len=264))
    np.testing.assert_array_equal(runner.generate(ref.ids, ref.new).tokens, ref.tokens)
    assert (1, 384, 384) in runner._loop.step_shapes  # (batch, padded prompt, padded rows)
    assert max(rows for _, _, rows in runner._loop.step_shapes) == 384
    assert prefill_rows(259, runner.runtime, 1) == prefill_rows(264, runner.runtime, 1) == 384
    # a cache budgeted for two sequences: one prompt's step is still padded by its own sequence, not to 512 rows
    pair = OffloadRunner(ref.model, runner.runtime.replace(max_batch=2))
    np.testing.assert_array_equal(pair.generate(ref.ids, ref.new).tokens, ref.tokens)
    assert max(rows for _, _, rows in pair._loop.step_shapes) == 384
