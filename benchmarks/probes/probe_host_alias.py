"""Can a GPU program read page-locked host memory in place (zero-copy over PCIe), and do its copies then need no host
round trip? Prints one JSON object per finding.

A layer of `--experts` experts of `--expert-mib` MiB each (Qwen3-30B-A3B's int4 expert is 2.5 MiB) is page-locked
through the CUDA driver (`store.page_locked.HostBuffer`) and imported twice through dlpack: as `pinned_host` memory
(the store's way; a program copies from it with `device_put`) and as device memory at the address the driver maps it
to (`page_locked.device_alias`; a program reads it like any array, over PCIe).
1. mapping: whether the alias was made, and the memory kinds;
2. values: rows gathered from the alias equal the host's bytes;
3. bandwidth: k rows (1, 2, 8) gathered from the alias, against the same rows copied with `device_put`;
4. round trips: a scan of `--layers` steps, each a `lax.switch` on a count held on the GPU (0 rows, or 1/2/4/8
   rows copied) and a small sum, compiled with the chunk programs' command buffers (CONDITIONAL among them): ms a
   step where every count is 0 (the conditional's own cost) and where every count is 1, the copies from the
   alias against the copies with `device_put`. A conditional XLA cannot record evaluates its predicate on the host,
   which waits for the GPU at every step;
5. conditional forms: a layer's `lax.cond` with trivial branches, against a select and nothing, in a scan and
   unrolled, with and without those command buffers.
Run on the GPU node from the repository root: `PYTHONPATH=. python3 benchmarks/probes/probe_host_alias.py [--out F]`.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from pdscope_jax.bench.timing import median_seconds
from pdscope_jax.generation.generator import CHUNK_COMPILER_OPTIONS
from pdscope_jax.store import page_locked
from _common import emit, probe_result


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--expert-mib", type=float, default=2.5)
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    accel = jax.devices()[0]
    words = int(args.expert_mib * 2**20) // 4
    shape = (args.experts, words)
    records: list[dict] = []

    buffer = page_locked.HostBuffer(args.experts * words * 4, accel.local_hardware_id)
    host = np.frombuffer(buffer.view, np.uint32).reshape(shape)
    host[:] = np.random.default_rng(0).integers(0, 2**32, shape, dtype=np.uint32)
    pinned = page_locked.import_array(buffer, 0, shape, np.uint32, accel)
    alias = page_locked.device_alias(buffer, 0, shape, np.uint32, accel)
    emit(records, {"what": "mapping", "alias": alias is not None, "pinned_memory_kind": pinned.sharding.memory_kind})
    if alias is None:
        return probe_result("page-locked host memory read in place by GPU programs", argparse.Namespace(accel=accel),
                            records, args.out)

    ids = jnp.asarray(np.random.default_rng(1).permutation(args.experts)[:8], jnp.int32)
    gathered = np.asarray(jax.jit(lambda a, i: a[i])(alias, ids))
    emit(records, {"what": "values", "alias_rows_equal_host": bool(np.array_equal(gathered, host[np.asarray(ids)]))})

    device = jax.sharding.SingleDeviceSharding(accel, memory_kind="device")

    def alias_rows(a, i):
        return a[i]

    def copied_rows(p, i):
        return jnp.stack([jax.device_put(jax.lax.dynamic_index_in_dim(p, i[j], keepdims=False), device)
                          for j in range(i.shape[0])])

    for k in (1, 2, 8):
        from_alias = jax.jit(lambda a, i, k=k: alias_rows(a, i[:k]) + 0)
        by_copy = jax.jit(lambda p, i, k=k: copied_rows(p, i[:k]) + 0)
        seconds = {"alias": median_seconds(lambda: from_alias(alias, ids), args.repeats),
                   "device_put": median_seconds(lambda: by_copy(pinned, ids), args.repeats)}
        emit(records, {"what": "bandwidth", "rows": k, "bytes": k * words * 4,
                       **{f"{name}_ms": s * 1e3 for name, s in seconds.items()},
                       **{f"{name}_gb_s": k * words * 4 / s / 1e9 for name, s in seconds.items()}})

    counts_list = (0, 1, 2, 4, 8)

    def layers(source, copy):
        def step(total, count_and_ids):
            count, i = count_and_ids
            branches = [lambda j=j: jnp.sum(copy(source, i[:j]).astype(jnp.float32)) if j else jnp.float32(0)
                        for j in counts_list]
            return total + jax.lax.switch(jnp.searchsorted(jnp.array(counts_list), count), branches), None
        return step

    # other experts at every layer, so that no read is served from the GPU's L2 by an earlier layer's
    layer_ids = jnp.asarray(np.stack([np.random.default_rng(2 + j).permutation(args.experts)[:8]
                                      for j in range(args.layers)]), jnp.int32)
    for name, source, copy in (("alias", alias, alias_rows), ("device_put", pinned, copied_rows)):
        program = jax.jit(lambda s, c, i, copy=copy: jax.lax.scan(layers(s, copy), jnp.float32(0), (c, i))[0],
                          compiler_options=CHUNK_COMPILER_OPTIONS if accel.platform == "gpu" else None)
        for count in (0, 1):
            counts = jnp.full((args.layers,), count, jnp.int32)
            seconds = median_seconds(lambda: program(source, counts, layer_ids), args.repeats)
            emit(records, {"what": "round trips", "source": name, "count": count, "layers": args.layers,
                           "ms_per_layer": seconds * 1e3 / args.layers})
    _conditional_forms(records, args, accel)
    return probe_result("page-locked host memory read in place by GPU programs", argparse.Namespace(accel=accel),
                        records, args.out, experts=args.experts, expert_mib=args.expert_mib)


def _conditional_forms(records: list, args, accel) -> None:
    """A conditional's own cost a layer: `--layers` layers of a scalar chain, each a `lax.cond` with trivial
    branches, a select of both, or nothing, in a scan or unrolled, with and without the chunk programs'
    command buffers."""
    def cond(total, count):
        return total + jax.lax.cond(count > 0, lambda: jnp.float32(1), lambda: jnp.float32(0))

    def select(total, count):
        return total + jnp.where(count > 0, jnp.float32(1), jnp.float32(0))

    def plain(total, count):
        return total + count.astype(jnp.float32)

    counts = jnp.zeros((args.layers,), jnp.int32)
    for buffers in (True, False):
        options = CHUNK_COMPILER_OPTIONS if buffers and accel.platform == "gpu" else None
        for name, layer in (("cond", cond), ("select", select), ("none", plain)):
            for form in ("scan", "unrolled"):
                def chain(c, layer=layer, form=form):
                    if form == "scan":
                        return jax.lax.scan(lambda t, x: (layer(t, x), None), jnp.float32(0), c)[0]
                    total = jnp.float32(0)
                    for j in range(args.layers):
                        total = layer(total, c[j])
                    return total
                program = jax.jit(chain, compiler_options=options)
                seconds = median_seconds(lambda: program(counts), args.repeats)
                emit(records, {"what": "conditional forms", "form": name, "loop": form,
                               "command_buffers": bool(options), "ms_per_layer": seconds * 1e3 / args.layers})


if __name__ == "__main__":
    main()
