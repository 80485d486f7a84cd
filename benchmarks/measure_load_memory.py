"""Peak host memory of `load_state` against the checkpoint's size.

Usage:

    python benchmarks/measure_load_memory.py [--model deepseek-v2-lite] [--layers 2] [--dir /tmp]

Writes a random bfloat16 checkpoint in the hub's layout (sharded, with model.safetensors.index.json) for the
preset cut to `--layers` decoder layers (every width as published, so the largest tensors are real-size), then,
for each memory kind, loads it in a fresh Python process through `load_state` onto the CPU backend and records
the process's peak resident set (ru_maxrss) against the checkpoint's bytes, raw and less the resident set just
before loading (interpreter, numpy and JAX). Results go to benchmarks/results/load_memory.json; the checkpoint is
deleted afterwards. The target: peak less baseline under 1.3x the checkpoint.
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax.numpy as jnp
import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

from pdscope_jax import models
from pdscope_jax.presets import preset

SHARD_BYTES = 512 << 20
RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "load_memory.json"


def hf_shapes(sources, shapes) -> dict[str, tuple[int, ...]]:
    """The stored shape of every tensor a parameter is made of (the loader's transform, inverted)."""
    out = {}
    for path, source in sources.items():
        shape = tuple(shapes[path].shape)
        group_shape = shape[1:] if source.stacked else shape
        for group in source.keys:
            width = group_shape[-1] // len(group)
            piece = group_shape[:-1] + (width,)
            for key in group:
                out[key] = piece[::-1] if source.transpose else piece
    return out


def write_checkpoint(cfg, directory: Path, seed: int) -> int:
    """Random bf16 tensors, about SHARD_BYTES a shard, one shard in memory at a time; returns the bytes."""
    stored = hf_shapes(models.checkpoint_sources(cfg), models.abstract_state(cfg, jnp.bfloat16))
    rng = np.random.default_rng(seed)
    shards: list[dict[str, np.ndarray]] = [{}]
    weight_map, size, total = {}, 0, 0
    names = []

    def flush():
        name = f"model-{len(names) + 1:05d}.safetensors"
        save_file(shards[-1], directory / name)
        names.append(name)
        weight_map.update({key: name for key in shards[-1]})
        shards[-1] = {}

    for key, shape in stored.items():
        nbytes = math.prod(shape) * 2
        if size and size + nbytes > SHARD_BYTES:
            flush()
            size = 0
        shards[-1][key] = (0.02 * rng.standard_normal(shape, np.float32)).astype(ml_dtypes.bfloat16)
        size += nbytes
        total += nbytes
    flush()
    # Shards are named like the hub's ("-of-N") once N is known.
    final = {name: f"model-{i + 1:05d}-of-{len(names):05d}.safetensors" for i, name in enumerate(names)}
    for old, new in final.items():
        (directory / old).rename(directory / new)
    index = {"metadata": {"total_size": total}, "weight_map": {k: final[v] for k, v in weight_map.items()}}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    return total


def load_and_measure(directory: str, model: str, layers: int, memory_kind: str) -> None:
    """Runs in the child process: print one JSON line of resident-set figures."""
    import jax
    import psutil
    from jax.sharding import SingleDeviceSharding

    from pdscope_jax.weights.checkpoint import load_state, open_checkpoint

    cfg = preset(model).replace(num_layers=layers)
    sources, shapes = models.checkpoint_sources(cfg), models.abstract_state(cfg, jnp.bfloat16)
    sharding = SingleDeviceSharding(jax.devices("cpu")[0], memory_kind=memory_kind)
    jax.device_put(np.zeros(16, np.float32), sharding).block_until_ready()  # backend up before the baseline
    baseline = psutil.Process().memory_info().rss
    ckpt = open_checkpoint(directory)
    start = time.perf_counter()
    state = load_state(ckpt, sources, shapes, lambda path: sharding)
    seconds = time.perf_counter() - start
    placed = sum(a.nbytes for a in state.values())
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    print(json.dumps(dict(memory_kind=memory_kind, checkpoint_bytes=ckpt.nbytes, placed_bytes=placed,
                          baseline_rss=baseline, peak_rss=peak, final_rss=psutil.Process().memory_info().rss,
                          load_seconds=round(seconds, 2))))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="deepseek-v2-lite")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="where the temporary checkpoint goes")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--child", help=argparse.SUPPRESS)  # "<checkpoint dir>,<memory kind>": measure only
    args = parser.parse_args()
    if args.child:
        directory, kind = args.child.split(",")
        load_and_measure(directory, args.model, args.layers, kind)
        return

    cfg = preset(args.model).replace(num_layers=args.layers)
    directory = Path(tempfile.mkdtemp(prefix="load_memory_", dir=args.dir))
    try:
        total = write_checkpoint(cfg, directory, args.seed)
        runs = []
        for kind in ("device", "pinned_host"):
            child = [sys.executable, __file__, "--model", args.model, "--layers", str(args.layers),
                     "--child", f"{directory},{kind}"]
            line = subprocess.run(child, check=True, stdout=subprocess.PIPE, text=True).stdout.strip().splitlines()[-1]
            run = json.loads(line)
            run["ratio_raw"] = round(run["peak_rss"] / run["checkpoint_bytes"], 3)
            run["ratio"] = round((run["peak_rss"] - run["baseline_rss"]) / run["checkpoint_bytes"], 3)
            runs.append(run)
    finally:
        shutil.rmtree(directory)
    result = dict(
        command=shlex.join(["python", "benchmarks/measure_load_memory.py", *sys.argv[1:]]),
        model=args.model, layers=args.layers, dtype="bfloat16", weights="random (seeded), generated checkpoint",
        checkpoint_bytes=total,
        target_ratio=1.3, runs=runs,
        note="ratio = (peak RSS - RSS before loading) / checkpoint bytes; ratio_raw = peak RSS / checkpoint bytes",
    )
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(f"{'memory kind':<12} {'checkpoint GB':>13} {'peak-base GB':>12} {'ratio':>6} {'raw':>6} {'load s':>7}")
    for run in runs:
        print(f"{run['memory_kind']:<12} {run['checkpoint_bytes'] / 1e9:>13.2f} "
              f"{(run['peak_rss'] - run['baseline_rss']) / 1e9:>12.2f} {run['ratio']:>6.3f} {run['ratio_raw']:>6.3f} "
              f"{run['load_seconds']:>7.1f}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
