"""Quality in the offload engine (`sched.precision`): at the stored precision nothing changes; with int4 copies the
engine reproduces, within float32 1e-4, the plain model whose experts hold what each computation read (the int4
copy's round trip where a GPU expert's slot was filled from it, the stored weights elsewhere)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from pdscope_jax import models
from pdscope_jax.engine import decode
from pdscope_jax.engine.runner import OffloadRunner
from pdscope_jax.generation.generator import Generator
from pdscope_jax.presets import preset
from pdscope_jax.quant.formats import is_quantized
from pdscope_jax.runtime import RuntimeConfig
from pdscope_jax.store.low_copies import round_trip

TOL = 1e-4
IDS = np.random.default_rng(0).integers(0, 256, (1, 16)).astype(np.int32)
NEW = 5


class Reference:
    """tiny-deepseek-v2-lite in float32 (experts stored as `quant`) and its plain model with chosen experts of each
    MoE layer replaced by their int4 round trips (`use`)."""

    def __init__(self, quant: str | None):
        self.cfg = preset("tiny-deepseek-v2-lite").replace(expert_quant=quant)
        self.model = models.build(self.cfg, nnx.Rngs(0), jnp.float32)
        self.stacks = {layer: self.model.layers[layer].mlp.experts.weights() for layer in self.cfg.moe_layers}
        self.low = {}  # layer -> the round trips of its stacks, made when first used

    def runner(self, policy: str, slots: int, accelerators: int = 1, **rc) -> OffloadRunner:
        config = RuntimeConfig(gpu_memory="1GB", expert_pool=slots * self.cfg.expert_bytes(4), policy=policy,
                               max_seq_len=64, **rc)
        return OffloadRunner(self.model, config, accelerators=accelerators)

    def use(self, low: dict[int, np.ndarray]) -> None:
        """Every MoE layer's experts: the round trip for the ids in `low[layer]`, the stored weights elsewhere."""
        for layer, base in self.stacks.items():
            mask = np.zeros(self.cfg.num_experts, bool)
            mask[np.asarray(low.get(layer, []), np.int64)] = True
            experts = self.model.layers[layer].mlp.experts
            if layer not in self.low:
                self.low[layer] = tuple(round_trip(w) for w in base)
            for name, b, r in zip(("gate_up", "down"), base, self.low[layer]):
                w = jax.tree.map(lambda x, y: jnp.where(mask.reshape(-1, 1, 1), y, x), b, r)
                getattr(experts, name).set_value(w.q if is_quantized(w) else w)
                if is_quantized(w):
                    getattr(experts, name + "_scale").set_value(w.scale)

    def stepwise(self, trace: list, accelerators: int = 1) -> list[np.ndarray]:
        """Greedy generation of the plain model from IDS, each step with the experts the engine's
        `precision_trace` says its GPUs computed from int4 copies at that step (an entry per MoE layer and
        accelerator) -> each step's log-probabilities [V]."""
        moe = len(self.cfg.moe_layers) * accelerators
        graphdef = nnx.graphdef(self.model)
        forward = jax.jit(lambda state, *args: nnx.merge(graphdef, state)(*args))  # two shapes: two programs
        cache = self.model.init_cache(1, 64, jnp.float32)
        ids, t, out = jnp.asarray(IDS), IDS.shape[1], []
        for step, at in enumerate(range(0, len(trace), moe)):
            low = {}
            for _, layer, experts in trace[at:at + moe]:
                low[layer] = np.concatenate([low.get(layer, np.zeros(0, np.int64)), experts])
            self.use(low)
            positions = jnp.arange(t)[None] if step == 0 else jnp.full((1, 1), t + step - 1)
            logits, cache = forward(nnx.state(self.model), ids, positions, cache)
            out.append(np.asarray(jax.nn.log_softmax(logits[0, -1])))
            ids = jnp.argmax(logits[:, -1:], axis=-1).astype(jnp.int32)
        return out


def test_quality_at_the_stored_precision_keeps_no_copy_and_changes_nothing():
    """int8 experts, quality "int8": no int4 copy, no rule, the plain model's logits, decode on the device as
    before (the engine's paths are those without a quality; `test_quantized_engine` runs them to the end)."""
    ref = Reference("int8")
    runner = ref.runner("pdscope", 5, quality="int8")
    assert runner.precision is None and not runner.store.has_low and runner.store.host_bytes_per_model_byte == 1.0
    np.testing.assert_allclose(runner.logits(IDS), Generator(ref.model).logits(IDS), atol=TOL, rtol=0)
    assert runner.stats["prefill"]["experts_loaded_low"] == 0 and decode.choose(runner, 1, NEW) is decode.DeviceDecode


def test_quality_int4_computes_every_copied_expert_from_its_int4_copy():
    """int8 experts, every expert fits the pool, nothing preloaded: each GPU expert is a copy, so every one is int4
    (requantized to the slots' int8): the plain model of round-tripped experts, logits and tokens."""
    ref = Reference("int8")
    runner = ref.runner("ondemand", ref.cfg.num_experts * len(ref.cfg.moe_layers), quality="int4")
    ref.use({layer: np.arange(ref.cfg.num_experts) for layer in ref.cfg.moe_layers})
    plain = Generator(ref.model)
    np.testing.assert_allclose(runner.logits(IDS), plain.logits(IDS), atol=TOL, rtol=0)
    np.testing.assert_array_equal(runner.generate(IDS, NEW).tokens, plain.generate(IDS, NEW).tokens)
    for phase in ("prefill", "decode"):
        stats = runner.stats[phase]
        assert stats["gpu_experts_low"] == stats["gpu_experts"] > 0 and stats["cpu_experts"] == 0
    assert runner.stats["decode"]["device_steps"] == 0  # int4 copies keep decode on the host
    assert 1.0 < runner.store.host_bytes_per_model_byte < 2.0  # the int4 copy beside the int8 one


@pytest.mark.parametrize("accelerators", [1, 2])
def test_mixed_copies_reproduce_the_model_of_the_precisions_they_used(accelerators):
    """pdscope over a pool of 5 slots (loads, prefetches, evictions, CPU experts at the stored precision, hits on
    slots filled from int4 copies), quality mixed: each step's token and 20 likeliest log-probabilities are those
    of the plain model with the recorded precisions, step by step; on one accelerator and split over two."""
    ref = Reference(None)
    runner = ref.runner("pdscope", 5, accelerators, quality="mixed")
    runner.precision_trace = trace = []
    steps = list(runner.steps(IDS, NEW))
    want = ref.stepwise(trace, accelerators)
    assert len(want) == len(steps) == NEW
    for picked, logprobs in zip(steps, want):
        assert picked.token[0] == np.argmax(logprobs)
        np.testing.assert_allclose(picked.top_logprobs[0], np.sort(logprobs)[::-1][:picked.top_logprobs.shape[1]],
                                   atol=TOL, rtol=0)
    copies = sum(runner.stats[p]["experts_loaded_now"] + runner.stats[p]["experts_prefetched"]
                 for p in ("prefill", "decode"))
    low = sum(runner.stats[p]["experts_loaded_low"] for p in ("prefill", "decode"))
    assert 0 < low < copies  # some copies int4, some at the stored precision
    assert sum(runner.stats[p]["gpu_experts_low"] for p in ("prefill", "decode")) == sum(t[2].size for t in trace)
