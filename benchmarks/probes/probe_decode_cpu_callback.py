"""Can a one-program decode step hand some of a layer's missed experts to the CPU backend while it copies others?

Why: the device decode step (`pdscope_jax.engine.device_decode`) copies every missed expert to the accelerator,
because one accelerator program cannot run experts on the CPU backend. It can call the host, though
(`jax.pure_callback`): if the host runs some misses on the JAX CPU backend during that call while the program's
copies of the other misses are in flight, the host link and the host's memory serve one layer together.
What: `--layers` stand-in MoE layers of DeepSeek-V2-Lite's expert shape in one program, one row, per variant
"g+c" (`--variants`, default all of `VARIANTS`): each layer copies g experts from a pinned host layer stack
(index on the accelerator) and runs them there, and hands c other experts to a callback that runs them on the
CPU backend (rows padded to `--cpu-rows`; the CPU arrays are separate copies here, the engine's alias the pinned
bytes). "0+0" is a callback that computes nothing (its own cost; recorded as "0+0cb"). Random weights;
`--experts` is not used.
Reports per variant: ms per layer (median of --reps, waited for), and the bare CPU time of c experts outside any
program (`cpu_alone_ms`); a variant that fails records its error instead.
Run from the repository root: `PYTHONPATH=. python benchmarks/probes/probe_decode_cpu_callback.py [--out FILE]`.
Writes one line per record to stdout and, with --out, the result of `_common.probe_result` as JSON.
"""

from __future__ import annotations

import functools

from _common import expert_shape_parser, many_experts, memory_shardings, probe_result, random_experts
from pdscope_jax.bench.timing import median_seconds

VARIANTS = ("4+0", "0+4", "2+2", "4+2", "3+3", "6+0", "0+0")


def main(argv: list[str] | None = None) -> dict:
    parser = expert_shape_parser(__doc__.splitlines()[0], reps=20, num_experts=16, layers=8, cpu_rows=16)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), help="g+c: g copied, c on the CPU")
    args = parser.parse_args(argv)
    from pdscope_jax.runtime import request_cpu_stand_in, select_devices

    request_cpu_stand_in()
    import jax
    import jax.numpy as jnp
    import numpy as np

    from pdscope_jax.models.layers import expert_ffn

    devices = select_devices()
    accel, cpu = devices.accel, devices.cpu
    pinned, _ = memory_shardings(accel)
    device_space = jax.memory.Space.Device
    e, d, f, layers = args.num_experts, args.hidden, args.intermediate, args.layers
    host = [random_experts(d, f, e, seed=layer) for layer in range(layers)]
    stacks = [(jax.device_put(np.stack(gus), pinned), jax.device_put(np.stack(dns), pinned)) for gus, dns in host]
    cpu_weights = [([jax.device_put(a, cpu) for a in gus], [jax.device_put(a, cpu) for a in dns]) for gus, dns in host]
    cpu_run = jax.jit(many_experts)
    rng = np.random.default_rng(1)

    def on_cpu(x, ids, layer):
        """Host side of the callback: the experts `ids` of `layer` over x [1, D] on the CPU backend."""
        if ids.size == 0:
            return np.zeros((1, d), np.float32)
        rows = jax.device_put(np.pad(x, ((0, args.cpu_rows - 1), (0, 0))), cpu)
        gus, dns = cpu_weights[layer]
        return np.asarray(cpu_run(rows, [gus[i] for i in ids], [dns[i] for i in ids]))[:1]

    def build(g: int, c: int, callback: bool):
        def step(x, ids_all, stacks):
            for layer, (gu_stack, dn_stack) in enumerate(stacks):
                ids = ids_all[layer]
                y = jnp.zeros((1, d), jnp.float32)
                if callback:
                    shape = jax.ShapeDtypeStruct((1, d), jnp.float32)
                    y = jax.pure_callback(functools.partial(on_cpu, layer=layer), shape, x, ids[g:g + c])
                if g:
                    gu = jnp.stack([jax.device_put(jax.lax.dynamic_index_in_dim(gu_stack, ids[i], keepdims=False),
                                                   device_space) for i in range(g)])
                    dn = jnp.stack([jax.device_put(jax.lax.dynamic_index_in_dim(dn_stack, ids[i], keepdims=False),
                                                   device_space) for i in range(g)])
                    rows = jnp.broadcast_to(x, (g, *x.shape))
                    y = y + jnp.sum(jax.vmap(expert_ffn)(rows, gu, dn).astype(jnp.float32), axis=0)
                x = (x.astype(jnp.float32) + y) / (1.0 + jnp.sqrt(jnp.mean(y * y)))
                x = x.astype(jnp.bfloat16)
            return x
        return jax.jit(step)

    x = jax.device_put(rng.standard_normal((1, d)).astype(jnp.bfloat16), accel)
    records = []
    for g, c in (tuple(int(n) for n in variant.split("+")) for variant in args.variants):
        callback = c > 0 or g == 0
        ids_all = jax.device_put(np.stack([rng.permutation(e)[:max(g + c, 1)] for _ in range(layers)])
                                 .astype(np.int32), accel)
        program = build(g, c, callback)
        try:
            ms = median_seconds(lambda: program(x, ids_all, stacks), args.reps) * 1e3
        except Exception as error:  # noqa: BLE001 - the probe reports what did not work
            records.append({"variant": f"{g}+{c}", "error": f"{type(error).__name__}: {error}"[:400]})
            continue
        record = {"variant": f"{g}+{c}" + ("cb" if callback and not c else ""), "ms_per_layer": ms / layers}
        if c:
            rows = jax.device_put(np.zeros((args.cpu_rows, d), jnp.bfloat16), cpu)
            gus, dns = cpu_weights[0]
            record["cpu_alone_ms"] = median_seconds(lambda: cpu_run(rows, gus[:c], dns[:c]), args.reps) * 1e3
        records.append(record)
        print(record, flush=True)
    return probe_result("decode step with CPU experts through a host callback", devices, records, args.out,
                        weights="seeded random", hidden=d, intermediate=f, layers=layers,
                        cpu_rows=args.cpu_rows)


if __name__ == "__main__":
    main()
