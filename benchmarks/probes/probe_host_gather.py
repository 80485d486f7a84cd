"""Can one jitted program choose, on the accelerator, which experts to copy from pinned host memory?

Why: in host-driven decode every MoE layer fetches its routing to the host, plans, and dispatches loads and
expert programs. If a program could copy the experts its own router picked, straight from pinned host memory, a
decode layer (or a whole decode step) would need no host round trip. This probe runs the ways such a program
could be written, each with k experts (k: the first of `--experts`) of DeepSeek-V2-Lite's shape (random weights)
picked by an index that lives on the accelerator, and reports per way whether it compiles, the largest error of
its result against numpy-held weights, its time (median of `--reps`, waited for) and copy rate:
  slice    `lax.dynamic_index_in_dim` into a pinned [E, D, 2F] layer stack, then `device_put(.., Space.Device)`;
  gather   `stack[idx]` (one gather of k experts) into device memory;
  switch   per pick, `lax.switch(idx, branches)` over E per-expert pinned arrays, branch e copying expert e;
  cond     `switch`, plus a per-pick `lax.cond` that reads a device slot pool instead where the expert is resident
           (half the picks are made resident): copies only the misses;
  baseline the engine's way: the index on the host, one `device_put` of the k experts' pinned arrays.
Then `chain`: `--layers` layers in one program, each routing a row with a random router, top-k, copying the picks
with the first of `slice` and `switch` that worked (and again with `cond` where it worked), and running them: the
time per layer when nothing returns to the host.
Run from the repository root: `PYTHONPATH=. python benchmarks/probes/probe_host_gather.py [--out FILE]`.
Writes one JSON line per record to stdout and, with --out, the result of `_common.probe_result` as JSON.
"""

from __future__ import annotations

import statistics
import time

from _common import emit, expert_shape_parser, memory_shardings, probe_result


def main(argv: list[str] | None = None) -> dict:
    args = expert_shape_parser(__doc__.splitlines()[0], reps=20, num_experts=64, layers=4).parse_args(argv)
    from pdscope_jax.runtime import request_cpu_stand_in, select_devices

    request_cpu_stand_in()
    import jax
    import jax.numpy as jnp
    import numpy as np

    from pdscope_jax.models.layers import expert_ffn

    devices = select_devices()
    accel = devices.accel
    pinned, on_device = memory_shardings(accel)
    device_space = jax.memory.Space.Device
    e, d, f = args.num_experts, args.hidden, args.intermediate
    rng = np.random.default_rng(0)

    def layer_stack():
        gu = (rng.standard_normal((e, d, 2 * f), np.float32) * 0.02).astype(jnp.bfloat16)
        dn = (rng.standard_normal((e, f, d), np.float32) * 0.02).astype(jnp.bfloat16)
        return gu, dn

    layers_np = [layer_stack() for _ in range(args.layers)]
    stacks = [tuple(jax.device_put(a, pinned) for a in layer) for layer in layers_np]
    per_expert = [tuple([jax.device_put(a[i], pinned) for i in range(e)] for a in layer) for layer in layers_np]
    gu_np, dn_np = layers_np[0]
    x = jax.device_put(rng.standard_normal((1, d), np.float32).astype(jnp.bfloat16), accel)

    def run(x, gus, dns):
        return sum(expert_ffn(x, gu, dn).astype(jnp.float32) for gu, dn in zip(gus, dns))

    def pull_slice(gu_stack, dn_stack, i):
        pick = lambda a: jax.device_put(jax.lax.dynamic_index_in_dim(a, i, keepdims=False), device_space)
        return pick(gu_stack), pick(dn_stack)

    def pull_switch(gus, dns, i):
        def branch(j):
            return lambda: (jax.device_put(gus[j], device_space), jax.device_put(dns[j], device_space))
        return jax.lax.switch(i, [branch(j) for j in range(len(gus))])

    def way_slice(x, stack, idx):
        picks = [pull_slice(*stack, idx[k]) for k in range(idx.shape[0])]
        return run(x, *zip(*picks))

    def way_gather(x, stack, idx):
        gu = jax.device_put(stack[0][idx], device_space)
        dn = jax.device_put(stack[1][idx], device_space)
        return run(x, list(gu), list(dn))

    def way_switch(x, experts, idx):
        picks = [pull_switch(*experts, idx[k]) for k in range(idx.shape[0])]
        return run(x, *zip(*picks))

    def way_cond(x, experts, idx, slot_of, pool):
        def pick(i):
            return jax.lax.cond(slot_of[i] >= 0, lambda: (pool[0][slot_of[i]], pool[1][slot_of[i]]),
                                lambda: pull_switch(*experts, i))
        return run(x, *zip(*[pick(idx[k]) for k in range(idx.shape[0])]))

    k = args.experts[0]
    picks = [jax.device_put(rng.choice(e, k, replace=False).astype(np.int32), accel) for _ in range(args.reps)]
    resident = np.arange(0, e, 2)  # even experts resident in a device pool
    slot_of = np.full(e, -1, np.int32)
    slot_of[resident] = np.arange(len(resident))
    pool = (jax.device_put(gu_np[resident], accel), jax.device_put(dn_np[resident], accel))
    slot_of = jax.device_put(slot_of, accel)

    baseline_jit = jax.jit(run)

    def call_baseline(idx):
        ids = np.asarray(idx)  # the host round trip the engine makes
        gus = jax.device_put([per_expert[0][0][i] for i in ids], on_device)
        dns = jax.device_put([per_expert[0][1][i] for i in ids], on_device)
        return baseline_jit(x, gus, dns)

    ways = {
        "slice": (jax.jit(way_slice), lambda idx: (x, stacks[0], idx)),
        "gather": (jax.jit(way_gather), lambda idx: (x, stacks[0], idx)),
        "switch": (jax.jit(way_switch), lambda idx: (x, per_expert[0], idx)),
        "cond": (jax.jit(way_cond), lambda idx: (x, per_expert[0], idx, slot_of, pool)),
    }
    records = []
    working = []
    for name, (fn, make_args) in [*ways.items(), ("baseline", (None, None))]:
        record = {"way": name, "experts": k}
        try:
            call = (lambda idx: fn(*make_args(idx))) if fn else call_baseline
            got = np.asarray(call(picks[0]))
            ids = np.asarray(picks[0])
            want = np.asarray(run(jnp.asarray(np.asarray(x)), list(gu_np[ids]), list(dn_np[ids])))
            record["max_abs_err"] = float(np.max(np.abs(got - want)))
            times = []
            for idx in picks:
                start = time.perf_counter()
                jax.block_until_ready(call(idx))
                times.append(time.perf_counter() - start)
            record["ms"] = 1e3 * statistics.median(times)
            record["gb_per_s"] = k * (gu_np[0].nbytes + dn_np[0].nbytes) / (record["ms"] / 1e3) / 1e9
            if fn and record["max_abs_err"] < 1e-2:
                working.append(name)
        except Exception as error:  # a way XLA cannot compile is a result, not a crash
            record["error"] = f"{type(error).__name__}: {str(error)[:400]}"
        emit(records, record)

    chains = [w for w in ("slice", "switch") if w in working][:1] + [w for w in ("cond",) if w in working]
    routers = [jax.device_put((rng.standard_normal((d, e), np.float32) * 0.02).astype(jnp.bfloat16), accel)
               for _ in range(args.layers)]
    pools = [(jax.device_put(gu[resident], accel), jax.device_put(dn[resident], accel)) for gu, dn in layers_np]
    for chain_way in chains:
        def chain(x, operands, routers, pools, way=chain_way):
            for layer_operands, router, layer_pool in zip(operands, routers, pools):
                _, idx = jax.lax.top_k(jnp.dot(x, router, preferred_element_type=jnp.float32)[0], k)
                if way == "cond":
                    y = way_cond(x, layer_operands, idx, slot_of, layer_pool)
                else:
                    y = {"slice": way_slice, "switch": way_switch}[way](x, layer_operands, idx)
                x = (x + y).astype(x.dtype)
            return x

        chain_jit = jax.jit(chain)
        operands = stacks if chain_way == "slice" else per_expert
        jax.block_until_ready(chain_jit(x, operands, routers, pools))
        times = []
        for _ in range(args.reps):
            start = time.perf_counter()
            jax.block_until_ready(chain_jit(x, operands, routers, pools))
            times.append(time.perf_counter() - start)
        record = {"way": f"chain_{chain_way}", "experts": k, "layers": args.layers,
                  "ms_per_layer": 1e3 * statistics.median(times) / args.layers}
        emit(records, record)
    return probe_result("accelerator-side choice of experts to copy from pinned host memory (random weights)",
                        devices, records, args.out, hidden=d, intermediate=f, num_experts=e)


if __name__ == "__main__":
    main()
