"""How long dispatching one program holds the host, for the kinds of call a decode layer makes.

Builds a two-layer model of `--model`'s shapes (layer 1 is an MoE layer; seeded random weights) in the offload
engine, then, per case, measures the host time of the call alone (median of `--reps`; the result is waited for
after the clock stops, so no call waits on the one before):
  route            the engine's route program (attention, router, shared experts) with the layer's NNX state;
  route_leaves     the same program given the state as a flat list of arrays (its tree structure static);
  trivial          a one-op program on one accelerator array (the floor of a dispatch);
  trivial_numpy    the same program given a small numpy array (it is copied to the accelerator in the call);
  trivial_pinned   that numpy array put into the accelerator's pinned host memory first (a host copy), then given
                   to a program that copies it to device memory itself;
  device_put_numpy `jax.device_put` of that numpy array alone;
and every case but the route programs again while the copy of `--busy-experts` experts from pinned host memory
is in flight, issued in one of three ways just before the call (`..._busy_put`: one batched `jax.device_put`;
`..._busy_pull`: a jitted program that copies them to device memory itself; `..._busy_put_later`: a
`device_put`, then `--later-ms` of waiting before the call, to tell the copy's issue from its flight).
`--host-alloc torch` pins the experts' host memory with torch instead of jax (the expert store's option), to tell
whether copies from that memory get in the way of dispatches less. Reads the runner's private layers, cache and
host store on purpose. Reports per case: the median and p90 host ms.
Run from the repository root: `PYTHONPATH=. python benchmarks/probes/probe_dispatch.py [--out FILE]`.
Writes one JSON line per case to stdout and, with --out, the result of `_common.probe_result` as JSON.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="deepseek-v2-lite")
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--busy-experts", type=int, default=8)
    p.add_argument("--later-ms", type=float, default=1.0)
    p.add_argument("--host-alloc", default="jax", choices=["jax", "torch"],
                   help="who pins the experts' host memory (store.expert_store; torch: GPU only)")
    p.add_argument("--out", type=Path, default=None)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    from pdscope_jax.runtime import request_cpu_stand_in

    request_cpu_stand_in()
    import jax
    import jax.numpy as jnp
    import numpy as np

    from _common import emit, memory_shardings, probe_result, random_loader
    from pdscope_jax import models
    from pdscope_jax.engine.programs import moe_route
    from pdscope_jax.engine.runner import OffloadRunner
    from pdscope_jax.presets import preset
    from pdscope_jax.runtime import RuntimeConfig

    cfg = preset(args.model).replace(num_layers=2)
    layer_index = cfg.moe_layers[0]
    shapes = models.abstract_state(cfg, jnp.bfloat16)
    runner = OffloadRunner(models.abstract_model(cfg, jnp.bfloat16), RuntimeConfig(policy="ondemand", max_seq_len=64),
                           random_loader(shapes, 0), host_alloc=args.host_alloc)
    accel = runner.devices.accel
    layer = runner._layers[layer_index]
    cache = list(runner._init_cache(1, 64, runner.cache_dtype))[layer_index]
    cache = jax.device_put(cache, accel)
    x = jax.device_put(np.zeros((1, 1, cfg.hidden_size), runner.cache_dtype), accel)
    positions = jax.device_put(np.zeros((1, 1), np.int32), accel)
    route = jax.jit(moe_route, static_argnums=(0, 5, 6), donate_argnums=4)
    leaves, treedef = jax.tree.flatten(layer.state)

    def route_from_leaves(graph, leaves, x, positions, layer_cache, n_pad, with_h):
        return moe_route(graph, jax.tree.unflatten(treedef, leaves), x, positions, layer_cache, n_pad, with_h)

    route_leaves = jax.jit(route_from_leaves, static_argnums=(0, 5, 6), donate_argnums=4)
    trivial = jax.jit(lambda a: a + 1)
    trivial_pull = jax.jit(lambda a, b: a + jax.device_put(b, jax.memory.Space.Device))
    pinned_sharding, _ = memory_shardings(accel)
    small_device = jax.device_put(np.zeros(64, np.int32), accel)
    small_numpy = np.zeros(64, np.int32)
    busy_experts = np.arange(args.busy_experts)
    pinned = runner.store._host[layer_index]
    pull = jax.jit(lambda arrays: [jax.device_put(a, jax.memory.Space.Device) for a in arrays])
    busy_arrays = [a for part in pinned for a in part[: args.busy_experts]]

    def put():
        return runner.store.stage(layer_index, busy_experts).gate_ups

    def put_later():
        staged = put()
        until = time.perf_counter() + args.later_ms / 1e3
        while time.perf_counter() < until:  # the copy flies meanwhile; a probe's wait, not work
            pass
        return staged

    issue = {"": None, "_busy_put": put, "_busy_pull": lambda: pull(busy_arrays), "_busy_put_later": put_later}
    state = {"cache": cache}

    def call_route(fn, params):
        def call():
            out = fn(layer.graph, params, x, positions, state["cache"], 1, True)
            state["cache"] = out[-1]
            return out
        return call

    cases = {
        "route": call_route(route, layer.state),
        "route_leaves": call_route(route_leaves, leaves),
        "trivial": lambda: trivial(small_device),
        "trivial_numpy": lambda: trivial(small_numpy),
        "trivial_pinned": lambda: trivial_pull(small_device, jax.device_put(small_numpy, pinned_sharding)),
        "device_put_numpy": lambda: jax.device_put(small_numpy, accel),
    }
    records = []
    for suffix, busy in issue.items():
        for name, call in cases.items():
            if busy and name.startswith("route"):
                continue
            jax.block_until_ready((call(), busy() if busy else None))  # compile
            held = []
            for _ in range(args.reps):
                in_flight = busy() if busy else None
                start = time.perf_counter()
                out = call()
                held.append(time.perf_counter() - start)
                jax.block_until_ready((out, in_flight))
            emit(records, {"case": name + suffix, "host_ms": 1e3 * statistics.median(held),
                           "host_ms_p90": 1e3 * sorted(held)[int(0.9 * len(held))]})
    return probe_result("host time of one dispatch per kind of call (random weights)", runner.devices, records,
                        args.out, model=cfg.name, host_alloc=args.host_alloc, state_leaves=len(leaves))


if __name__ == "__main__":
    main()
