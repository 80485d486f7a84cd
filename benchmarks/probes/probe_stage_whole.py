"""Time a layer's experts staged and committed into slots: one copy per expert array, or the layer's whole stack.

What: one layer of seeded random experts in the store as the engine keeps them (`ExpertStore`, its default host
allocation: on a GPU, page-locked stacks through the driver), in each `--scheme` (bf16, int8, int4) at Qwen3-30B-A3B's
shape by default (128 experts, 2048 x 768). For each count of experts, both ways forced (`expert_store.COPY_SECONDS`
at 0 or huge), stage + commit into a pool of as many slots, timed to the pool's readiness: median of `--reps` after 2
warm-ups. Reports ms, the experts' own GB/s (what the engine needs moved) and the link's (bytes moved), the count
where `moves_whole` switches with the shipped constants, and the per-copy cost and link rate the times imply (the
fit of t = copies x c + bytes / rate over every timing of both ways).
Usage: python benchmarks/probes/probe_stage_whole.py [--scheme int4 bf16] [--experts 128] [--d 2048] [--f 768]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from _common import emit, probe_result
from pdscope_jax.quant.formats import quantize
from pdscope_jax.runtime import select_devices
from pdscope_jax.store import expert_store
from pdscope_jax.store.expert_store import ExpertStore
from pdscope_jax.store.slot_pool import SlotPool


def layer_stacks(e: int, d: int, f: int, scheme: str, seed: int):
    key_gu, key_dn = jax.random.split(jax.random.key(seed))
    gu = jax.random.normal(key_gu, (e, d, 2 * f), jnp.float32).astype(jnp.bfloat16) * 0.02
    dn = jax.random.normal(key_dn, (e, f, d), jnp.float32).astype(jnp.bfloat16) * 0.02
    return (gu, dn) if scheme == "bf16" else (quantize(gu, scheme), quantize(dn, scheme))


def timed(store: ExpertStore, pool: SlotPool, count: int, whole: bool, reps: int) -> float:
    expert_store.COPY_SECONDS = 1.0 if whole else 0.0
    experts = np.random.default_rng(count).choice(pool.num_slots, count, replace=False)
    times = []
    for rep in range(reps + 2):
        pool.release(1, np.arange(pool.num_slots))
        slots = pool.allocate(1, experts)
        start = time.perf_counter()
        staged = store.stage(1, experts)
        assert (staged.stack is not None) == whole
        store.commit(pool, staged, slots)
        jax.block_until_ready((pool.gate_up, pool.down))
        if rep >= 2:
            times.append(time.perf_counter() - start)
    return float(np.median(times))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scheme", nargs="+", default=["int4", "bf16"], choices=["bf16", "int8", "int4"])
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--d", type=int, default=2048)
    parser.add_argument("--f", type=int, default=768)
    parser.add_argument("--counts", type=int, nargs="+", default=[4, 8, 16, 32, 64, 128])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    devices = select_devices()
    shipped = expert_store.COPY_SECONDS
    records = []
    for scheme in args.scheme:
        store = ExpertStore(devices, stacks=True)  # free with the driver's buffers (a GPU); a second copy else
        gu, dn = layer_stacks(args.experts, args.d, args.f, scheme, seed=1)
        store.add_layer(1, gu, dn)
        del gu, dn
        quant = None if scheme == "bf16" else scheme
        pool = SlotPool(args.experts, (1,), args.experts, args.d, args.f, jnp.bfloat16, devices.accel, quant=quant)
        each = store.expert_nbytes(1, np.arange(1))
        arrays = len(jax.tree.leaves(store.layer_experts(1)[0][0])) * 2
        points = []  # (copies, bytes, seconds) of every timing, both ways
        for count in [c for c in args.counts if c <= args.experts]:
            seconds = {way: timed(store, pool, count, way == "whole", args.reps) for way in ("one_by_one", "whole")}
            moved = {"one_by_one": count * each, "whole": args.experts * each}
            points += [(count * arrays, moved["one_by_one"], seconds["one_by_one"]),
                       (arrays, moved["whole"], seconds["whole"])]
            emit(records, {"scheme": scheme, "count": count, "expert_bytes": each, "arrays_per_expert": arrays,
                           "host_alloc": store.host_alloc,
                           **{f"{way}_ms": 1e3 * s for way, s in seconds.items()},
                           **{f"{way}_expert_gb_s": count * each / s / 1e9 for way, s in seconds.items()},
                           **{f"{way}_link_gb_s": moved[way] / s / 1e9 for way, s in seconds.items()}})
        expert_store.COPY_SECONDS = shipped
        copies, nbytes, seconds = (np.array(column, float) for column in zip(*points))
        fit = np.linalg.lstsq(np.stack([copies, nbytes], 1), seconds, rcond=None)[0]
        emit(records, {"scheme": scheme, "whole_from_shipped": store.whole_from(1),
                       "fit_seconds_per_copy": float(fit[0]),
                       "fit_link_gb_s": float(1 / fit[1] / 1e9) if fit[1] > 0 else None})
        del store, pool
    probe_result("a layer's experts staged one copy per array against the whole stack (seeded random weights)",
                 devices, records, args.out, copy_seconds=shipped,
                 link_bytes_per_second=expert_store.LINK_BYTES_PER_SECOND)


if __name__ == "__main__":
    main()
