"""What `pdscope-jax bench` shows and saves: the rich table, the PNG plot, the JSON encoder and the summary line.

Contract: every function reads the result rows `bench.runs.summarise` / `bench.runs.run_plain` build (keys
`variant`, `policy`, `batch`, `prompt_len`, `prefill_tok_s`, `decode_tok_s`, per phase the medians of
`PHASE_TIMES`, `bytes_moved`, `hit_rate`, `prefetch_accuracy`, `planner_ms_per_layer`, `device_steps`,
`prediction_recall`, and the parity keys `tokens_match_plain` / `tokens_before_divergence`) and never changes them.
A phase run as one accelerator program per step (`device_steps` > 0) has no time split and shows "one
program/step"; its prediction recall, None where it predicts nothing, shows as "n/a (device)". The summary line
carries each row's `prediction_recall` per phase (None: no prediction in that phase). `peak_note(row, budget)`: the
allocator's peak of a point against the budget, for the line printed as it ends.
"""

from __future__ import annotations

import json
from pathlib import Path

from pdscope_jax.sched import PLAIN

PHASE_TIMES = ("cpu_seconds", "gpu_seconds", "transfer_seconds", "exposed_transfer_seconds")
SUMMARY_KEYS = ("variant", "policy", "batch", "prompt_len", "prefill_tok_s", "decode_tok_s", "tokens_match_plain",
                "tokens_before_divergence")


def table(results: list[dict], on_gpu: bool = False):
    """A rich Table of the medians, one row per result (the plain run shows only its throughput and parity); on a
    GPU its caption names each run whose device decode ran without the host bridge, and why."""
    from rich.table import Table

    out = Table(title="offload benchmark (medians; times summed over layers, seconds)",
                caption="next-layer recall: recall@k of the scores the planner saw for the next MoE layer "
                        "(engine.stats.prediction_hits); - without a predictor; n/a (device): device decode without "
                        "copies ahead predicts nothing")
    for name in ("run", "batch", "prompt", "prefill tok/s", "decode tok/s", "next-layer recall (p/d)",
                 "prefill cpu/gpu/xfer/exposed",
                 "decode cpu/gpu/xfer/exposed", "GB moved (p/d)", "decode hit rate", "prefetch acc (p/d)",
                 "planner ms/layer (p/d)", "= plain (tokens)"):
        out.add_column(name, justify="right")
    fmt = lambda v, digits=2: "-" if v is None else f"{v:.{digits}f}"  # noqa: E731
    for r in results:
        match = {None: "-", True: "yes", False: f"no ({r.get('tokens_before_divergence')})"}[
            r.get("tokens_match_plain")]
        head = (r["variant"], str(r["batch"]), str(r["prompt_len"]), f"{r['prefill_tok_s']:.1f}",
                f"{r['decode_tok_s']:.2f}")
        if r["policy"] == PLAIN:
            out.add_row(*head, *["-"] * 7, match)
            continue
        p, d = r["prefill"], r["decode"]

        def split(s):  # a phase run as one accelerator program per step has no split
            return "one program/step" if s.get("device_steps") else "/".join(fmt(s[k], 3) for k in PHASE_TIMES)

        def recall(s):
            return "n/a (device)" if s.get("prediction_recall") is None and s.get("device_steps") else fmt(
                s.get("prediction_recall"), 3)

        out.add_row(*head, f"{recall(p)}/{recall(d)}", split(p), split(d),
                    f"{(p['bytes_moved'] or 0) / 1e9:.2f}/{(d['bytes_moved'] or 0) / 1e9:.2f}", fmt(d["hit_rate"]),
                    f"{fmt(p['prefetch_accuracy'])}/{fmt(d['prefetch_accuracy'])}",
                    f"{fmt(p['planner_ms_per_layer'], 3)}/{fmt(d['planner_ms_per_layer'], 3)}", match)
    notes = dict.fromkeys(f"{r['variant']}: device decode ran without the host bridge ({why}): the host computed "
                          "none of its misses, the program copied them" for r in results
                          if on_gpu and (why := bridge_missing(r)))
    if notes:
        out.caption += "\n" + "\n".join(notes)
    return out


def bridge_missing(result: dict) -> str | None:
    """Why a run whose decode ran on the device had no host bridge (the engine's `decode_host.why_not`), else
    None (a bridge ran, or decode did not run on the device)."""
    if not result.get("decode", {}).get("device_steps"):
        return None
    return next((why for rep in result.get("repeats", []) if (why := (rep.get("decode_host") or {}).get("why_not"))),
                None)


def peak_note(row: dict, budget: int) -> str:
    """", GPU peak P GB of the B GB budget (after the warm-ups W)" for a point whose device reports a peak, flagged
    where it is over the budget (the peak is the process's so far: W tells what the warm-ups held); "" where none."""
    peak = max((r.get("device_peak_bytes") or 0 for r in row.get("repeats", [])), default=0)
    if not peak:
        return ""
    warm = row.get("device_peak_after_warmup")
    after = f" (after the warm-ups {warm / 1e9:.2f})" if warm else ""
    over = f" [bold yellow]{peak / budget - 1:.1%} over the budget[/]" if peak > budget else ""
    return f", GPU peak {peak / 1e9:.2f} GB of the {budget / 1e9:.2f} GB budget{after}{over}"


def plot(report: dict, path: Path) -> None:
    """Prefill and decode tok/s over prompt length per run (and batch), the time split at the longest prompt,
    and accelerator memory per decode step when the report has a memory trace; saved as a PNG at `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    results = report["results"]
    several = len(report["batch"]) > 1
    lines = list(dict.fromkeys((r["variant"], r["batch"]) for r in results))
    panels = 4 if report["memory"] else 3
    fig, axes = plt.subplots(1, panels, figsize=(5 * panels, 4))
    for variant, batch in lines:
        rows = [r for r in results if (r["variant"], r["batch"]) == (variant, batch)]
        label = f"{variant} b{batch}" if several else variant
        axes[0].plot([r["prompt_len"] for r in rows], [r["prefill_tok_s"] for r in rows], marker="o", label=label)
        axes[1].plot([r["prompt_len"] for r in rows], [r["decode_tok_s"] for r in rows], marker="o", label=label)
    for ax, title in zip(axes[:2], ("prefill tok/s", "decode tok/s")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("prompt length")
        ax.set_title(title)
        ax.legend(fontsize=7)
    longest = max((r["prompt_len"] for r in results), default=0)
    bars = [r for r in results if r["prompt_len"] == longest and r["batch"] == report["batch"][0]
            and r["policy"] != PLAIN]
    labels = [f"{r['variant']}\n{phase}" for r in bars for phase in ("prefill", "decode")]
    bottom = np.zeros(len(labels))
    for key in PHASE_TIMES:
        values = np.array([r[phase][key] or 0.0 for r in bars for phase in ("prefill", "decode")])
        axes[2].bar(labels, values, bottom=bottom if key != "exposed_transfer_seconds" else None,
                    label=key.replace("_seconds", ""), alpha=0.5 if key == "exposed_transfer_seconds" else 1.0)
        if key != "exposed_transfer_seconds":
            bottom += values
    axes[2].set_title(f"time split, prompt {longest} (s, summed over layers)")
    axes[2].tick_params(axis="x", labelsize=7)
    axes[2].legend(fontsize=7)
    if report["memory"]:
        steps = report["memory"]["steps"]
        axes[3].plot([s["live_array_bytes"] / 1e6 for s in steps], label="live arrays")
        if steps and steps[0]["bytes_in_use"] is not None:
            axes[3].plot([s["bytes_in_use"] / 1e6 for s in steps], label="allocator in use")
        axes[3].set_xlabel("decode step")
        axes[3].set_ylabel("MB on the accelerator")
        axes[3].set_title(f"memory, {report['memory']['policy']}")
        axes[3].legend()
    fig.suptitle(f"{report['model']} ({report['weights']}, {report['workload']} routing) on {report['device']}, "
                 f"batch {report['batch']}, budget {report['runtime']['gpu_memory'] / 1e9:.1f} GB")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_json(report: dict, path: Path) -> None:
    """The report as indented JSON (numpy scalars and arrays as numbers and lists, anything else as str)."""
    path.write_text(json.dumps(report, indent=1, default=_jsonable))


def summary_line(report: dict, json_path: Path, png_path: Path) -> str:
    """The one JSON line printed last: where the files are, and the headline figures of every result."""
    return json.dumps({"json": str(json_path), "png": str(png_path), "model": report["model"],
                       "device": report["device"], "workload": report["workload"],
                       "results": [{**{k: r.get(k) for k in SUMMARY_KEYS},
                                    "prediction_recall": {phase: (r.get(phase) or {}).get("prediction_recall")
                                                          for phase in ("prefill", "decode")}}
                                   for r in report["results"]],
                       "errors": report["errors"]})


def _jsonable(value):
    import numpy as np

    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    return str(value)
