"""Check on a GPU that the kernels read and write the far slots of a 2-4 GB quantized slot pool (`triton_offsets`).

What: a pool's down stack of seeded random int4 (or int8) experts, Qwen3-30B-A3B's shape (768 x 2048), with enough
slots that its integers hold 2^31 elements or more within 4 GiB (3,322 int4 slots: 2.6 GB, the pool of a 16 GB
budget; 2,000 int8 slots: 3.1 GB). For picks in slots before and past the 2^31st byte:
- `gather_matvec` against XLA's product of the same picks gathered and dequantized (relative error, max over rows);
- `row_copy.copy_rows` of random experts into far and near slots: every copied slot equal to its source, every other
  slot's byte sum unchanged.
`--unwrapped` runs the matvec with the lowering's own 32-bit offsets forced (the wrap off, the kernel's refusal
bypassed) to show what the wrap prevents: wrong rows, or a fault that ends the process (run it alone, last).
Usage: python benchmarks/probes/probe_wide_offsets.py [--scheme int4 int8] [--unwrapped] [--out F.json]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from _common import emit, probe_result
from pdscope_jax.kernels import gather_matvec as gm
from pdscope_jax.kernels import row_copy, triton_offsets
from pdscope_jax.quant.formats import quantize

F, D = 768, 2048
SLOTS = {"int4": 3322, "int8": 2000}


def random_stack(slots: int, scheme: str, seed: int):
    """A QuantizedWeight [slots, F, D] of random integers and scales in [0.005, 0.015), generated on the GPU."""
    abstract = jax.eval_shape(lambda: quantize(jnp.ones((slots, F, D), jnp.bfloat16), scheme))
    leaves, tree = jax.tree.flatten(abstract)
    keys = jax.random.split(jax.random.key(seed), len(leaves))

    def fill(key, leaf):
        if jnp.issubdtype(leaf.dtype, jnp.integer):
            bits = jax.random.bits(key, leaf.shape, jnp.uint8)
            return jax.lax.bitcast_convert_type(bits, leaf.dtype) if leaf.dtype != jnp.uint8 else bits
        return jax.random.uniform(key, leaf.shape, jnp.float32, 0.005, 0.015).astype(leaf.dtype)

    return tree.unflatten([jax.jit(fill)(k, leaf) for k, leaf in zip(keys, leaves)])


def far_slots(slots: int, row_bytes: int) -> np.ndarray:
    """Slots on both sides of the 2^31st byte of the integers, the last ones and the first."""
    edge = 2**31 // row_bytes
    return np.array([slots - 1, slots - 2, edge + 1, edge, edge - 1, 1, 0], np.int32)


def check_matvec(w, idx, seed: int) -> dict:
    x = jax.random.normal(jax.random.key(seed), (idx.shape[0], F), jnp.float32).astype(jnp.bfloat16)
    got = jax.jit(gm.gather_matvec)(x, w, idx)
    picked = jax.tree.map(lambda a: a[idx], w)
    want = jnp.einsum("ak,akn->an", x.astype(jnp.float32), picked.dequantize(jnp.float32),
                      precision=jax.lax.Precision.HIGHEST)
    err = jnp.linalg.norm(got - want, axis=-1) / jnp.linalg.norm(want, axis=-1)
    return {"rel_error_per_row": [float(e) for e in err], "max_rel_error": float(err.max())}


def check_copy(w, idx, scheme: str, seed: int) -> dict:
    src = random_stack(16, scheme, seed + 1)
    rows = jnp.arange(idx.shape[0], dtype=jnp.int32)
    sums = jax.jit(lambda t: jnp.stack([a.reshape(a.shape[0], -1).astype(jnp.float32).sum(-1)
                                        for a in jax.tree.leaves(t)]))
    before = np.asarray(sums(w))
    out = jax.jit(row_copy.copy_rows)(w, src, rows, idx)
    after = np.asarray(sums(out))
    copied = all(bool(jnp.array_equal(o[idx], s[rows])) for o, s in zip(jax.tree.leaves(out), jax.tree.leaves(src)))
    others = np.setdiff1d(np.arange(before.shape[1]), np.asarray(idx))
    return {"copied_slots_equal_source": copied,
            "other_slots_unchanged": bool(np.array_equal(before[:, others], after[:, others])),
            "kernel": row_copy.supported(w)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scheme", nargs="+", default=["int4", "int8"], choices=sorted(SLOTS))
    parser.add_argument("--unwrapped", action="store_true")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.unwrapped:  # the lowering's own offsets: install() never runs, the kernel's refusal bypassed
        triton_offsets.install = lambda: False
        gm.addressable = lambda w: True
    records = []
    for i, scheme in enumerate(args.scheme):
        w = random_stack(SLOTS[scheme], scheme, seed=10 * i)
        q = w.q
        row_bytes = int(np.prod(q.shape[1:])) * q.dtype.itemsize
        idx = jnp.asarray(far_slots(SLOTS[scheme], row_bytes))
        record = {"scheme": scheme, "slots": SLOTS[scheme], "integer_bytes": int(q.size * q.dtype.itemsize),
                  "needs_wide": triton_offsets.needs_wide(q.shape, q.dtype), "wrapped": not args.unwrapped,
                  "slots_checked": [int(s) for s in idx], **check_matvec(w, idx, seed=10 * i + 2)}
        if not args.unwrapped:
            record.update(check_copy(w, idx, scheme, seed=10 * i + 3))
        emit(records, record)
        del w, q
    probe_result("gather_matvec and copy_rows over far slots of a 2-4 GB quantized pool (seeded random bytes)",
                 argparse.Namespace(accel=jax.devices()[0]), records, args.out)


if __name__ == "__main__":
    main()
