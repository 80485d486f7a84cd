"""The expert store's two host allocations in one process: the same bytes, the same tokens, their load times.

Run from the repository root on the GPU node (host_alloc "driver" needs the CUDA driver):
    PYTHONPATH=. python benchmarks/probes/probe_host_alloc_parity.py [--host-allocs driver jax]
        [--model deepseek-v2-lite] [--gpu-memory 24GB] [--expert-pool 8GB] [--tokens 8] [--out host_alloc_parity.json]
For each allocation in turn (`pdscope_jax.store.expert_store`, forced as in `probe_load_stages.force_host_alloc`):
load the model with seeded random weights (one compilation cache shared by the loads, so the first pays the
compiling), record the load's seconds by stage, the store's host bytes and page-locked buffers, a digest of one
expert's pinned bytes, and the greedy tokens of `ondemand` (every expert on the GPU) and `static` (experts on
the CPU too) for one seeded prompt of 64 tokens; then free the model. `static` places experts by a live CPU
calibration, so its tokens may part where two placements round differently; `ondemand`'s may not.
Writes: {what, command, commit, weights, runs: {host_alloc: figures}, same_digest, same_ondemand_tokens}.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import shlex
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from probe_load_stages import force_host_alloc


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--host-allocs", nargs=2, default=["driver", "jax"], choices=("driver", "jax"))
    ap.add_argument("--model", default="deepseek-v2-lite")
    ap.add_argument("--gpu-memory", default="24GB")
    ap.add_argument("--expert-pool", default="8GB")
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    import pdscope_jax
    from pdscope_jax.artifacts.provenance import source_commit

    cache = tempfile.mkdtemp(prefix="pdscope-parity-cc-")
    runs = {}
    for alloc in args.host_allocs:
        force_host_alloc(alloc)
        start = time.perf_counter()
        runner = pdscope_jax.load(args.model, weights="random", policy="ondemand", gpu_memory=args.gpu_memory,
                                  expert_pool=args.expert_pool, max_seq_len=512, compile_cache=cache)
        load_s = time.perf_counter() - start
        store = runner.engine.store
        prompt = np.random.default_rng(0).integers(0, runner.config.vocab_size, (1, 64))
        moe = runner.config.moe_layers
        gate_ups, _ = store.layer_experts(moe[len(moe) // 2])
        run = {"host_alloc": store.host_alloc, "load_s": round(load_s, 1),
               "stages_s": {k: round(v, 1) for k, v in runner.startup_seconds.items()},
               "host_gb": store.host_bytes / 1e9, "host_bytes_per_model_byte": store.host_bytes_per_model_byte,
               "page_locked_buffers": sum(p.buffer.registered for p in store._page_locked),
               "expert_digest": hashlib.sha256(np.asarray(gate_ups[5]).tobytes()).hexdigest()[:16]}
        for policy in ("ondemand", "static"):
            runner.engine.set_policy(policy)
            run[f"{policy}_tokens"] = np.asarray(runner.generate(prompt, max_new_tokens=args.tokens).tokens).tolist()
        runs[alloc] = run
        print(json.dumps(run), flush=True)
        del runner, store
        gc.collect()
    first, second = (runs[a] for a in args.host_allocs)
    result = {"what": "the expert store's host allocations side by side: bytes, tokens, load seconds",
              "command": "python3 " + shlex.join(sys.argv), "commit": source_commit(), "weights": "random (seeded)",
              "runs": runs, "same_digest": first["expert_digest"] == second["expert_digest"],
              "same_ondemand_tokens": first["ondemand_tokens"] == second["ondemand_tokens"],
              "same_static_tokens": first["static_tokens"] == second["static_tokens"]}
    print(json.dumps({k: result[k] for k in ("same_digest", "same_ondemand_tokens", "same_static_tokens")}))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
