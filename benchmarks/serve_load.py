"""The server under load against `generate` on the same work (issue 25): time to first token, tokens/s per stream.

Contract: starts `python -m pdscope_jax serve MODEL` on 127.0.0.1 (--port, 0: a free one) with the load options
given (--weights, --dtype, --quantize, --quality, --seed, --policy, --gpu-memory, --expert-pool, --max-seq-len,
--predictors; --max-batch is the server's), waits for /health (--startup-timeout; else prints the server's log
tail and exits 1), sends --warmup requests (the whole model: then max C at once, compiling every batch bucket),
then per --concurrency C, --repeats times, opens C streaming /v1/completions at once (httpx, server-sent events;
a fixed prompt of --prompt-tokens token ids per stream index; greedy; --max-tokens; logprobs 0, so each token
arrives in a chunk that says so). The server has no ignore_eos: a stream ends at EOS, and the tokens received are
checked against its usage count (which counts the unsent EOS). Per stream: TTFT, tokens, tok/s after the first
token, total; per C: median and p90 of TTFT and per-stream tok/s, aggregate tok/s and wall time (medians over
repeats), lost tokens. Then the server stops and a fresh process loads the same model with the same options
(`pdscope_jax.load`) and runs the same C requests one after another with `generate` (always max_tokens tokens):
prefill and decode time of each, and a queued user's TTFT (every earlier request plus its own prefill).
--generate-batch also runs each C's prompts as one batch (offloaded: one process per C, loaded with max_batch=C
and max_seq_len prompt + new tokens unless --max-seq-len). Two models are never in memory at once. Writes --out
(what, command, commit, machine, settings, per-C server and generate results) and prints a table; --phases
runs one of the two.

Example (GPU node, random weights, offloaded at 24 GB / 8 GB):
  python benchmarks/serve_load.py --model deepseek-v2-lite --policy pdscope --gpu-memory 24GB --expert-pool 8GB \\
      --concurrency 1 8 32 --prompt-tokens 128 --max-tokens 64 --out serve_load_dsv2lite.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _shared import REPO, command_line, commit, machine

LOAD_OPTIONS = {"weights": str, "dtype": str, "quantize": str, "quality": str, "seed": int, "policy": str,
                "gpu_memory": str, "expert_pool": str, "max_seq_len": int, "predictors": str}
CHILD_ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="deepseek-v2-lite")
    for name, kind in LOAD_OPTIONS.items():
        ap.add_argument("--" + name.replace("_", "-"), type=kind, help="passed to `serve` and `load`")
    ap.add_argument("--max-batch", type=int,
                    help="the server's --max-batch (continuous batching; with --policy the engine budgets it)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--warmup", type=int, default=2,
                    help="requests before measuring (the server's second request still sets things up)")
    ap.add_argument("--port", type=int, default=0, help="0: a free port")
    ap.add_argument("--startup-timeout", type=float, default=900, help="seconds for the server to load")
    ap.add_argument("--generate-batch", action="store_true", help="also run each C's prompts as one generate batch")
    ap.add_argument("--phases", nargs="+", choices=("server", "generate"), default=["server", "generate"],
                    help="run one only (each fits a 10-minute slot where both do not)")
    ap.add_argument("--out", default="serve_load.json")
    ap.add_argument("--worker", type=int, help=argparse.SUPPRESS)  # internal: the generate process (its max_batch)
    ap.add_argument("--worker-out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.concurrency = list(dict.fromkeys(args.concurrency))
    return args


def prompts(args) -> list[list[int]]:
    """A fixed prompt of --prompt-tokens ids per stream index (the same for the server and generate)."""
    from pdscope_jax.api import resolve  # the config only: no JAX backend starts here

    vocab = resolve(args.model)[0].vocab_size
    return [[random.Random(1000 * i + j).randrange(1, vocab) for j in range(args.prompt_tokens)]
            for i in range(max(args.concurrency))]


def p90(values):
    return sorted(values)[math.ceil(0.9 * len(values)) - 1] if values else None


def summary(streams, walls, tokens) -> dict:
    ttft, rate = [s["ttft_s"] for s in streams], [s["tok_s"] for s in streams if s["tok_s"] is not None]
    return {"ttft_s_median": statistics.median(ttft), "ttft_s_p90": p90(ttft),
            "tok_s_per_stream_median": statistics.median(rate) if rate else None, "tok_s_per_stream_p90": p90(rate),
            "aggregate_tok_s": statistics.median(t / w for t, w in zip(tokens, walls)),
            "wall_s": statistics.median(walls)}


def say(message: str) -> None:
    print(f"serve_load: {message}", file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args, port: int, log):
    argv = [sys.executable, "-m", "pdscope_jax", "serve", args.model, "--host", "127.0.0.1", "--port", str(port),
            "--max-queue", str(max(64, *args.concurrency)), "--max-tokens", str(max(1024, args.max_tokens))]
    for name in [*LOAD_OPTIONS, "max_batch"]:
        if getattr(args, name) is not None:
            argv += ["--" + name.replace("_", "-"), str(getattr(args, name))]
    return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=CHILD_ENV), argv


def wait_ready(proc, url: str, timeout: float) -> str | None:
    """None once /health answers 200, else why not."""
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return f"the server exited with {proc.returncode}"
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return None
        except httpx.HTTPError:
            pass
        time.sleep(0.5)  # polling while the server loads the model
    return f"the server was not ready after {timeout} s"


async def stream(client, ids: list[int], max_tokens: int) -> dict:
    body = {"prompt": ids, "max_tokens": max_tokens, "temperature": 0, "stream": True, "logprobs": 0,
            "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    first = last = usage = finish = error = None
    got = 0
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            error = f"{r.status_code}: {(await r.aread()).decode()[:300]}"
        else:
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    error = chunk["error"].get("message")
                usage = (chunk.get("usage") or {}).get("completion_tokens", usage)
                for choice in chunk.get("choices", []):
                    if n := len((choice.get("logprobs") or {}).get("tokens", [])):
                        first, last, got = first or time.perf_counter(), time.perf_counter(), got + n
                    finish = choice.get("finish_reason") or finish
    end = time.perf_counter()
    sent = None if usage is None else usage - (finish == "stop")  # usage counts an EOS, which is never sent
    return {"start": start, "end": end, "ttft_s": None if first is None else first - start, "tokens": got,
            "tok_s": (got - 1) / (last - first) if got > 1 and last > first else None, "total_s": end - start,
            "finish_reason": finish, "usage_completion_tokens": usage,
            "lost_tokens": None if sent is None else sent - got, "error": error}


async def load_once(url: str, ps: list[list[int]], max_tokens: int) -> list[dict]:
    import httpx

    limits = httpx.Limits(max_connections=len(ps) + 4, max_keepalive_connections=len(ps) + 4)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(60, read=None), limits=limits) as client:
        return await asyncio.gather(*(stream(client, ids, max_tokens) for ids in ps))


def server_phase(args, ps) -> dict:
    port = args.port or free_port()
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryFile("w+") as log:
        t0 = time.perf_counter()
        proc, argv = start_server(args, port, log)
        try:
            why = wait_ready(proc, url, args.startup_timeout)
            if why is None:
                ready = time.perf_counter() - t0
                say(f"server: ready after {ready:.1f} s; warming up")
                warm = [asyncio.run(load_once(url, ps[:1], args.max_tokens))[0] for _ in range(args.warmup)]
                if args.policy is None:  # the batching server compiles a decode program per power of two of rows
                    warm += asyncio.run(load_once(url, ps, args.max_tokens))
                why = next((w["error"] or "a warm-up request produced no token" for w in warm
                            if w["error"] or not w["tokens"]), None)
            if why is not None:
                log.seek(0)
                tail = log.read().splitlines()[-40:]
                sys.exit(f"serve_load: {why}; the server's log ends:\n" + "\n".join(tail))
            result = {"command": " ".join(argv[1:]), "startup_s": ready, "warmup_s": [w["total_s"] for w in warm],
                      "by_c": {}}
            for c in args.concurrency:
                say(f"server: {c} concurrent streams x {args.repeats}")
                runs = [asyncio.run(load_once(url, ps[:c], args.max_tokens)) for _ in range(args.repeats)]
                walls = [max(s["end"] for s in run) - min(s["start"] for s in run) for run in runs]
                streams = [{k: v for k, v in s.items() if k not in ("start", "end")} for run in runs for s in run]
                good = [s for s in streams if s["ttft_s"] is not None]
                result["by_c"][str(c)] = {**(summary(good, walls, [sum(s["tokens"] for s in run) for run in runs])
                                             if good else {}), "streams": streams,
                                          "lost_tokens": sum(s["lost_tokens"] or 0 for s in streams),
                                          "errors": [s["error"] for s in streams if s["error"]]}
        finally:
            proc.terminate()  # uvicorn shuts down cleanly on SIGTERM and the worker stops with it
            try:
                proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        log.seek(0)  # a clean stop: uvicorn's shutdown, then the service's close, then exit status 143 (SIGTERM)
        text = log.read()
        result |= {"exit_code": proc.returncode,
                   "stopped_cleanly": "Finished server process" in text and "pdscope-jax serve: stopped" in text}
    return result


def timed(runner, batch, max_tokens) -> dict:
    t = time.perf_counter()
    r = runner.generate(batch, max_new_tokens=max_tokens)
    total, new = time.perf_counter() - t, r.tokens.shape[1]
    return {"prefill_s": r.prefill_seconds, "decode_s": r.decode_seconds, "total_s": total, "tokens": new,
            "tok_s": (new - 1) / r.decode_seconds if new > 1 and r.decode_seconds > 0 else None}


def worker(args) -> None:
    """The generate process: --worker 1 runs every C one request after another (and, for the whole model with
    --generate-batch, each C as one batch); --worker C > 1 (offloaded) runs C's batch with max_batch C."""
    import pdscope_jax

    ps = prompts(args)
    runtime = {} if args.policy is None else {"gpu_memory": args.gpu_memory or "24GB", "expert_pool": args.expert_pool}
    if args.policy is not None and (args.max_seq_len or args.worker > 1):
        runtime["max_seq_len"] = args.max_seq_len or args.prompt_tokens + args.max_tokens
    if args.worker > 1:
        runtime["max_batch"] = args.worker
    runtime |= {k: getattr(args, k) for k in ("quality",) if getattr(args, k) is not None}
    t = time.perf_counter()
    runner = pdscope_jax.load(args.model, weights=args.weights, seed=args.seed or 0, dtype=args.dtype or "bfloat16",
                              policy=args.policy, predictors=args.predictors, quantize=args.quantize, **runtime)
    out = {"load_s": time.perf_counter() - t, "random_weights": runner.checkpoint is None, "machine": machine(),
           "runtime": {k: v for k, v in runtime.items() if v is not None}, "sequential": {}, "batch": {}}
    batches = ([args.worker] if args.worker > 1 else
               [c for c in args.concurrency if c > 1] if args.generate_batch and args.policy is None else [])
    if args.worker == 1:
        for _ in range(args.warmup):  # as the server's warm-up: compiles
            timed(runner, ps[:1], args.max_tokens)
        for c in args.concurrency:
            runs = [[timed(runner, [ps[i]], args.max_tokens) for i in range(c)] for _ in range(args.repeats)]
            for run in runs:  # a queued user's first token: after every earlier request and its own prefill
                for i, r in enumerate(run):
                    r["ttft_s"] = sum(q["total_s"] for q in run[:i]) + r["prefill_s"]
            walls = [sum(r["total_s"] for r in run) for run in runs]
            out["sequential"][str(c)] = {**summary([r for run in runs for r in run], walls,
                                                   [sum(r["tokens"] for r in run) for run in runs]), "requests": runs}
    for c in batches:
        timed(runner, ps[:c], args.max_tokens)  # warm-up of this shape
        runs = [timed(runner, ps[:c], args.max_tokens) for _ in range(args.repeats)]
        streams = [{**r, "ttft_s": r["prefill_s"]} for r in runs for _ in range(c)]
        out["batch"][str(c)] = {**summary(streams, [r["total_s"] for r in runs], [c * r["tokens"] for r in runs]),
                                "runs": runs}
    Path(args.worker_out).write_text(json.dumps(out))


def generate_phase(args, argv) -> dict:
    loads = [1] + ([c for c in args.concurrency if c > 1] if args.generate_batch and args.policy else [])
    merged = {}
    for max_batch in loads:
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "generate.json"
            cmd = [sys.executable, str(Path(__file__).resolve()), *argv, "--worker", str(max_batch),
                   "--worker-out", str(out)]
            say(f"generate: loading with max_batch {max_batch}")
            done = subprocess.run(cmd, env=CHILD_ENV)  # its output goes on to ours
            if done.returncode != 0:
                sys.exit(f"serve_load: the generate process failed with {done.returncode} (its output is above)")
            part = json.loads(out.read_text())
        for key in ("sequential", "batch"):
            merged.setdefault(key, {}).update(part.pop(key))
        merged.setdefault("loads", {})[str(max_batch)] = {k: part[k] for k in ("load_s", "runtime")}
        merged.update({k: part[k] for k in ("random_weights", "machine")})
    return merged


def table(report) -> str:
    rows = [("C", "path", "TTFT p50 s", "TTFT p90 s", "tok/s/stream p50", "p90", "aggregate tok/s", "wall s")]
    fmt = lambda v: "-" if v is None else f"{v:.3g}"  # noqa: E731
    for c in map(str, report["settings"]["concurrency"]):
        for path, res in (("server", report["server"]["by_c"].get(c)),
                          ("generate 1-by-1", report["generate"]["sequential"].get(c)),
                          ("generate batch", report["generate"]["batch"].get(c))):
            if res and "wall_s" in res:
                rows.append((c, path, *map(fmt, (res["ttft_s_median"], res["ttft_s_p90"], res[
                    "tok_s_per_stream_median"], res["tok_s_per_stream_p90"], res["aggregate_tok_s"], res["wall_s"]))))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(v.rjust(w) for v, w in zip(r, widths)) for r in rows)


def main(argv=None) -> dict | None:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse(argv)
    if args.worker:
        return worker(args)
    ps = prompts(args)
    server = server_phase(args, ps) if "server" in args.phases else {"by_c": {}}
    generate = generate_phase(args, argv) if "generate" in args.phases else {"sequential": {}, "batch": {}}
    if "machine" not in generate:  # the server has stopped: this process may start JAX now
        generate |= {"machine": machine(), "random_weights": None}
    settings = {k: getattr(args, k) for k in vars(args) if k not in ("worker", "worker_out", "out")}
    report = {"what": f"{args.model} served to {args.concurrency} concurrent streams against the same requests "
                      "through generate",
              "command": command_line(__file__, argv), "commit": commit(), "machine": generate.pop("machine"),
              "settings": settings,
              "weights": {True: "random (seeded)", False: args.weights or "the checkpoint's"}.get(
                  generate.pop("random_weights"), args.weights or "random for a preset name, else the checkpoint's"),
              "note": "the server stops a stream at EOS (usage counts the EOS, never sent); generate always makes "
                      "max_tokens; generate's TTFT one-by-one is a queued user's (earlier requests + own prefill)",
              "server": server, "generate": generate}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(table(report))
    print(json.dumps({"out": args.out, "lost_tokens": {c: r["lost_tokens"] for c, r in server["by_c"].items()}}))
    return report


if __name__ == "__main__":
    main()
