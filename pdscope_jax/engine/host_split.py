"""Which of device decode's misses the host's CPU computes (RuntimeConfig.decode_cpu_experts), who copies the
rest, and the bridges.

Contract: `HostSplit(store, config, device, expert_dtype, settle=None)`; `for_step(runtime, planner, costs, batch)` -> a
`device_decode.HostExperts`, or None (every miss is copied by the program itself). The host computes misses with
decode_cpu_experts "auto" (through the bridge) or "xla" for a planner with the `decode_host_experts` capability;
with "auto" or "off", RuntimeConfig.decode_bridge_copies and a planner that copies (`decode_copies`), the bridge's
worker makes the copies, and with RuntimeConfig.decode_copies_ahead and a planner that reads next-layer scores also
copies predicted experts a layer ahead (`HostExperts.ahead`). None where neither applies or the bridge cannot run
(`why_not` then says why: not a CUDA GPU, experts not bf16 or int8 / int4 of compute dtype bf16, no kernel).
Quantized experts' bridge computes but copies none: the step then copies its share itself, and by default (no copy
share given) the host computes only where it is no slower than the link, else None (every miss copied). The share of
a layer's misses copied: 1 where the host computes none, 0 for a planner that never copies in decode, else
RuntimeConfig.decode_copy_share, else 0 (nothing copied, not even into free slots) where the host computes an expert
no slower than the link (the cost table's) copies one, else the host's time for one expert over the host's and the
link's together, so that the two parts of a layer take about as long; the host's time is the bridge's kernel timed
once on the store's experts (the cost table's CPU time without a bridge), after `settle()` (the engine's: the copies
into its pool finished, so that none reads host memory beside the timing); a planner that copies also fills free
slots first (`HostExperts.fill_free`).
A bridge is made once per batch size and kept (a new one would compile a new step); `close()`, or the
engine's collection, stops them. `stats()` -> {"bridges": per batch, the bridge's layers served, faults and seconds
computing; "why_not"; "splits": per batch, the split the last `for_step` decided: `copy_share` (1: every miss
copied), and where the rule weighed them `host_ms` / `link_ms` (one expert's time on each); absent where neither
the host nor the bridge takes part}.
"""

from __future__ import annotations

import functools
import operator
import weakref

import jax.numpy as jnp

from pdscope_jax.engine.device_decode import HostExperts
from pdscope_jax.kernels import cpu_ffn, host_experts


class HostSplit:
    def __init__(self, store, config, device, expert_dtype, settle=None):
        self.store, self.config, self.device, self.dtype = store, config, device, expert_dtype
        self.settle = settle
        self.bridges: dict[int, host_experts.Bridge | None] = {}
        self.host_seconds: dict[int, float] = {}  # per batch: the bridge's kernel time for one expert, measured
        self.why_not = ""
        self.splits: dict[int, dict] = {}  # per batch: the last split `for_step` decided, for `stats()`
        weakref.finalize(self, _close, self.bridges)  # the engine gone: stop its workers, free their staging

    def for_step(self, runtime, planner, costs, batch: int) -> HostExperts | None:
        self.splits.pop(batch, None)
        computes = runtime.decode_cpu_experts != "off" and planner.decode_host_experts
        dma = runtime.decode_bridge_copies and planner.decode_copies and runtime.decode_cpu_experts != "xla"
        if not computes and not dma:
            return None
        bridge = None
        if runtime.decode_cpu_experts != "xla":
            bridge = self.bridges[batch] if batch in self.bridges else self._bridge(batch)
            if bridge is None:
                return None
        quantized = bridge is not None and not bridge.can_copy  # its experts: the step copies its share itself
        if quantized:
            if not computes:
                return None
            dma = False
        ahead = dma and runtime.decode_copies_ahead and planner.reads_next_scores
        if not computes:  # every miss copied, by the bridge's worker
            self.splits[batch] = {"copy_share": 1.0}
            return HostExperts(1.0, bridge, True, bridge_copies=True, ahead=ahead)
        weighed = {}  # the host's and the link's time for one expert, where the rule below compares them
        if not planner.decode_copies:
            share = 0.0
        elif runtime.decode_copy_share is not None:
            share = float(runtime.decode_copy_share)
        else:
            host, link = self._host_seconds(costs, batch, bridge), costs.t_transfer(1)
            weighed = {"host_ms": round(1e3 * host, 4), "link_ms": round(1e3 * link, 4)}
            if host <= link:  # copying what the host computes as fast only takes memory bandwidth from it
                self.splits[batch] = {"copy_share": 0.0, **weighed}
                return HostExperts(0.0, bridge, False)
            if quantized:  # the step's own copies wait for the GPU per layer: beside them, a slower host lost to
                self.splits[batch] = {"copy_share": 1.0, **weighed}
                return None  # copies alone (docs/MEASUREMENTS.md)
            share = round(host / (host + link), 2)
        self.splits[batch] = {"copy_share": share, **weighed}
        dma = dma and bridge is not None
        return HostExperts(share, bridge, planner.decode_copies, bridge_copies=dma, ahead=ahead and dma)

    def _host_seconds(self, costs, batch: int, bridge) -> float:
        """The host's seconds for one expert of a decode step: with a bridge, its kernel timed once on the
        store's own experts (read where they lie, as the bridge reads them); else the cost table's CPU time."""
        if bridge is None:
            return costs.t_cpu(batch)
        if batch not in self.host_seconds:
            cfg = self.config
            per_call = max(1, min(batch * cfg.num_experts_per_tok, cfg.num_experts) // 2)
            if self.settle is not None:  # copies still in flight (a policy's preload) would take its bandwidth
                self.settle()
            measured = kernel_seconds_per_expert(self.store, cfg, per_call, batch)
            self.host_seconds[batch] = costs.t_cpu(batch) if measured is None else measured
        return self.host_seconds[batch]

    def _bridge(self, batch: int) -> host_experts.Bridge | None:
        cfg = self.config
        addresses = None
        if self.dtype == jnp.bfloat16:
            addresses = [self.store.host_addresses(layer) for layer in cfg.moe_layers]
        if addresses is None or any(a is None for a in addresses):
            bridge, self.why_not = None, ("the experts are not bf16, or int8 / int4 with float32 or bf16 scales and "
                                          "compute dtype bf16, with host addresses")
        else:
            picks = min(batch * cfg.num_experts_per_tok, cfg.num_experts)
            bridge = host_experts.Bridge.create(addresses, (cfg.hidden_size, cfg.moe_intermediate_size), self.device,
                                                batch, picks)
            self.why_not = host_experts.why_not()
        self.bridges[batch] = bridge
        return bridge

    def stats(self) -> dict:
        bridges = {str(b): bridge.stats() for b, bridge in self.bridges.items() if bridge is not None}
        return {"bridges": bridges, "why_not": self.why_not,
                "splits": {str(b): dict(split) for b, split in sorted(self.splits.items())}}

    def close(self) -> None:
        _close(self.bridges)


def kernel_seconds_per_expert(store, config, per_call: int, rows: int = 1, repeats: int = 12) -> float | None:
    """`cpu_ffn.seconds_per_expert` on the store's own experts (bf16, int8 or int4) of the first three MoE layers (more
    bytes than a CPU's caches hold), read where they lie as the bridge reads them; None where the kernel is not
    built or the experts have no host addresses."""
    weights = [store.host_addresses(layer) for layer in config.moe_layers[:3]]
    if any(w is None for w in weights):
        return None
    return cpu_ffn.seconds_per_expert(functools.reduce(operator.add, weights),
                                      (config.hidden_size, config.moe_intermediate_size), per_call, rows, repeats)


def _close(bridges: dict) -> None:
    for bridge in bridges.values():
        if bridge is not None:
            bridge.close()
    bridges.clear()
