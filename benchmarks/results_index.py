"""Index of the measured results, generated from the result JSON files themselves.

    python3 benchmarks/results_index.py             # writes benchmarks/results/README.md
    python3 benchmarks/results_index.py --readme    # prints the top README's "Results so far" body
    python3 benchmarks/results_index.py --dir D [--out F] [--prompt-len N]

Input: every `*.json` in the folder. Each carries its provenance: `command` (as it was run), `commit` (the code
it ran), `weights`, and optionally `what`, `call` (the GPU-node device call), `commit_note`, `machine` and
`headline_skip` (policies whose figures are not current, e.g. a planner change measured and reverted; "*" for
all). A cost table keeps these in its `meta` (the loader admits no other top-level key); the CPU expert benchmark
keeps its command in `summary`. A missing field reads as "?".
Output: a markdown table (file, what, model, commit/call, command, headline figures) into README.md, and, with
`--readme`, a table of prefill / decode tok/s per policy and (model, routing workload) at one prompt length,
each cell from the newest bench file (highest `call`) that has the point and does not skip its policy.
Only reads; the figures are printed as the files hold them, rounded.
"""
from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
POLICY_ORDER = ("pdscope", "ondemand", "fate", "greedy", "static", "plain")
MODEL_NAMES = {"deepseek-v2-lite": "DeepSeek-V2-Lite", "qwen3-30b-a3b": "Qwen3-30B-A3B",
               "mixtral-8x7b": "Mixtral-8x7B", "moonlight-16b-a3b": "Moonlight-16B-A3B",
               "reference-moe": "reference MoE"}


def fmt(x) -> str:
    """A rate or time rounded for a table: 8,490 / 262 / 18.3 / 0.453."""
    if not isinstance(x, (int, float)):
        return "?"
    if abs(x) >= 1000:
        return f"{x:,.0f}"
    if abs(x) >= 100:
        return f"{x:.0f}"
    if abs(x) >= 1:
        return f"{x:.1f}"
    return f"{x:.3g}"


def provenance(d) -> dict:
    """what / command / commit / call / weights / commit_note / machine from the top level, `meta` or `summary`."""
    out = {}
    places = [d] + [d[k] for k in ("meta", "summary") if isinstance(d, dict) and isinstance(d.get(k), dict)]
    for key in ("what", "command", "commit", "call", "weights", "commit_note", "machine", "headline_skip"):
        for place in places if isinstance(d, dict) else []:
            if key in place:
                out[key] = place[key]
                break
    if "what" not in out and isinstance(d, dict) and isinstance(d.get("benchmark"), str):
        out["what"] = d["benchmark"]
    return out


def display_command(cmd) -> str:
    """The bench records its argv after the subcommand; show it as the command one types."""
    if not isinstance(cmd, str):
        return "?"
    return re.sub(r"^\S*pdscope_jax/__main__\.py", "python3 -m pdscope_jax bench", cmd)


def model_of(name: str, d) -> str:
    m = d.get("model") if isinstance(d, dict) else None
    if isinstance(m, str):
        return m
    for key in MODEL_NAMES:
        if key.replace("-", "_") in name.replace("-", "_"):
            return key
    return ""


def bench_points(d) -> list[dict]:
    """Points of a bench file (`results` rows with prefill_tok_s), labelled by policy or ablation variant."""
    if not isinstance(d, dict) or not isinstance(d.get("results"), list):
        return []
    return [r for r in d["results"] if isinstance(r, dict) and "prefill_tok_s" in r]


def headline(d) -> str:
    """The few figures a reader looks for first, by the kind of result the JSON holds."""
    if not isinstance(d, dict):
        return ""
    points = bench_points(d)
    if points:
        longest = max(r.get("prompt_len", 0) for r in points)
        cells = []
        for r in points:
            if r.get("prompt_len", 0) != longest:
                continue
            label = r.get("variant") or r.get("policy")  # the variant: NAME with its suffixes, or an ablation step
            if r.get("batch", 1) != 1:
                label = f"{label} batch {r['batch']}"
            cells.append(f"{label} {fmt(r.get('prefill_tok_s'))} / {fmt(r.get('decode_tok_s'))}")
        return f"prompt {longest:,}, prefill / decode tok/s: " + "; ".join(cells)
    if "token_buckets" in d:
        one = lambda key: d[key][0] if isinstance(d.get(key), list) and d[key] else None  # noqa: E731
        return (f"1 token: CPU expert {fmt(1e3 * one('cpu_expert_seconds'))} ms, GPU expert "
                f"{fmt(1e3 * one('gpu_expert_seconds'))} ms; t_io {fmt(1e3 * d.get('t_io', 0))} ms an expert")
    if isinstance(d.get("rows"), list) and d["rows"] and "prefill_ratio" in d["rows"][0]:
        return "new / old of the medians, one process, interleaved: " + "; ".join(
            f"{r['policy']} {r['prompt_len']} {r['prefill_ratio']:.3f} / {r['decode_ratio']:.3f}" for r in d["rows"])
    if isinstance(d.get("rows"), list):
        return "prefill / decode tok/s: " + "; ".join(
            f"{r.get('prompt_tokens', '?')}: {fmt(r.get('prefill_tok_s'))} / {fmt(r.get('decode_tok_s'))}"
            for r in d["rows"])
    if isinstance(d.get("runs"), list) and d["runs"] and "ratio" in d["runs"][0]:
        return "peak host memory / checkpoint size: " + ", ".join(
            f"{r.get('memory_kind', '?')} {r['ratio']}" for r in d["runs"])
    if isinstance(d.get("acceptance"), dict):
        return "; ".join(f"{k} {fmt(v['value'])}" for k, v in d["acceptance"].items()
                         if isinstance(v, dict) and "value" in v)
    if isinstance(d.get("recall_at_k_all_layers"), dict):
        r = d["recall_at_k_all_layers"]
        return "all-layer recall@k after the switch, tuned / frozen: " + "; ".join(
            f"{k} {fmt(r['tuned'][k])} / {fmt(r['frozen'][k])}" for k in r.get("tuned", {}) if k.startswith("ood"))
    if isinstance(d.get("final"), dict) and "loss_curve" in d:
        f = d["final"]
        return (f"{f.get('step', '?')} steps, held-out loss {fmt(f.get('heldout_loss'))}, OOD loss "
                f"{fmt(f.get('ood_loss'))}; {fmt(d.get('total_seconds'))} s in all")
    if "offline_phase_seconds" in d:
        return f"offline phase {d['offline_phase_seconds']} s end to end"
    if isinstance(d.get("summary"), dict) and isinstance(d.get("results"), list):
        ms = {(r.get("variant"), r.get("tokens")): r.get("ms") for r in d["results"]}
        toks = sorted({t for (v, t) in ms if v == "engine_bf16"})
        return "engine path / torch bf16 ms at " + ", ".join(
            f"{t}: {fmt(ms.get(('engine_bf16', t)))} / {fmt(ms.get(('torch_bf16', t)))}" for t in toks)
    if isinstance(d.get("records"), list):
        return probe_headline(d["records"])
    if isinstance(d.get("comparison"), list):
        ratios = [r["ratio"] for r in d["comparison"] if r.get("ratio")]
        return (f"new / old per policy, prompt and phase ({' then '.join(d.get('order', []))}): "
                f"{min(ratios):.2f}-{max(ratios):.2f}; " + "; ".join(
                    f"{r['policy']} {r['prompt_len']} {r['phase']} {r['ratio']:.2f}" for r in d["comparison"]
                    if r.get("prompt_len") == max(x["prompt_len"] for x in d["comparison"])))
    if "kernel_isa" in d and isinstance(d.get("results"), list):
        cells = [r for r in d["results"] if r.get("experts") == 6]
        return (f"GB/s of expert bytes at k=6, {d.get('kernel_threads')} threads ({d.get('kernel_isa')}): " + "; ".join(
            f"{r['impl']} {r['rows']} rows {fmt(r.get('gbps'))}" for r in cells))
    return ""


def probe_headline(records: list, limit: int = 8) -> str:
    """A probe's records as `label metric`, the label from its variant/case/kind fields."""
    metrics = ("ms_per_step", "ms_per_layer", "host_ms", "decode_tok_s", "hidden_fraction", "ms", "GBps")
    cells = []
    for r in records:
        if not isinstance(r, dict):
            continue
        metric = next((m for m in metrics if isinstance(r.get(m), (int, float))), None)
        if metric is None:
            continue
        label = " ".join(str(r[k]) for k in ("policy", "variant", "case", "kind", "what", "experts") if k in r)
        cells.append(f"{label} {fmt(r[metric])} {metric}")
    more = f"; ... ({len(cells) - limit} more)" if len(cells) > limit else ""
    return "; ".join(cells[:limit]) + more


def load(folder: Path) -> list[tuple[str, dict]]:
    out = []
    for p in sorted(folder.glob("*.json")):
        try:
            out.append((p.name, json.loads(p.read_text())))
        except (OSError, json.JSONDecodeError) as e:
            out.append((p.name, {"what": f"unreadable: {e}"}))
    return out


def cell(text) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def index_markdown(entries: list[tuple[str, dict]], folder_name: str = "benchmarks/results") -> str:
    lines = [
        "# Measured results (index generated by `python3 benchmarks/results_index.py`; do not edit by hand)",
        "",
        f"Every JSON in `{folder_name}/` with the command and commit that made it. Benchmarks of the published",
        "architectures use their real configs with **seeded random weights** (the `weights` column). Commands are",
        "as they were run (scripts have since moved from `scripts/` to `benchmarks/` and `benchmarks/probes/`; the",
        "bench's recorded argv is shown as `python3 -m pdscope_jax bench ...`). The history of what was measured,",
        "tried and reverted, with the figures, is `docs/MEASUREMENTS.md`. Superseded results left this folder;",
        "`git log --diff-filter=D --name-only -- benchmarks/results` lists them and",
        "`git show <commit>:benchmarks/results/<file>` brings one back. PNGs and `logs_h200/callN_*.log` sit beside",
        "their JSON.",
        "",
        "| file | what | model | weights | commit (call) | command | headline |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, d in entries:
        p = provenance(d)
        commit = f"`{p['commit']}`" if "commit" in p else "?"
        if "call" in p:
            commit += f" (call {p['call']})"
        if "commit_note" in p:
            commit += f"; {p['commit_note']}"
        lines.append("| " + " | ".join(cell(x) for x in (
            f"`{name}`", p.get("what", "?"), model_of(name, d), p.get("weights", "?"), commit,
            f"`{display_command(p.get('command'))}`", headline(d))) + " |")
    return "\n".join(lines) + "\n"


def memory_of(d: dict) -> str:
    """A bench file's accelerator configuration: "24 GB" (budget; in MiB where given so, e.g. a peer's measured
    peak), "24 GB, 8 GB pool" (the slot pool capped), and the experts' stored precision where quantized ("24 GB, 8 GB
    pool, int8"), then the card where it is an H100. A run held to a peer's nvidia-smi peak as nvidia-smi counts
    its own memory (`matched_gpu_mib`: its budget is less, by the CUDA context and a slack) reads "24,399 MiB by
    nvidia-smi", so it never shares a column with a run whose budget was that figure. A file of `plain` runs alone
    reads "whole model": the whole model takes no budget, whatever its runtime recorded."""
    card = ", H100" if "H100" in str(d.get("device", "")) else ""  # the table's card is the H200 unless named
    points = bench_points(d)
    if points and all(r.get("policy") == "plain" for r in points):
        return "whole model" + card
    runtime = d.get("runtime") if isinstance(d.get("runtime"), dict) else {}
    gpu, pool = runtime.get("gpu_memory"), runtime.get("expert_pool")
    gb = lambda x: (f"{x / 2**20:,.0f} MiB" if isinstance(x, (int, float)) and x % 1e9 and not x % 2**20  # noqa: E731
                    else f"{x / 1e9:g} GB" if isinstance(x, (int, float)) else "?")  # a peer's peak, as measured
    matched = d.get("matched_gpu_mib")
    quantize = d.get("quantize")
    size = f"{matched:,} MiB by nvidia-smi" if matched else gb(gpu)
    return size + (f", {gb(pool)} pool" if pool is not None else "") + (f", {quantize}" if quantize else "") + card


def headline_cells(entries: list[tuple[str, dict]], prompt_len: int) -> dict:
    """{(model, workload, memory): {policy: (prefill, decode, call, file)}}, each from the newest file with that
    point; `memory_of` keeps budgets and precisions apart, so a column never mixes them."""
    best: dict = {}
    for name, d in entries:
        if not isinstance(d, dict) or d.get("ablation") or not bench_points(d):
            continue
        p = provenance(d)
        skip = p.get("headline_skip") or []
        call = p.get("call") if isinstance(p.get("call"), int) else -1
        key = (d.get("model", "?"), d.get("workload", "?"), memory_of(d))  # the file's column
        for r in bench_points(d):
            policy = r.get("policy")
            if r.get("prompt_len") != prompt_len or r.get("batch", 1) != 1 or "*" in skip or policy in skip:
                continue
            if r.get("variant", policy) != policy:  # a policy with an engine switch off (NAME:host, NAME:nobank)
                continue
            old = best.setdefault(key, {}).get(policy)
            if old is None or call > old[2]:
                best[key][policy] = (r.get("prefill_tok_s"), r.get("decode_tok_s"), call, name)
    return best


def readme_section(entries: list[tuple[str, dict]], prompt_len: int = 4096) -> str:
    """The body of the top README's "Results so far": one table, one line on where it comes from."""
    best = headline_cells(entries, prompt_len)
    columns = sorted(best, key=lambda k: (list(MODEL_NAMES).index(k[0]) if k[0] in MODEL_NAMES else 99,
                                          k[1] != "uniform", str(k[1]), k[2]))
    policies = [p for p in POLICY_ORDER if any(p in best[c] for c in columns)]
    policies += sorted({p for c in columns for p in best[c]} - set(policies))
    files = sorted({v[3] for c in columns for v in best[c].values()})
    calls = sorted({v[2] for c in columns for v in best[c].values() if v[2] >= 0})
    weights = sorted({str(provenance(d).get("weights", "?")) for n, d in entries if n in files})
    lines = [
        "<!-- generated by `python3 benchmarks/results_index.py --readme` from benchmarks/results/*.json -->",
        f"Prefill / decode tok/s at a {prompt_len:,}-token prompt, batch 1, one H200 (PCIe; an H100 where a column"
        " names it) with a 16-core host; each column names the model, the routing workload and the GPU budget (and"
        " the expert pool's cap where one was set); `plain` holds the whole model on the GPU. Weights: "
        + ", ".join(weights) + " (the real architectures, no trained checkpoint).",
        "",
        "| policy | " + " | ".join(f"{MODEL_NAMES.get(m, m)}, {w}, {mem}" for m, w, mem in columns) + " |",
        "|---|" + "---|" * len(columns),
    ]
    for policy in policies:
        row = []
        for c in columns:
            v = best[c].get(policy)
            row.append(f"{fmt(v[0])} / {v[1]:.1f}" if v and isinstance(v[1], (int, float)) else
                       f"{fmt(v[0])} / ?" if v else "-")
        lines.append(f"| `{policy}` | " + " | ".join(row) + " |")
    lines += ["", "From " + ", ".join(f"`{f}`" for f in files)
              + (f" (calls {', '.join(map(str, calls))})" if calls else "")
              + "; each file's command and commit: `benchmarks/results/README.md`; the history: "
              "`docs/MEASUREMENTS.md`."]
    # a result that is known to flatter says so in its JSON ("caveat"), and the table carries it
    caveats: dict[str, list[str]] = {}
    for name, d in entries:
        if name in files and d.get("caveat"):
            caveats.setdefault(d["caveat"], []).append(name)
    lines += [f"Caveat ({', '.join(names)}): {text}." for text, names in caveats.items()]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", type=Path, default=RESULTS, help="folder of result JSON files")
    ap.add_argument("--out", type=Path, default=None, help="index file (default: <dir>/README.md)")
    ap.add_argument("--readme", action="store_true", help="print the top README's results table instead")
    ap.add_argument("--prompt-len", type=int, default=4096, help="prompt length of the README table")
    args = ap.parse_args(argv)
    entries = load(args.dir)
    if args.readme:
        print(readme_section(entries, args.prompt_len), end="")
        return 0
    out = args.out or args.dir / "README.md"
    out.write_text(index_markdown(entries))
    print(f"wrote {out} ({len(entries)} results)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
