"""Long runs: device memory and host RSS over many decode steps per policy and over many server requests, and the
same seeded tokens in two processes.

    python benchmarks/long_run.py --model deepseek-v2-lite --layers 8 --gpu-memory 8GB --expert-pool 2GB \
        --steps 1000 --requests 500 --check-tokens 64 --out benchmarks/results/long_run_h200.json

1. Per policy (`plain`, then every policy of `sched.registry.COMPARED`): one generation of `--steps` decode steps
   (sampled: temperature 0.8, top_p 0.95, a fixed seed) through `steps`, host RSS (/proc/self/statm) and the
   accelerator allocator's bytes in use (`memory_stats`, where the backend reports it) read every `--every`
   steps. Drift = (max - min) / value at `--settle` over the reads from `--settle` on (the first steps compile
   and fill caches); a run passes at drift <= 1 %. Offloaded runs also record the engine's budget and the
   allocator's peak (process-wide; `after_plain_freed` says what the whole model left on the accelerator).
2. The whole model behind the OpenAI-compatible server (continuous batching, `--server-batch` slots):
   `--requests` completions of token-id prompts, `--server-concurrency` at a time, mixed lengths; the same
   reads after every `--every-requests` answered requests, with the same drift rule from the first read on.
3. Two fresh processes (this script with `--tokens-only`) each load the model and generate `--check-tokens`
   sampled tokens per policy from the same prompt and seed; the report says per policy whether they agree.
`--parts` picks which of the three run (default all: steps, server, processes).
`--layers N` keeps the preset's first N layers (the architecture's shapes, fewer of them, so the run fits a
device call); the report says so. Weights are seeded random. Output JSON: command, commit, machine, settings,
per policy the reads and drifts, the server's reads, and the two processes' tokens compared.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from _shared import command_line, commit, machine

SAMPLING = {"temperature": 0.8, "top_p": 0.95, "seed": 1234}
PROMPT_LEN = 64
LIMIT = 0.01  # the drift a long run may show: 1 %
PARTS = ("steps", "server", "processes")


def model_path(name: str, layers: int | None, into: Path) -> str:
    """`name` itself, or a folder holding the preset's config.json with its first `layers` layers."""
    if layers is None:
        return name
    from importlib import resources

    from pdscope_jax.presets import PUBLISHED

    if name not in PUBLISHED:
        raise SystemExit(f"--layers needs a published preset ({', '.join(PUBLISHED)}), got {name!r}")
    config = json.loads(resources.files("pdscope_jax.presets").joinpath(PUBLISHED[name]).read_text())
    config["num_hidden_layers"] = layers
    (into / "config.json").write_text(json.dumps(config))
    return str(into)


def load(args, path: str, policy: str | None):
    import pdscope_jax

    if policy is None:
        return pdscope_jax.load(path, weights="random", seed=0, dtype=args.dtype)
    return pdscope_jax.load(path, weights="random", seed=0, dtype=args.dtype, policy=policy,
                            gpu_memory=args.gpu_memory, expert_pool=args.expert_pool,
                            max_seq_len=PROMPT_LEN + args.steps + 1)


def accelerator(runner):
    from pdscope_jax.runtime import select_devices

    return runner.engine.devices.accel if hasattr(runner, "engine") else select_devices().accel


def memory(device) -> dict:
    rss = int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return {"host_rss": rss, "device_in_use": (device.memory_stats() or {}).get("bytes_in_use")}


def drift(reads: list[dict], key: str) -> float | None:
    values = [r[key] for r in reads if r[key] is not None]
    return None if len(values) < 2 else (max(values) - min(values)) / values[0]


def verdict(reads: list[dict]) -> dict:
    out = {f"{k}_drift": drift(reads, k) for k in ("host_rss", "device_in_use")}
    out["flat"] = all(v is None or v <= LIMIT for v in out.values())
    return out


def prompt(vocab: int) -> np.ndarray:
    return np.random.default_rng(7).integers(0, vocab, size=(1, PROMPT_LEN)).astype(np.int32)


def long_generation(runner, args) -> dict:
    """`--steps` decode steps with a memory read every `--every` steps."""
    device, reads, tokens = accelerator(runner), [], []
    start = time.perf_counter()
    for step, picked in enumerate(runner.steps(prompt(runner.config.vocab_size), args.steps + 1, **SAMPLING)):
        tokens.append(int(np.asarray(picked.token)[0]))
        if step >= args.settle and (step - args.settle) % args.every == 0:
            reads.append({"step": step, **memory(device)})
    seconds = time.perf_counter() - start
    return {"decode_steps": args.steps, "seconds": round(seconds, 2), "reads": reads, **verdict(reads),
            "distinct_tokens": len(set(tokens))}


def server_run(runner, args) -> dict:
    """`--requests` completions through the server; memory read after every `--every-requests` answers."""
    import httpx

    from pdscope_jax.serve.server import ServerThread
    from pdscope_jax.serve.service import Limits, Service

    rng = np.random.default_rng(3)
    vocab = runner.config.vocab_size
    cases = [(rng.integers(0, vocab, size=int(rng.integers(4, 48))).tolist(), int(rng.integers(1, 33)))
             for _ in range(args.requests)]
    service = Service("long-run", Limits(max_tokens=64, max_queue=args.requests, max_batch=args.server_batch,
                                         max_seq_len=128))
    service.attach(runner)
    device, reads, answered, wrong = accelerator(runner), [], 0, []
    with ServerThread(service) as server, httpx.Client(base_url=server.url, timeout=600) as client:
        def ask(i: int) -> tuple[int, dict]:
            ids, n = cases[i]
            body = {"model": "long-run", "prompt": ids, "max_tokens": n, "seed": i, **{
                k: v for k, v in SAMPLING.items() if k != "seed"}}
            return i, client.post("/v1/completions", json=body).json()

        start = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(args.server_concurrency) as pool:
            for i, answer in pool.map(ask, range(args.requests)):
                answered += 1
                choice = answer.get("choices", [{}])[0]
                used = answer.get("usage", {}).get("completion_tokens")
                if choice.get("finish_reason") not in ("length", "stop") or used is None or used > cases[i][1] or (
                        choice.get("finish_reason") == "length" and used != cases[i][1]):
                    wrong.append({"request": i, "answer": answer})
                if answered % args.every_requests == 0:
                    reads.append({"requests": answered, **memory(device)})
        seconds = time.perf_counter() - start
    return {"requests": args.requests, "concurrency": args.server_concurrency, "seconds": round(seconds, 2),
            "bad_answers": wrong[:5], "bad_answer_count": len(wrong), "reads": reads, **verdict(reads)}


def tokens_only(args, path: str) -> dict:
    """Each policy's `--check-tokens` sampled tokens from a fresh load (what one of the two processes prints)."""
    plain = load(args, path, None)
    ids = prompt(plain.config.vocab_size)
    out = {"plain": np.asarray(plain.generate(ids, args.check_tokens, **SAMPLING).tokens)[0].tolist()}
    del plain
    offloaded = load(args, path, args.policies[0])
    for policy in args.policies:
        offloaded.engine.set_policy(policy)
        out[policy] = np.asarray(offloaded.generate(ids, args.check_tokens, **SAMPLING).tokens)[0].tolist()
    return out


def two_processes(args, argv: list[str]) -> dict:
    runs = []
    for _ in range(2):
        done = subprocess.run([sys.executable, __file__, *argv, "--tokens-only"], capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"--tokens-only failed ({done.returncode}):\n{done.stderr[-4000:]}")
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    return {policy: {"same_tokens": runs[0][policy] == runs[1][policy],
                     "first_difference": next((i for i, (a, b) in enumerate(zip(runs[0][policy], runs[1][policy]))
                                               if a != b), None)} for policy in runs[0]}


def main(argv: list[str] | None = None) -> dict:
    from pdscope_jax.sched.registry import COMPARED

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="deepseek-v2-lite")
    ap.add_argument("--layers", type=int, help="keep the preset's first N layers")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--policies", nargs="+", default=list(COMPARED))
    ap.add_argument("--gpu-memory", default="8GB")
    ap.add_argument("--expert-pool", default="2GB")
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--every", type=int, default=50)
    ap.add_argument("--settle", type=int, default=50, help="first step read (the ones before compile and fill)")
    ap.add_argument("--requests", type=int, default=500)
    ap.add_argument("--every-requests", type=int, default=50)
    ap.add_argument("--server-concurrency", type=int, default=8)
    ap.add_argument("--server-batch", type=int, default=8)
    ap.add_argument("--check-tokens", type=int, default=64)
    ap.add_argument("--cpu-devices", type=int, default=0, help="CPU devices to make (the CPU-only stand-in: 2)")
    ap.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    ap.add_argument("--tokens-only", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path)
    argv = sys.argv[1:] if argv is None else argv
    args = ap.parse_args(argv)
    if args.cpu_devices:
        import jax

        jax.config.update("jax_num_cpu_devices", args.cpu_devices)
    with tempfile.TemporaryDirectory() as tmp:
        path = model_path(args.model, args.layers, Path(tmp))
        if args.tokens_only:
            print(json.dumps(tokens_only(args, path)))
            return {}
        report = {"what": "memory over long runs (decode steps per policy, server requests) and seeded tokens in "
                          "two processes",
                  "command": command_line(__file__, argv),
                  "commit": commit(),
                  "machine": machine(), "model": args.model,
                  "layers": args.layers or "all", "weights": "random (seeded, seed 0)", "dtype": args.dtype,
                  "sampling": SAMPLING, "prompt_len": PROMPT_LEN, "limit": LIMIT, "runs": {}}

        def save():
            if args.out:
                args.out.parent.mkdir(parents=True, exist_ok=True)
                args.out.write_text(json.dumps(report, indent=1) + "\n")

        if "steps" in args.parts or "server" in args.parts:
            plain = load(args, path, None)
            if "steps" in args.parts:
                report["runs"]["plain"] = long_generation(plain, args)
                save()
            if "server" in args.parts:
                report["server"] = server_run(plain, args)
                save()
            device = accelerator(plain)
            del plain
            gc.collect()
            report["after_plain_freed"] = memory(device)  # what the whole model left behind on the accelerator
        if "steps" in args.parts:
            offloaded = load(args, path, args.policies[0])
            for policy in args.policies:
                offloaded.engine.set_policy(policy)
                report["runs"][policy] = long_generation(offloaded, args)
                stats = offloaded.stats
                report["runs"][policy].update(hit_rate=stats["decode"].get("hit_rate"),
                                              budget_bytes=stats["budget"]["budget"],
                                              device_peak_bytes=stats["device_peak_bytes"],
                                              within_budget=stats["within_budget"])
                save()
                print(policy, {k: v for k, v in report["runs"][policy].items() if k != "reads"}, flush=True)
            del offloaded
        if "processes" in args.parts:
            report["two_processes"] = two_processes(args, argv)
        report["all_flat"] = all(r["flat"] for r in [*report["runs"].values(), report.get("server", {"flat": True})])
        save()
    print(json.dumps({k: report.get(k) for k in ("all_flat", "two_processes")}, indent=1))
    return report


if __name__ == "__main__":
    main()
