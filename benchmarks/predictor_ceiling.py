"""How well the next MoE layer's routing can be learned from what PhasePer sees, measured on validation prompts.

Inputs: `--model` and `--traces`, train traces collected by `pdscope-jax collect-traces --split train` (prompts
in order, the same batch in both phases). The last `--val-prompts` prompts are the validation set: every figure
here comes from them, never from the held-out or out-of-domain sets, so settings chosen here are not tuned on those.
Learning curves: for every `--arch NAME=PROJ:HIDDEN[:linear][:warm]` (`:linear`: `PredictorHParams.linear`;
`:warm`: `TrainConfig.decode_from_prefill`) and every prefix of `--train-prompts` prompts, PhasePer predictors
(`pdscope_jax.phaseper.train.train_predictors`: the paper's losses and layer groups, early stopping on its own split
of whole prompts in prefill and whole sequences in decode) are trained on the prefix and scored on the validation
prompts by recall@k and Table-5 (one prompt a step in prefill, one token in decode), beside fair Fate and frequency
(`benchmarks/eval_predictors.py`); `--predictors DIR` scores a trained checkpoint there too. A curve that no
longer rises with width or data is the learnable ceiling of these inputs at this data size.
Run from the repository root: `PYTHONPATH=. python benchmarks/predictor_ceiling.py --model reference-moe --traces DIR
--out-json FILE --out-png FILE [--phases decode] [--arch wide=160:512:linear] [--train-prompts 448 896]`.
Writes `--out-json` (every figure, command, commit, machine) and `--out-png` (validation recall@k and Table-5
against training prompts per arch and phase), and a one-line JSON summary to stdout.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import numpy as np

from _shared import command_line, commit, machine, pyplot, save_figure
from eval_predictors import Gates, step_layout, topk_counts
from pdscope_jax.phaseper.checkpoint import load_predictors
from pdscope_jax.phaseper.groups import groups_from_traces
from pdscope_jax.phaseper.predictor import PredictorHParams
from pdscope_jax.phaseper.traces import PHASES, LayerPairs, Traces, load_traces
from pdscope_jax.phaseper.train import TrainConfig, recall_at_k, table5_accuracy, train_predictors


class PromptView:
    """`traces` restricted to prompts [lo, hi) (whole batches), with the interface `train_predictors` reads.
    Prefill steps are prompts; decode steps stay as collected (one token of each of the batch's sequences)."""

    def __init__(self, traces: Traces, lo: int, hi: int):
        self.traces, self.layers = traces, traces.layers
        self.dim, self.k, self.num_experts = traces.dim, traces.k, traces.num_experts
        batch, t, s = step_layout(traces)
        if lo % batch or hi % batch:
            raise ValueError(f"prompts [{lo}, {hi}) are not whole batches of {batch}")
        self.index = {"prefill": np.arange(lo * t, hi * t), "decode": np.arange(lo * s, hi * s)}
        self.steps = {"prefill": np.full(hi - lo, t, np.int32), "decode": np.full((hi - lo) // batch * s, batch,
                                                                                  np.int32)}

    def pairs(self, phase: str, layer: int) -> LayerPairs:
        p, idx = self.traces.pairs(phase, layer), self.index[phase]
        return LayerPairs(layer, p.next_layer, p.a[idx], p.w[idx], p.e[idx], p.e_next[idx], self.steps[phase])


def score(pset, gates: Gates, train: PromptView, val: PromptView, phases) -> dict:
    """{phase: {"layers": {layer: {method: {recall_at_k, table5}}}, "all": {method: ...}}} on `val`."""
    out = {}
    for phase in phases:
        per_layer = {}
        for layer in pset.source_layers:
            pairs = val.pairs(phase, layer)
            steps = pairs.steps if phase == "prefill" else np.ones(len(pairs), np.int32)
            freq = np.bincount(train.pairs(phase, layer).e_next.reshape(-1), minlength=val.num_experts)
            scores = {"phaseper": pset.predict(phase, layer, pairs.a, pairs.w, pairs.e),
                      "fate_topk": topk_counts(gates.picks(pairs.next_layer, pairs.a),
                                               gates.probs(pairs.next_layer, pairs.a)),
                      "frequency": np.tile(freq.astype(np.float32), (len(pairs), 1))}
            per_layer[layer] = {"group": pset.group(layer), **{
                m: {"recall_at_k": recall_at_k(s, pairs.e_next, val.k),
                    "table5": table5_accuracy(s, pairs.e_next, steps, val.num_experts)} for m, s in scores.items()}}
        means = {m: {metric: float(np.mean([v[m][metric] for v in per_layer.values()]))
                     for metric in ("recall_at_k", "table5")} for m in ("phaseper", "fate_topk", "frequency")}
        out[phase] = {"layers": per_layer, "all": means}
    return out


def plot(curves: list[dict], checkpoint: dict | None, phases, path: Path) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 2 * len(phases), figsize=(4.2 * 2 * len(phases), 3.4), squeeze=False)
    for c, (phase, metric) in enumerate((p, m) for p in phases for m in ("recall_at_k", "table5")):
        ax = axes[0][c]
        for arch in dict.fromkeys(r["arch"] for r in curves):
            rows = [r for r in curves if r["arch"] == arch]
            ax.plot([r["train_prompts"] for r in rows], [r["val"][phase]["all"]["phaseper"][metric] for r in rows],
                    marker="o", label=f"PhasePer {arch}")
        fate = curves[0]["val"][phase]["all"]["fate_topk"][metric]
        ax.axhline(fate, color="tab:orange", ls="--", label="fair Fate")
        if checkpoint:
            ax.axhline(checkpoint["val"][phase]["all"]["phaseper"][metric], color="tab:gray", ls=":",
                       label="checkpoint")
        ax.set_title(f"validation {phase} {metric}", fontsize=9)
        ax.set_xlabel("training prompts")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    save_figure(fig, path, dpi=100)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--traces", type=Path, required=True, help="train traces, prompts in collection order")
    p.add_argument("--val-prompts", type=int, default=128)
    p.add_argument("--train-prompts", type=int, nargs="+", default=[256])
    p.add_argument("--arch", action="append", default=[], metavar="NAME=PROJ:HIDDEN[:linear][:warm]",
                   help="network widths, the linear path, decode started from prefill (see the module docstring)")
    p.add_argument("--phases", nargs="+", default=list(PHASES), choices=PHASES)
    p.add_argument("--epochs", type=int, default=200)
    p.add_argument("--patience", type=int, default=8)
    p.add_argument("--predictors", type=Path, help="a trained checkpoint to score on the validation prompts")
    p.add_argument("--out-json", type=Path, required=True)
    p.add_argument("--out-png", type=Path, required=True)
    args = p.parse_args(argv)

    traces = load_traces(args.traces)
    total = len(traces.layer("prefill", traces.layers[0])["steps"]) * step_layout(traces)[0]
    val = PromptView(traces, total - args.val_prompts, total)
    gates = Gates(args.model)
    groups = groups_from_traces(traces, "prefill")[0]
    archs = dict(a.split("=", 1) for a in args.arch) or {"shipped": "64:128"}
    t0, curves = time.perf_counter(), []
    for name, spec in archs.items():
        proj, hidden, *extra = spec.split(":")
        cfg = TrainConfig(epochs=args.epochs, patience=args.patience, decode_from_prefill="warm" in extra)
        for n in args.train_prompts:
            train = PromptView(traces, 0, min(n, total - args.val_prompts))
            hp = PredictorHParams(traces.dim, traces.k, traces.num_experts, int(proj), int(hidden), "linear" in extra)
            t1 = time.perf_counter()
            pset, metrics = train_predictors(train, groups, hp, config=cfg, progress=False, phases=args.phases)
            curves.append({"arch": name, "hparams": hp.to_dict(), "train_config": dataclasses.asdict(cfg),
                           "train_prompts": n,
                           "seconds": round(time.perf_counter() - t1, 1),
                           "epochs_run": {ph: {l: m.get("epochs_run")
                                               for l, m in metrics["phases"][ph]["layers"].items()}
                                          for ph in args.phases},
                           "val": score(pset, gates, train, val, args.phases)})
            print(json.dumps({k: curves[-1][k] for k in ("arch", "train_prompts", "seconds")}
                             | {ph: curves[-1]["val"][ph]["all"] for ph in args.phases}), flush=True)
    report = {"what": "learnable ceiling of PhasePer's inputs on validation prompts of the train text",
              "command": command_line(__file__, argv), "commit": commit(), "machine": machine(),
              "weights": "checkpoint", "model": args.model, "traces": traces.description,
              "val_prompts": [total - args.val_prompts, total], "groups": list(groups),
              "curves": curves}
    if args.predictors:
        pset, manifest = load_predictors(args.predictors, gates.cfg)
        report["checkpoint"] = {"path": str(args.predictors), "corpus": manifest["corpus"],
                                "val": score(pset, gates, PromptView(traces, 0, total - args.val_prompts), val,
                                             args.phases)}
    report["seconds"] = round(time.perf_counter() - t0, 1)
    args.out_json.parent.mkdir(parents=True, exist_ok=True)
    args.out_json.write_text(json.dumps(report, indent=1))
    plot(curves, report.get("checkpoint"), args.phases, args.out_png)
    print(json.dumps({"curves": [{k: c[k] for k in ("arch", "train_prompts")} | {
        ph: c["val"][ph]["all"]["phaseper"] for ph in args.phases} for c in curves]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
