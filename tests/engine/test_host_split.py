"""The host split of device decode (`engine.host_split`): its bridges stop with the engine, and the copy share
comes from the CPU kernel timed on the store's own experts."""

import types

import jax.numpy as jnp
import numpy as np
import pytest

from pdscope_jax.runtime import select_devices
from pdscope_jax.store import expert_store
from test_offload_engine import Reference, _slots


@pytest.fixture(scope="module")
def ds():
    return Reference("tiny-deepseek-v2-lite", batch=1, prompt=20, new=10)


def test_an_engines_bridges_stop_when_it_is_collected():
    from pdscope_jax.engine.host_split import HostSplit

    closed = []

    class Bridge:
        def close(self):
            closed.append(self)

    split = HostSplit(None, None, None, None)
    split.bridges.update({1: Bridge(), 2: None})
    del split
    import gc
    gc.collect()
    assert len(closed) == 1


def test_the_copy_share_with_a_bridge_comes_from_its_kernel_timed_on_the_stores_experts(ds):
    """With a bridge (a stand-in here: only its presence matters), the host's time for one expert is the CPU
    kernel timed once on the store's own experts, not the cost table's CPU time. Where the host is slower than
    the link, the share balances the two; where it is not, nothing is copied, not even into free slots. (The
    reference model is float32, whose experts the kernel does not read: the split times a store of bf16 experts
    of the same shapes; float32 ones fall back to the cost table.)"""
    from pdscope_jax.kernels import cpu_ffn

    if not cpu_ffn.built():
        pytest.skip("the CPU expert kernel is not built here")
    runner = ds.runner("pdscope", _slots(ds, "small"), decode_cpu_experts="auto")
    split, bridge = runner.host_split, types.SimpleNamespace(can_copy=True)
    split._bridge = lambda batch: split.bridges.setdefault(batch, bridge)
    assert split._host_seconds(runner.costs, 1, bridge) == runner.costs.t_cpu(1)  # float32 experts: not timed
    cfg, rng = ds.cfg, np.random.default_rng(0)
    split.store = expert_store.ExpertStore(select_devices())
    for layer in cfg.moe_layers:
        d, f = cfg.hidden_size, cfg.moe_intermediate_size
        split.store.add_layer(layer, *(jnp.asarray(rng.standard_normal(shape) * 0.1, jnp.bfloat16)
                                       for shape in ((cfg.num_experts, d, 2 * f), (cfg.num_experts, f, d))))
    split.host_seconds.clear()  # timed anew on these
    host = split.for_step(runner.runtime, runner.planner, runner.costs, 1)
    measured, link = split.host_seconds[1], runner.costs.t_transfer(1)
    assert host.bridge is bridge and 0 < measured < 0.1 and measured != runner.costs.t_cpu(1)
    assert host.copy_share == (0.0 if measured <= link else round(measured / (measured + link), 2))
    for seconds, share, copies in ((3 * link, 0.75, True), (link, 0.0, False)):
        split.host_seconds[1] = seconds  # as if measured so
        host = split.for_step(runner.runtime, runner.planner, runner.costs, 1)
        assert (host.copy_share, host.copies, host.computes) == (share, copies, True)
        assert split.splits[1] == {"copy_share": share, "host_ms": round(1e3 * seconds, 4),
                                   "link_ms": round(1e3 * link, 4)}
    split.bridges.clear()  # the stand-in has nothing to close


def test_the_stats_say_what_split_the_last_step_decided():
    """A planner that never copies computes every miss on the host (share 0, no times weighed); a step with no
    host part and no copies by the bridge (None) leaves no split behind, not the one before."""
    from pdscope_jax.engine.host_split import HostSplit

    split = HostSplit(None, None, None, None)
    split.bridges[1] = types.SimpleNamespace(can_copy=True, stats=lambda: {"served": 3})
    planner = types.SimpleNamespace(decode_host_experts=True, decode_copies=False, reads_next_scores=False)
    runtime = types.SimpleNamespace(decode_cpu_experts="auto", decode_bridge_copies=True, decode_copies_ahead=False,
                                    decode_copy_share=None)
    host = split.for_step(runtime, planner, None, 1)
    assert (host.copy_share, host.copies) == (0.0, False)
    assert split.stats() == {"bridges": {"1": {"served": 3}}, "why_not": "", "splits": {"1": {"copy_share": 0.0}}}
    off = types.SimpleNamespace(**{**vars(runtime), "decode_cpu_experts": "off"})
    assert split.for_step(off, planner, None, 1) is None
    assert split.stats()["splits"] == {}
    split.bridges.clear()  # the stand-in has nothing to close


def test_an_int4_store_reaches_the_bridge_and_its_kernel_is_timed():
    """int4 experts (bf16 scales) in bf16: the split asks for a bridge with the store's addresses (on the CPU
    backend it is refused for the device, not for the experts), and the kernel is timed on them; float32 compute
    is refused for the experts."""
    from pdscope_jax.engine.host_split import HostSplit, kernel_seconds_per_expert
    from pdscope_jax.kernels import cpu_ffn
    from pdscope_jax.presets import preset
    from pdscope_jax.quant.formats import quantize

    if not cpu_ffn.built():
        pytest.skip("the CPU expert kernel is not built here")
    cfg, rng = preset("tiny-deepseek-v2-lite"), np.random.default_rng(1)
    store = expert_store.ExpertStore(select_devices())
    d, f = cfg.hidden_size, cfg.moe_intermediate_size
    for layer in cfg.moe_layers:
        store.add_layer(layer, *(quantize(jnp.asarray(rng.standard_normal(shape) * 0.1), "int4", jnp.bfloat16)
                                 for shape in ((cfg.num_experts, d, 2 * f), (cfg.num_experts, f, d))))
    seconds = kernel_seconds_per_expert(store, cfg, per_call=2, repeats=2)
    assert seconds is not None and 0 < seconds < 0.1
    split = HostSplit(store, cfg, store.devices.cpu, jnp.bfloat16)
    assert split._bridge(1) is None and "not a CUDA GPU" in split.why_not
    split = HostSplit(store, cfg, store.devices.cpu, jnp.float32)
    assert split._bridge(1) is None and "compute dtype bf16" in split.why_not


def test_the_kernel_is_timed_once_a_batch_size_after_the_engines_copies_settle(ds, monkeypatch):
    """The host's time for one expert is measured after `settle` (the engine's: its pools' queued copies done, so a
    policy's preload does not share host memory with the timing), once per batch size; the engine wires its own."""
    from pdscope_jax.engine import host_split

    order = []
    monkeypatch.setattr(host_split, "kernel_seconds_per_expert",
                        lambda store, cfg, per_call, rows: order.append(("timed", per_call, rows)) or 2e-4)
    cfg = types.SimpleNamespace(num_experts_per_tok=6, num_experts=64)
    split = host_split.HostSplit(None, cfg, None, None, settle=lambda: order.append("settled"))
    costs = types.SimpleNamespace(t_cpu=lambda batch: 1.0)
    assert [split._host_seconds(costs, 1, object()) for _ in range(2)] == [2e-4, 2e-4]
    assert split._host_seconds(costs, 4, object()) == 2e-4
    assert order == ["settled", ("timed", 3, 1), "settled", ("timed", 12, 4)]
    runner = ds.runner("pdscope", _slots(ds, "small"), decode_cpu_experts="auto")
    assert runner.host_split.settle == runner._copies_done
