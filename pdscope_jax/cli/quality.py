"""`pdscope-jax quality`: held-out perplexity and greedy agreement of the model with int8 and int4 routed experts.

Contract: `main(argv)` checks every option first (one InputError naming each problem and its fix; nothing loaded),
then runs `bench.quality.evaluate` (the plain model loaded once per precision: MODEL's dtype as the reference, then
each `--quantize` scheme, default int8 and int4; with `--mixed` also pdscope with quality "mixed" on int8 experts,
`--pool-fraction` of them in the slot pool, scored through decode steps and with its int4 shares) with a rich
progress bar over the perplexity windows, prints a table (precision, bytes of routed experts, perplexity, delta vs
the reference with PASS/FAIL against the issue's targets, greedy agreement, first divergence) and writes the JSON
(the measurements plus command, commit, machine) atomically to `--out` (default:
benchmarks/results/quality_<model>_<dtype>.json when that folder is under the current directory, else
quality_<model>_<dtype>.json here). Returns 0 (1 when a target fails and `--strict`).
"""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path

from pdscope_jax.artifacts.provenance import source_commit


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdscope-jax quality", description=__doc__.splitlines()[0])
    p.add_argument("model", nargs="?", default="reference-moe",
                   help="preset name, embedded model, checkpoint directory or HF-cache name (default: %(default)s)")
    p.add_argument("--dtype", default="bfloat16", help="bfloat16 or float32 (default: %(default)s)")
    p.add_argument("--window", type=int, default=256, help="tokens per perplexity window (default: %(default)s)")
    p.add_argument("--tokens", type=int, default=32768,
                   help="held-out tokens cut into non-overlapping windows (default: %(default)s)")
    p.add_argument("--batch", type=int, default=8, help="windows per logits call (default: %(default)s)")
    p.add_argument("--prompts", type=int, default=8, help="held-out prompts generated from (default: %(default)s)")
    p.add_argument("--prompt-len", type=int, default=64, help="tokens per prompt (default: %(default)s)")
    p.add_argument("--new-tokens", type=int, default=256, help="greedy tokens per prompt (default: %(default)s)")
    p.add_argument("--quantize", nargs="+", choices=("int8", "int4"), default=["int8", "int4"],
                   help="schemes compared with the reference (default: int8 int4)")
    p.add_argument("--mixed", action="store_true",
                   help="add pdscope with --quality mixed on int8 experts (offloaded; perplexity through decode steps)")
    p.add_argument("--mixed-threshold", type=float, default=1.0,
                   help="--mixed: the rule's threshold (RuntimeConfig.mixed_threshold; default: %(default)s)")
    p.add_argument("--pool-fraction", type=float, default=0.25,
                   help="--mixed: the share of the int8 experts the slot pool holds (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="corpus split, prompt offsets, random weights")
    p.add_argument("--out", type=Path, help="JSON file (default: see above)")
    p.add_argument("--machine", help="where it ran, recorded in the JSON (default: the JAX backend and CPU count)")
    p.add_argument("--strict", action="store_true", help="exit 1 when a precision misses its target")
    return p


def default_out(model: str, dtype: str) -> Path:
    name = f"quality_{Path(model).name or model.replace('/', '_')}_{dtype}.json"
    results = Path("benchmarks") / "results"
    return results / name if results.is_dir() else Path(name)


def _machine() -> str:
    import os
    import platform

    import jax

    return f"{jax.default_backend()} backend, {platform.machine()}, {os.cpu_count()} CPU cores"


def _table(doc: dict):
    from rich.table import Table

    table = Table("precision", "routed experts", "perplexity", "vs reference", "greedy agreement",
                  "first divergence", title=f"{doc['model']} ({doc['weights']}), {doc['tokens_scored']} held-out "
                                            f"tokens, {doc['prompts']} prompts x {doc['new_tokens']} greedy tokens")
    for r in doc["precisions"]:
        verdict = "" if r["pass"] is None else (" [green]PASS" if r["pass"] else " [red]FAIL")
        limit = "" if r["target_pct"] is None else f" (<= +{r['target_pct']:g}%)"
        low = r.get("decode_copies_low")
        name = r["precision"] + ("" if low is None else f" ({100 * low:.0f}% of copies int4)")
        table.add_row(name, f"{r['expert_bytes'] / 2**20:.2f} MiB", f"{r['ppl']:.4f}",
                      f"{r['delta_pct']:+.3f}%{limit}{verdict}", f"{r['agreement']:.3f}",
                      f"{r['first_divergence']:.1f} / {doc['new_tokens']}")
    return table


def main(argv: list[str] | None = None) -> int:
    argv = list(argv or [])
    args = _parser().parse_args(argv)
    from pdscope_jax.bench import quality
    from pdscope_jax.cli import checks
    from pdscope_jax.errors import raise_problems

    s = quality.Settings(model=args.model, dtype=args.dtype, window=args.window, tokens=args.tokens,
                         batch=args.batch, prompts=args.prompts, prompt_len=args.prompt_len,
                         new_tokens=args.new_tokens, seed=args.seed,
                         precisions=(None, *dict.fromkeys(args.quantize)), mixed=args.mixed,
                         mixed_threshold=args.mixed_threshold, pool_fraction=args.pool_fraction)
    out = args.out or default_out(args.model, args.dtype)
    problems = quality.settings_problems(s)
    checks.check_writable_file(problems, "--out", out)
    raise_problems(problems, "bad arguments")

    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from pdscope_jax.artifacts.integrity import atomic_write_json

    data = quality.heldout_data(s)  # the split's size is checked before any weight loads
    console = Console()
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("windows"),
                  TimeElapsedColumn(), console=console) as bar:
        tasks = {}

        def progress(name: str, done: int, total: int) -> None:
            if name not in tasks:
                tasks[name] = bar.add_task(f"perplexity {name}", total=total)
            bar.update(tasks[name], completed=done)

        doc = quality.evaluate(s, progress=progress, data=data)
    mixed = " and of pdscope with quality mixed (int8 experts, int4 copies)" if args.mixed else ""
    doc = {"what": f"quality of int8 / int4 routed experts{mixed} against {args.dtype}: held-out perplexity and "
                   f"greedy agreement, {args.model}",
           "command": shlex.join(["pdscope-jax", "quality", *argv]), "commit": source_commit(),
           "machine": args.machine or _machine(), **doc}
    console.print(_table(doc))
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out, doc, indent=1)
    console.print(f"wrote {out}")
    failed = [r["precision"] for r in doc["precisions"] if r["pass"] is False]
    return 1 if failed and args.strict else 0
