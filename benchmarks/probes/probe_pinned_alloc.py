"""Page-locked host memory for the expert store's layer stacks, several ways, on a CUDA GPU (torch for its arms).

Run from the repository root on the GPU node:
    PYTHONPATH=. python benchmarks/probes/probe_pinned_alloc.py [--layers 4] [--threads 8] [--out F.json]
Per layer of DeepSeek-V2-Lite's expert shape (gate_up [64, 2048, 2816] and down [64, 1408, 2048], bf16, random,
generated on the GPU), for `--layers` layers:
- "torch_cache": `torch.empty(pin_memory=True)`, torch's pinned caching allocator (blocks rounded up to powers
  of two: its `host_memory_stats` bytes beside the bytes asked for);
- "registered": `torch.empty` page-locked by `cudaHostRegister` at its exact size (the store's way before
  `store.page_locked`);
  "registered_prefaulted": the same after `--threads` threads wrote every page (faulting in parallel);
- "jax": one `jax.device_put` per expert into the GPU's pinned_host memory (the store's host_alloc="jax");
- "driver_*": `pdscope_jax.store.page_locked` (anonymous memory, cuMemHostRegister through the driver, no torch):
  4 KiB pages faulted by the registration itself / by one thread first / by `--threads` threads; transparent huge
  pages with `--threads` threads; and "driver_maker", a `BufferMaker` of 4 threads making every layer's buffers at
  once (the whole batch's seconds per layer). /proc/meminfo's AnonHugePages growth says whether huge pages came.
Times the allocation, the fill from the GPU array (`np.asarray` then a numpy copy, first layer only; and a torch
`copy_` from the array through dlpack), checks that the dlpack import is pinned_host memory of the GPU holding
the same values, and times a host-to-GPU transfer of one layer's experts (3 repeats, GB/s).
Writes: {what, command, commit, torch, jax, asked_bytes_per_layer, methods: {name: figures}}.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from _common import held, memory_shardings

SHAPES = [(64, 2048, 2816), (64, 1408, 2048)]


def transfer_gbps(arrays, device, repeats: int = 3) -> list[float]:
    gb = sum(a.nbytes for a in arrays) / 1e9
    out = []
    for _ in range(repeats):
        _, seconds = held(lambda: jax.block_until_ready(jax.device_put(arrays, device)))
        out.append(round(gb / seconds, 1))
    return out


def prefault(raw: np.ndarray, threads: int) -> None:
    """Write every page of `raw` from `threads` threads (numpy releases the GIL for a fill)."""
    import concurrent.futures

    chunks = np.array_split(raw, threads)
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        list(pool.map(lambda chunk: chunk.fill(0), chunks))


def torch_method(name: str, sources, layers: int, device, threads: int) -> dict:
    import torch

    def allocate(nbytes):
        if name == "torch_cache":
            return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        buffer = torch.empty(nbytes, dtype=torch.uint8)
        if name == "registered_prefaulted":  # the pages faulted in by threads first, then locked
            prefault(buffer.numpy(), threads)
        code = int(torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), nbytes, 0))
        if code != 0:
            raise RuntimeError(f"cudaHostRegister returned {code}")
        return buffer

    before = torch.cuda.host_memory_stats().get("allocated_bytes.current", 0)
    alloc_s = fill_copy_s = fill_numpy_s = 0.0
    kept, kinds, equal = [], set(), True
    for layer in range(layers):
        for src in sources:
            buffer, seconds = held(lambda: allocate(src.nbytes))
            alloc_s += seconds
            view = buffer.numpy().view(np.dtype(src.dtype)).reshape(src.shape)
            typed = buffer.view(torch.bfloat16).reshape(src.shape)
            if layer == 0:
                fill_numpy_s += held(lambda: view.__setitem__(Ellipsis, np.asarray(src)))[1]
            fill_copy_s += held(lambda: typed.copy_(torch.from_dlpack(src)))[1]
            experts = [jax.dlpack.from_dlpack(typed[e]) for e in range(src.shape[0])]
            kinds.add(f"{experts[0].sharding.memory_kind} {sorted(map(str, experts[0].devices()))}")
            equal = equal and bool(np.array_equal(np.asarray(experts[3]), np.asarray(src[3])))
            kept.append((buffer, experts))
    figures = {"alloc_s_per_layer": alloc_s / layers, "fill_numpy_s_first_layer": fill_numpy_s,
               "fill_torch_copy_s_per_layer": fill_copy_s / layers, "dlpack_import": sorted(kinds),
               "values_equal": equal, "h2d_one_layer_gbps": transfer_gbps(kept[0][1] + kept[1][1], device),
               "torch_cache_bytes_added": torch.cuda.host_memory_stats().get("allocated_bytes.current", 0) - before}
    if name != "torch_cache":
        for buffer, _ in kept:
            torch.cuda.cudart().cudaHostUnregister(buffer.data_ptr())
    return figures


DRIVER_VARIANTS = {"driver_4k_unpopulated": (False, 0), "driver_4k": (False, 1), "driver_4k_threads": (False, None),
                   "driver_huge_threads": (True, None)}


def anon_huge_bytes() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("AnonHugePages:"):
            return int(line.split()[1]) * 1024
    return 0


def driver_method(name: str, sources, layers: int, gpu, device, threads: int) -> dict:
    from pdscope_jax.store import page_locked

    huge_before, ordinal = anon_huge_bytes(), gpu.local_hardware_id
    sizes = [src.nbytes for _ in range(layers) for src in sources]
    if name == "driver_maker":
        maker = page_locked.BufferMaker(ordinal, threads=4, populate_threads=threads)

        def make_all():
            maker.expect(sizes)
            return [maker.take(n) for n in sizes]
        buffers, alloc_s = held(make_all)
        maker.close()
    else:
        huge, populate = DRIVER_VARIANTS[name]
        populate = threads if populate is None else populate
        buffers, alloc_s = held(lambda: [page_locked.HostBuffer(n, ordinal, huge, populate) for n in sizes])
    huge_bytes = anon_huge_bytes() - huge_before
    fill_s, kept, equal = 0.0, [], True
    for buffer, src in zip(buffers, sources * layers):
        stack, seconds = held(lambda: page_locked.pin_stack(src, gpu, buffer))
        fill_s += seconds
        equal = equal and bool(np.array_equal(np.asarray(stack.experts[3]), np.asarray(src[3])))
        kept.append(stack)
    figures = {"alloc_s_per_layer": alloc_s / layers, "fill_and_import_s_per_layer": fill_s / layers,
               "anon_huge_bytes_added": huge_bytes, "bytes_asked": sum(sizes), "values_equal": equal,
               "dlpack_import": sorted({f"{s.whole.sharding.memory_kind} {sorted(map(str, s.whole.devices()))}"
                                        for s in kept}),
               "h2d_one_layer_gbps": transfer_gbps(kept[0].experts + kept[1].experts, device)}
    for stack in kept:
        stack.release()
    return figures


def jax_method(sources, layers: int, pinned, device) -> dict:
    alloc_s, kept = 0.0, []
    for _ in range(layers):
        for src in sources:
            experts, seconds = held(lambda: jax.block_until_ready([jax.device_put(src[e], pinned)
                                                                    for e in range(src.shape[0])]))
            alloc_s += seconds
            kept.append(experts)
    return {"device_put_s_per_layer": alloc_s / layers, "h2d_one_layer_gbps": transfer_gbps(kept[0] + kept[1], device)}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--threads", type=int, default=8, help="threads that fault the pages in (registered_prefaulted)")
    ap.add_argument("--methods", nargs="+", default=["torch_cache", "registered", "registered_prefaulted", "jax",
                                                       *DRIVER_VARIANTS, "driver_maker"])
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)

    from pdscope_jax.artifacts.provenance import source_commit

    gpu = jax.devices("gpu")[0]
    pinned, device = memory_shardings(gpu)
    sources = jax.block_until_ready([jax.random.normal(jax.random.key(i), s, jnp.bfloat16)
                                     for i, s in enumerate(SHAPES)])
    methods = {}
    for name in args.methods:
        if name == "jax":
            methods[name] = jax_method(sources, args.layers, pinned, device)
        elif name.startswith("driver"):
            methods[name] = driver_method(name, sources, args.layers, gpu, device, args.threads)
        else:
            methods[name] = torch_method(name, sources, args.layers, device, args.threads)
        print(name, json.dumps(methods[name]), flush=True)
    torch = sys.modules.get("torch")
    result = {"what": "page-locked host memory for the expert store's layer stacks: allocation, fill, transfer",
              "command": "python3 " + shlex.join(sys.argv), "commit": source_commit(), "weights": "random (seeded)",
              "torch": getattr(torch, "__version__", None), "jax": jax.__version__,
              "transparent_hugepage": _thp_setting(),
              "asked_bytes_per_layer": sum(s.nbytes for s in sources), "methods": methods}
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return result


def _thp_setting() -> str | None:
    try:
        return Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text().strip()
    except OSError:
        return None


if __name__ == "__main__":
    main()
