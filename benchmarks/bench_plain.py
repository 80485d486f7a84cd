"""Upper-bound benchmark: the whole model resident on one device, no offloading.

Measures prefill tokens/s at several prompt lengths and decode tokens/s over N generated tokens at batch 1,
through the public API (`pdscope_jax.load(...).generate`). Each length is run once untimed (compilation)
and then `--repeats` times; the median is reported. Writes `plain_<model>.json` (the rows, with the command
line, jax version, device and "weights") and `plain_<model>.png` into `--out`, and a summary line to stdout.
Run from the repository root:

    PYTHONPATH=. python benchmarks/bench_plain.py --model deepseek-v2-lite --lengths 128 512 1024 2048 4096
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import jax
import numpy as np

import pdscope_jax
from _shared import command_line, pyplot, save_figure


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="deepseek-v2-lite")
    parser.add_argument("--weights", default="random", help="'random' (seeded) or a checkpoint directory")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--lengths", type=int, nargs="+", default=[128, 512, 1024, 2048, 4096])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args(argv)

    started = time.perf_counter()
    runner = pdscope_jax.load(args.model, weights=args.weights, seed=args.seed, dtype=args.dtype)
    load_seconds = time.perf_counter() - started
    vocab = runner.config.vocab_size
    rng = np.random.default_rng(args.seed)
    rows = []
    for length in args.lengths:
        prompt = rng.integers(0, vocab, size=(1, length), dtype=np.int32)
        runner.generate(prompt, max_new_tokens=args.new_tokens)  # compile prefill and decode for this length
        runs = [runner.generate(prompt, max_new_tokens=args.new_tokens) for _ in range(args.repeats)]
        row = {
            "prompt_tokens": length,
            "prefill_tok_s": statistics.median(r.prefill_tokens_per_s for r in runs),
            "decode_tok_s": statistics.median(r.decode_tokens_per_s for r in runs),
            "prefill_seconds": [r.prefill_seconds for r in runs],
            "decode_seconds": [r.decode_seconds for r in runs],
        }
        rows.append(row)
        print(f"{args.model} T={length:5d}  prefill {row['prefill_tok_s']:9.1f} tok/s   "
              f"decode {row['decode_tok_s']:7.2f} tok/s", flush=True)

    result = {
        "benchmark": "plain (whole model resident, no offload)",
        "command": command_line(__file__, sys.argv[1:] if argv is None else argv),
        "model": args.model,
        "weights": "random (seeded, real architecture)" if args.weights == "random" else args.weights,
        "dtype": args.dtype,
        "batch": 1,
        "new_tokens": args.new_tokens,
        "repeats": args.repeats,
        "load_seconds": load_seconds,
        "device": str(jax.devices()[0].device_kind),
        "jax": jax.__version__,
        "python": platform.python_version(),
        "rows": rows,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"plain_{args.model}"
    stem.with_suffix(".json").write_text(json.dumps(result, indent=2))
    _plot(result, stem.with_suffix(".png"))
    print(json.dumps({"prefill_tok_s": {r["prompt_tokens"]: round(r["prefill_tok_s"], 1) for r in rows},
                      "decode_tok_s": round(statistics.median(r["decode_tok_s"] for r in rows), 2)}))
    return result


def _plot(result: dict, path: Path) -> None:
    plt = pyplot()
    lengths = [r["prompt_tokens"] for r in result["rows"]]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.plot(lengths, [r["prefill_tok_s"] for r in result["rows"]], marker="o")
    left.set(xscale="log", xlabel="prompt tokens", ylabel="prefill tok/s", title="prefill")
    right.bar([str(n) for n in lengths], [r["decode_tok_s"] for r in result["rows"]])
    right.set(xlabel="prompt tokens", ylabel="decode tok/s", title=f"decode, {result['new_tokens']} tokens, batch 1")
    fig.suptitle(f"{result['model']} on {result['device']}, whole model resident ({result['weights']})")
    save_figure(fig, path, dpi=120)


if __name__ == "__main__":
    main()
