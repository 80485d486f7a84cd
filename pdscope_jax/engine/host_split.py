"""Which of device decode's misses the host's CPU computes (RuntimeConfig.decode_cpu_experts), and the bridges.

Contract: `HostSplit(store, config, device, expert_dtype)`; `for_step(runtime, planner, costs, batch)` -> a
`device_decode.HostExperts`, or None (every miss is copied) with decode_cpu_experts "off", for a planner without
the `decode_host_experts` capability, or with "auto" where the bridge cannot run (`why_not` then says why: not a
CUDA GPU, experts not bf16, no kernel). The share of a layer's misses copied: 0 for a planner that never copies
in decode (`decode_copies` False), else RuntimeConfig.decode_copy_share, else from the costs: the host's time
for one expert over the host's and the link's together, so that the two parts of a layer take about as long;
a planner that copies also fills free slots first (`HostExperts.fill_free`).
A bridge is made once per batch size and kept (a new one would compile a new step); `close()`, or the
engine's collection, stops them.
"""

from __future__ import annotations

import weakref

import jax.numpy as jnp

from pdscope_jax.engine.device_decode import HostExperts
from pdscope_jax.kernels import host_experts


class HostSplit:
    def __init__(self, store, config, device, expert_dtype):
        self.store, self.config, self.device, self.dtype = store, config, device, expert_dtype
        self.bridges: dict[int, host_experts.Bridge | None] = {}
        self.why_not = ""
        weakref.finalize(self, _close, self.bridges)  # the engine gone: stop its workers, free their staging

    def for_step(self, runtime, planner, costs, batch: int) -> HostExperts | None:
        mode = runtime.decode_cpu_experts
        if mode == "off" or not planner.decode_host_experts:
            return None
        if not planner.decode_copies:
            share = 0.0
        elif runtime.decode_copy_share is not None:
            share = float(runtime.decode_copy_share)
        else:
            host, link = costs.t_cpu(batch), costs.t_transfer(1)
            share = round(host / (host + link), 2)
        if mode == "xla":
            return HostExperts(share, None, planner.decode_copies)
        bridge = self.bridges[batch] if batch in self.bridges else self._bridge(batch)
        return None if bridge is None else HostExperts(share, bridge, planner.decode_copies)

    def _bridge(self, batch: int) -> host_experts.Bridge | None:
        cfg = self.config
        addresses = None
        if cfg.expert_quant is None and self.dtype == jnp.bfloat16:
            addresses = [self.store.host_addresses(layer) for layer in cfg.moe_layers]
        if addresses is None or any(a is None for a in addresses):
            bridge, self.why_not = None, "the experts are not bf16 arrays with host addresses"
        else:
            picks = min(batch * cfg.num_experts_per_tok, cfg.num_experts)
            bridge = host_experts.Bridge.create(addresses, (cfg.hidden_size, cfg.moe_intermediate_size), self.device,
                                                batch, picks)
            self.why_not = host_experts.why_not()
        self.bridges[batch] = bridge
        return bridge

    def close(self) -> None:
        _close(self.bridges)


def _close(bridges: dict) -> None:
    for bridge in bridges.values():
        if bridge is not None:
            bridge.close()
    bridges.clear()
