"""What picking a decode layer's eviction victims costs on the accelerator, and what exact alternatives cost.

Why: the device decode step picks each MoE layer's victims as `lax.top_k(-keep, r)` over every slot of the pool and
the decode bank (`engine.device_decode._victims`); a trace of Qwen3-30B-A3B's 48-layer step showed the step's sorts
growing with the pool. This times, per layer, in one program of --layers chained layers (each layer's victims
stamped with a new clock, so a layer depends on the one before, as in the step), over int32 `keep` tables of
--slots sizes (free slots -1 first, then distinct-ish clocks with ties):
- `top_k`: the step's `lax.top_k(-keep, r)`;
- `blocks`: the r blocks (of --block slots) with the smallest minima, then `top_k` over their union: exact, since
  each of the r smallest values lies in a block whose minimum is no larger, and at most r blocks hold such values
  (ties go to the lower index in both);
- `argmin`: r rounds of argmin, each masking the slot it found;
- `merge`: `engine.smallest` (what the step uses): one variadic reduction keeping the r smallest (value, index) pairs.
Every variant's victims are checked equal to `top_k`'s on the same tables (the probe fails otherwise). Also the
picks' own sorts: `sort` then a stable argsort by worth of --picks ids, against the argsort alone and against one
two-key `lax.sort` (worth, then id: the step's order).
Usage: python benchmarks/probes/probe_victims.py [--slots 3173 4799 8192] [--out F.json]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from _common import emit, probe_result
from pdscope_jax.bench.timing import median_seconds
from pdscope_jax.engine.smallest import smallest
from pdscope_jax.runtime import select_devices

PROTECTED = np.iinfo(np.int32).max


def top_k(keep, r: int, block: int):
    return jax.lax.top_k(-keep, r)[1]


def blocks(keep, r: int, block: int):
    s = keep.shape[0]
    nb = -(-s // block)
    padded = jnp.pad(keep, (0, nb * block - s), constant_values=PROTECTED).reshape(nb, block)
    best = jax.lax.top_k(-jnp.min(padded, axis=1), min(r, nb))[1]  # the r blocks with the smallest minima
    best = jnp.sort(best)  # in index order, so the union keeps the slots' order and ties go to the lower index
    union = padded[best].reshape(-1)
    at = jax.lax.top_k(-union, r)[1]
    return (best[at // block] * block + at % block).astype(jnp.int32)


def argmin(keep, r: int, block: int):
    found = []
    for _ in range(r):
        i = jnp.argmin(keep).astype(jnp.int32)
        found.append(i)
        keep = keep.at[i].set(PROTECTED)
    return jnp.stack(found)


def merge(keep, r: int, block: int):
    return smallest(keep, r)


VARIANTS = {"top_k": top_k, "blocks": blocks, "argmin": argmin, "merge": merge}


def chained(pick, layers: int, r: int, block: int):
    """`layers` layers: each picks r victims and stamps them with the next clock (the step's dependency chain)."""
    def run(keep, clock):
        out = []
        for _ in range(layers):
            v = pick(keep, r, block)
            clock = clock + 1
            keep = keep.at[v].set(clock)
            out.append(v)
        return keep, jnp.stack(out)
    return jax.jit(run)


def table(slots: int, free: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    keep = rng.integers(1, slots // 2, slots).astype(np.int32)  # about two slots a clock value: ties
    keep[rng.choice(slots, free, replace=False)] = -1
    return keep


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--slots", type=int, nargs="+", default=[3173, 4799, 8192])
    parser.add_argument("--victims", type=int, default=4, help="r: victims a layer (kept_rows of 8 picks)")
    parser.add_argument("--block", type=int, default=64)
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--picks", type=int, default=8)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    devices = select_devices()
    accel, records = devices.accel, []
    r, block, layers = args.victims, args.block, args.layers
    for slots in args.slots:
        for free in (0, 3 * r):
            keep = jax.device_put(table(slots, free, seed=slots + free), accel)
            clock = jax.device_put(np.int32(slots), accel)
            results = {name: chained(fn, layers, r, block) for name, fn in VARIANTS.items()}
            want = np.asarray(results["top_k"](keep, clock)[1])
            for name, fn in results.items():
                got = np.asarray(fn(keep, clock)[1])
                if not np.array_equal(got, want):
                    raise SystemExit(f"{name} picked other victims than top_k at {slots} slots, {free} free")
                seconds = median_seconds(lambda: fn(keep, clock), args.reps)
                emit(records, {"what": "victims", "variant": name, "slots": slots, "free": free, "victims": r,
                               "block": block, "layers": layers, "us_per_layer": round(seconds / layers * 1e6, 2)})
    rng = np.random.default_rng(0)
    ids = jax.device_put(np.stack([rng.choice(128, args.picks, replace=False) for _ in range(layers)]).astype(np.int32),
                         accel)  # each layer's picks distinct, as one row's top-k are
    worth = jax.device_put(rng.integers(0, 4, (layers, args.picks)).astype(np.int32), accel)

    def picks(how: str):
        def run(ids, worth):
            out = []
            for layer in range(layers):  # chained: each layer's order feeds the next one's worth
                key = -(worth[layer] + (out[-1][0] if out else 0))
                if how == "one_sort":
                    out.append(jax.lax.sort((key, ids[layer]), num_keys=2)[1])
                    continue
                p = jnp.sort(ids[layer]) if how == "sort_then_argsort" else ids[layer]
                order = jnp.argsort(key[jnp.argsort(ids[layer])] if how == "sort_then_argsort" else key, stable=True)
                out.append(p[order])
            return jnp.stack(out)
        return jax.jit(run)

    programs = {how: picks(how) for how in ("sort_then_argsort", "argsort_only", "one_sort")}
    orders = {how: np.asarray(programs[how](ids, worth)) for how in ("sort_then_argsort", "one_sort")}
    if not np.array_equal(*orders.values()):
        raise SystemExit("the two-key sort ordered the picks otherwise than sort then stable argsort")
    for how, program in programs.items():
        seconds = median_seconds(lambda: program(ids, worth), args.reps)
        emit(records, {"what": "picks", "order": how, "picks": args.picks, "layers": layers,
                       "us_per_layer": round(seconds / layers * 1e6, 2)})
    return probe_result("eviction victims and picks' sorts per decode layer", devices, records, args.out)


if __name__ == "__main__":
    main()
