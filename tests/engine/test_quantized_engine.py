"""Quantized experts in the offload engine: every policy reproduces the plain model holding the same quantized
experts (float32 within 1e-4, the same tokens), through host decode, on-device decode (from per-expert arrays
and from layer stacks) and the CPU expert paths (XLA, and the kernel in bf16); the pool and the transfers count
quantized bytes."""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from pdscope_jax import models
from pdscope_jax.engine.cpu_experts import CpuExperts
from pdscope_jax.engine.runner import OffloadRunner
from pdscope_jax.generation.generator import Generator
from pdscope_jax.kernels import cpu_ffn
from pdscope_jax.presets import preset
from pdscope_jax.quant.formats import QuantizedWeight, quantize
from pdscope_jax.runtime import RuntimeConfig, select_devices
from pdscope_jax.store.expert_store import ExpertStore

TOL = 1e-4


class QuantReference:
    def __init__(self, name: str, quant: str, prompt: int = 16, new: int = 6):
        self.cfg = preset(name).replace(expert_quant=quant)
        self.model = models.build(self.cfg, nnx.Rngs(0), jnp.float32)
        self.ids = np.random.default_rng(0).integers(0, self.cfg.vocab_size, (1, prompt)).astype(np.int32)
        self.new = new
        plain = Generator(self.model)
        self.logits = plain.logits(self.ids)
        self.tokens = plain.generate(self.ids, new).tokens

    def runner(self, policy: str, slots: int, stacks: bool = False, **rc) -> OffloadRunner:
        options = {"hot_per_layer": 2} if policy == "static" else {}
        config = RuntimeConfig(gpu_memory="1GB", expert_pool=slots * self.cfg.expert_bytes(), policy=policy,
                               policy_options=options, max_seq_len=64, **rc)
        return OffloadRunner(self.model, config, expert_stacks=stacks)

    def check(self, runner: OffloadRunner) -> None:
        np.testing.assert_allclose(runner.logits(self.ids), self.logits, atol=TOL, rtol=0)
        np.testing.assert_array_equal(runner.generate(self.ids, self.new).tokens, self.tokens)


_references: dict[str, QuantReference] = {}


def reference(quant: str) -> QuantReference:
    """tiny-deepseek-v2-lite with `quant` experts, built once per test session."""
    if quant not in _references:
        _references[quant] = QuantReference("tiny-deepseek-v2-lite", quant)
    return _references[quant]


# int4 through every planner; int8 (the same engine paths, another format) through one of each kind
POLICY_CASES = [("int4", p) for p in ("gpu", "static", "ondemand", "greedy", "fate", "pdscope")] + [
    ("int8", p) for p in ("static", "ondemand", "pdscope")]


@pytest.mark.parametrize("quant, policy", POLICY_CASES)
def test_every_policy_matches_the_quantized_plain_model(quant, policy):
    qds = reference(quant)
    slots = qds.cfg.num_experts * len(qds.cfg.moe_layers) if policy == "gpu" else 5
    runner = qds.runner(policy, slots)
    assert isinstance(runner.pool.gate_up, QuantizedWeight) and runner.pool.gate_up.scheme.name == qds.cfg.expert_quant
    qds.check(runner)
    assert runner.store.bytes_moved % qds.cfg.expert_bytes() == 0  # transfers move whole quantized experts


@pytest.mark.parametrize("quant, stacks", [("int4", False), ("int4", True), ("int8", True)])
def test_decode_on_device_pulls_quantized_experts(quant, stacks):
    qds = reference(quant)
    runner = qds.runner("ondemand", 5, stacks=stacks)
    qds.check(runner)
    decode = runner.stats["decode"]
    assert decode["device_steps"] == decode["steps"] == qds.new - 1
    assert decode["bytes_moved"] == decode["experts_loaded_now"] * qds.cfg.expert_bytes() > 0


def test_a_step_that_copies_nothing_fills_the_decode_bank_with_quantized_experts():
    """static with int4 experts, its misses computed by the host (XLA ops): the decode bank (6 slots beside a
    pool of 5) is filled with whole quantized experts as decode starts, and the quantized plain model's logits
    and tokens come out."""
    qds = reference("int4")
    slot = qds.cfg.expert_bytes()
    probe = qds.runner("static", 1)
    config = probe.runtime.replace(gpu_memory=probe.budget.fixed + 5 * slot + slot // 2, expert_pool=11 * slot,
                                   decode_cpu_experts="xla", policy_options=(("hot_per_layer", 1),))
    runner = type(probe)(qds.model, config)
    assert runner.budget.decode_slots == 6 and runner.decode_host(1).copies is False
    qds.check(runner)
    decode = runner.stats["decode"]
    assert decode["experts_placed"] == 6 and decode["bytes_moved"] == 6 * slot


@pytest.mark.parametrize("name", ["tiny-qwen3-30b-a3b"])
def test_other_families_in_int4(name):
    ref = QuantReference(name, "int4")
    ref.check(ref.runner("pdscope", 5))


@pytest.mark.skipif(not cpu_ffn.available(), reason="the CPU expert kernel does not run here")
@pytest.mark.parametrize("quant", ["int8", "int4"])
def test_cpu_experts_of_quantized_layers_run_in_the_kernel(quant):
    """bf16 quantized experts on the CPU: one kernel program per layer, the XLA dequantize path's numbers."""
    rng = np.random.default_rng(1)
    store = ExpertStore(select_devices())
    e, d, f = 8, 64, 96
    store.add_layer(1, quantize(jnp.asarray(rng.standard_normal((e, d, 2 * f)) * 0.1), quant, jnp.bfloat16),
                    quantize(jnp.asarray(rng.standard_normal((e, f, d)) * 0.1), quant, jnp.bfloat16))
    h = jax.device_put(jnp.asarray(rng.standard_normal((2, d)), jnp.bfloat16), store.devices.cpu)
    groups = [(3, np.array([0, 1]), np.array([0.5, 0.25], np.float32)), (6, np.array([1]), np.array([1.0], np.float32))]
    fast, xla = CpuExperts(store, kernel=True), CpuExperts(store, kernel=False)
    y, want = np.asarray(fast.dispatch(1, h, groups), np.float64), np.asarray(xla.dispatch(1, h, groups), np.float64)
    assert {path for path, *_ in fast._shapes} == {"kernel"} and {path for path, *_ in xla._shapes} == {"dense"}
    assert np.linalg.norm(y - want) / np.linalg.norm(want) < 1e-2  # bf16 rounding apart


@pytest.mark.skipif(not cpu_ffn.available(), reason="the CPU expert kernel does not run here")
def test_the_stores_host_addresses_are_what_the_bridges_worker_computes_from():
    """bf16, int8 and int4 layers give the addresses of their pinned bytes (quantized: with their scales as stored,
    int8's float32, int4's bf16 with its groups, or int8 with bf16 scales), which the worker's entry (`cpu_ffn.run`)
    computes from as the kernel does from the arrays, and to the XLA path's numbers; float32 layers give none, so
    no bridge is made for them."""
    rng = np.random.default_rng(2)
    store = ExpertStore(select_devices())
    e, d, f = 8, 64, 96
    gate_up = jnp.asarray(rng.standard_normal((e, d, 2 * f)) * 0.1, jnp.bfloat16)
    down = jnp.asarray(rng.standard_normal((e, f, d)) * 0.1, jnp.bfloat16)
    int8 = [quantize(w, "int8", jnp.bfloat16) for w in (gate_up, down)]
    layers = {1: (gate_up, down), 2: tuple(int8),
              3: (quantize(gate_up, "int4", jnp.bfloat16), quantize(down, "int4", jnp.bfloat16)),
              4: (gate_up.astype(jnp.float32), down.astype(jnp.float32)),
              5: tuple(QuantizedWeight(w.q, w.scale.astype(jnp.bfloat16), w.scheme, w.dtype) for w in int8)}
    for layer, (gu, dn) in layers.items():
        store.add_layer(layer, gu, dn)
    assert store.host_addresses(4) is None
    h = jnp.asarray(rng.standard_normal((2, d)), jnp.bfloat16)
    coef = np.array([[0.5, 0.0], [0.25, 1.0]], np.float32)
    ids = np.array([6, 1], np.int32)
    # (bits, scale_bits, groups): int4's rows per scale row are gcd(K, 64): 64 along D = 64, 32 along F = 96
    for layer, form in ((1, (16, 32, (0, 0))), (2, (8, 32, (0, 0))), (3, (4, 16, (64, 32))), (5, (8, 16, (0, 0)))):
        weights = store.host_addresses(layer)
        assert (weights.bits, weights.scale_bits, weights.groups) == form and len(weights) == e
        assert len(weights.gate_up_scale) == len(weights.down_scale) == (0 if form[0] == 16 else e)
        gu, dn = layers[layer]
        want = cpu_ffn.moe_ffn_cpu(h, jnp.asarray(coef), gu, dn, jnp.asarray(ids), impl="kernel")
        got = cpu_ffn.run(weights.take(ids), np.asarray(h), coef, (d, f))
        np.testing.assert_array_equal(got, np.asarray(want))
        xla = np.asarray(cpu_ffn.moe_ffn_cpu(h, jnp.asarray(coef), gu, dn, jnp.asarray(ids), impl="xla"), np.float64)
        assert np.linalg.norm(got - xla) / np.linalg.norm(xla) < 1e-2  # bf16 rounding apart


def test_int8_decode_splits_its_misses_between_the_host_and_the_steps_own_copies():
    """int8 pdscope with the host's part computed by XLA ops (the bridge's stand-in) and half the misses copied by
    the step itself: the quantized plain model's logits and tokens, some experts on the host, some copied. A
    bridge of quantized experts copies nothing (`Bridge.can_copy` False): the step keeps its own copies; where the
    host would compute nothing, or (no share given) is slower than the link, there is no split at all."""
    qds = reference("int8")
    runner = qds.runner("pdscope", 5, decode_cpu_experts="xla", decode_copy_share=0.5)
    qds.check(runner)
    decode = runner.stats["decode"]
    assert decode["device_steps"] == qds.new - 1 and decode["cpu_experts"] > 0 and decode["experts_loaded_now"] > 0

    auto = qds.runner("pdscope", 5, decode_cpu_experts="auto", decode_copy_share=0.5)
    split, bridge = auto.host_split, types.SimpleNamespace(can_copy=False)  # only its presence and can_copy matter
    split._bridge = lambda batch: split.bridges.setdefault(batch, bridge)
    host = split.for_step(auto.runtime, auto.planner, auto.costs, 1)
    assert host.bridge is bridge and host.computes and host.copies and not host.bridge_copies
    assert host.copy_share == 0.5
    assert split.for_step(auto.runtime.replace(decode_cpu_experts="off"), auto.planner, auto.costs, 1) is None
    # no share given: the host computes every miss where it is no slower than the link, else none
    default, link = auto.runtime.replace(decode_copy_share=None), auto.costs.t_transfer(1)
    split.host_seconds[1] = link  # as if measured so
    host = split.for_step(default, auto.planner, auto.costs, 1)
    assert (host.copy_share, host.copies, host.computes) == (0.0, False, True)
    split.host_seconds[1] = 2 * link
    assert split.for_step(default, auto.planner, auto.costs, 1) is None
    split.bridges.clear()  # the stand-in has nothing to close
