"""Evaluate trained PhasePer predictors on held-out and out-of-domain traces against fair baselines.

Inputs: the model (`--model`: only its routers and config are used), a predictor checkpoint (`--predictors`), the
TRAIN traces the predictors were trained on (`--train-traces`, for the frequency baseline only) and evaluation
trace sets (`--eval NAME=DIR`; `heldout` is in domain, every other name out of domain), all collected by
`pdscope-jax collect-traces` from that model (fingerprints are checked).
Scores, per set, phase and source MoE layer l (predicting the experts of MoE layer l+1) and as the mean over each
layer group's layers, the methods of `METHODS` (see `evaluate_set`) by recall@k per token and the paper's Table-5
accuracy with one request as the step (`pdscope_jax.phaseper.train`, `request_steps`). Fate's gate is aggregated
two ways, both reported: `fate_topk`, counting the experts the gate picks (what Fate does, the fair baseline the
checks use), and `fate_probsum`, summing its softmax probabilities (not used in comparisons).
Predictor cost: parameter bytes, the checkpoint's bytes on disk and the latency of `PredictorSet.predict` for 1
token and one prompt (median and p90 after compilation) on the CPU backend and, where there is one, the accelerator.
Checks (`TARGETS`, reported per set, phase and group, never tuned on): prefill Table-5 >= 0.95 in domain and >= 0.85
out of domain, decode recall@k >= 0.92 / >= 0.85 (on the all-layer mean; groups shown), and PhasePer above every
baseline of `BASELINES` in every group, phase and metric of every set.
Run from the repository root: `PYTHONPATH=. python benchmarks/eval_predictors.py --model M --predictors DIR
--train-traces DIR --eval heldout=DIR [--eval ood=DIR ...] --out-json FILE --out-png FILE`.
Writes `--out-json` (every number, the command, commit and machine, the traces' descriptions and the near-duplicate
lines removed from each set's text), `--out-png` (per set: recall@k and Table-5 per group and phase, PhasePer next
to the fair baselines), a table and a one-line JSON summary to stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from _shared import command_line, commit, machine, pyplot, save_figure
from pdscope_jax.api import resolve
from pdscope_jax.phaseper.checkpoint import load_predictors
from pdscope_jax.phaseper.groups import GROUP_NAMES
from pdscope_jax.phaseper.traces import PHASES, Traces, load_traces
from pdscope_jax.phaseper.train import recall_at_k, table5_accuracy
from pdscope_jax.text import corpus

METHODS = ("phaseper", "fate_topk", "fate_probsum", "frequency", "prev_token")
BASELINES = ("fate_topk", "frequency", "prev_token")  # what PhasePer must beat
METRICS = ("recall_at_k", "table5")
IN_DOMAIN = "heldout"
TARGETS = {"in_domain": {"prefill": ("table5", 0.95), "decode": ("recall_at_k", 0.92)},
           "out_of_domain": {"prefill": ("table5", 0.85), "decode": ("recall_at_k", 0.85)}}
TIE_BREAK = 1e-6  # fate_topk: a step's equal counts ordered by summed probability (256 tokens add < 1e-3)


# ---- baselines ---------------------------------------------------------------------------------------------
class Gates:
    """Every MoE layer's router of the model (float32): its probabilities and its top-k picks (the model's rule)."""

    def __init__(self, model_name: str):
        import pdscope_jax

        runner = pdscope_jax.load(model_name, dtype="float32")
        self.cfg = runner.config
        self.mlps = {i: layer.mlp for i, layer in enumerate(runner.model.layers) if layer.is_moe}
        self.kernels = {i: np.asarray(mlp.gate.kernel[...], np.float32) for i, mlp in self.mlps.items()}

    def probs(self, layer: int, a: np.ndarray) -> np.ndarray:
        return gate_scores(a, self.kernels[layer], self.cfg.scoring_func)

    def picks(self, layer: int, a: np.ndarray, chunk: int = 8192) -> np.ndarray:
        """[N, K] experts layer `layer`'s router picks for inputs a [N, D]."""
        route = self.mlps[layer].route
        return np.concatenate([np.asarray(route(jnp.asarray(a[s:s + chunk], jnp.float32))[1])
                               for s in range(0, len(a), chunk)])


def topk_counts(picks: np.ndarray, probs: np.ndarray) -> np.ndarray:
    """[N, E] float64: 1 for each picked expert, plus `TIE_BREAK` x its probability, so summed over a step's tokens
    the experts rank by how many tokens pick them, ties by summed probability."""
    scores = TIE_BREAK * probs.astype(np.float64)
    np.put_along_axis(scores, picks.astype(np.int64), 1.0 + np.take_along_axis(scores, picks, axis=1), axis=1)
    return scores


def gate_scores(a: np.ndarray, kernel: np.ndarray, scoring: str) -> np.ndarray:
    """[N, E] router scores of a [N, D] under kernel [D, E]: softmax or sigmoid of the logits."""
    z = a.astype(np.float32) @ kernel  # [N, E]
    if scoring == "sigmoid":
        return 1.0 / (1.0 + np.exp(-z))
    z = z - z.max(axis=1, keepdims=True)
    p = np.exp(z)
    return p / p.sum(axis=1, keepdims=True)


def train_frequencies(train: Traces, phase: str, layer: int) -> np.ndarray:
    """[E] fraction of train tokens of `phase` that activate each expert of `layer`."""
    counts = train.layer(phase, layer)["counts"].sum(axis=0).astype(np.float64)  # [E]
    tokens = max(1, train.tokens(phase, layer))
    return counts / tokens


def step_layout(traces: Traces) -> tuple[int, int, int]:
    """(B sequences per forward, T prompt tokens, S decode steps per batch) of a collection."""
    first = traces.layers[0]
    pre, dec = traces.layer("prefill", first)["steps"], traces.layer("decode", first)["steps"]
    if len(pre) == 0 or len(dec) == 0:
        raise ValueError(f"{traces.dir}: the evaluation needs both prefill and decode traces")
    batch = int(dec[0])
    return batch, int(pre[0]) // batch, len(dec) // len(pre)


def prev_token_scores(traces: Traces, next_layer: int, n: int, freq: np.ndarray) -> np.ndarray:
    """[n, E] decode scores: the previous token's routing weights at `next_layer` (see the module docstring)."""
    batch, t, s = step_layout(traces)
    dec, pre = traces.layer("decode", next_layer), traces.layer("prefill", next_layer)
    idx = np.arange(n)
    step, seq = idx // batch, idx % batch
    batch_i, s_i = step // s, step % s
    prev_e = np.empty((n, traces.k), np.int64)
    prev_w = np.empty((n, traces.k), np.float32)
    later = s_i > 0
    prev_e[later], prev_w[later] = dec["e"][idx[later] - batch], dec["w"][idx[later] - batch]
    first = ~later
    last_prompt = batch_i[first] * batch * t + seq[first] * t + (t - 1)
    prev_e[first], prev_w[first] = pre["e"][last_prompt], pre["w"][last_prompt]
    scores = np.tile(1e-6 * freq.astype(np.float32), (n, 1))  # [n, E]
    np.put_along_axis(scores, prev_e, prev_w + scores[np.arange(n)[:, None], prev_e], axis=1)
    return scores


def request_steps(traces: Traces, phase: str, n: int) -> np.ndarray:
    """Table-5 steps: one prompt (T tokens) per step in prefill, one token per step in decode.

    In prefill the collected [B*T] forward is cut back into its B sequences of T tokens (T = prefill step / decode
    step size); the true counts are tokens per l+1 expert in that prompt, the predicted ranking the per-expert sum
    of scores over the prompt, and a true top-6 expert hits if its predicted rank is within +-2 of its
    (tie-aware) true rank. In decode a token's k experts are the true set (m = min(6, k) = k), so Table-5 there is
    close to recall@(k+2)."""
    if phase == "decode":
        return np.ones(n, np.int32)
    _, t, _ = step_layout(traces)
    steps = np.full(n // t, t, np.int32)
    return np.concatenate([steps, [n - int(steps.sum())]]).astype(np.int32) if n % t else steps


# ---- evaluation --------------------------------------------------------------------------------------------
def predict_chunked(pset, phase: str, layer: int, a, w, e, chunk: int = 4096) -> np.ndarray:
    return np.concatenate([pset.predict(phase, layer, a[s:s + chunk], w[s:s + chunk], e[s:s + chunk])
                           for s in range(0, len(a), chunk)])


def evaluate_set(pset, gates: Gates, train: Traces, traces: Traces) -> dict:
    """{phase: {"layers": {layer: {method: {recall_at_k, table5}}}, "groups": {group: {method: ...}}, "all": ...}}.

    Methods, scoring layer l+1's experts from source layer l:
      phaseper   the checkpoint's predictor f_l(a_l, w_l, e_l) (a prefill step sums its probabilities);
      fate_topk  Fate: layer l+1's router applied to layer l's MoE input a_l; each token counts for the k experts
                 it picks (`topk_counts`); per token its recall@k is fate_probsum's;
      fate_probsum  the same gate's probabilities, scoring_func(a_l @ W_gate,l+1), summed over a step;
      frequency  each l+1 expert's activation frequency in the train traces of the same phase (same for all
                 tokens);
      prev_token decode only: the routing weights the same sequence's previous token gave the experts at layer
                 l+1 (for the first decode step, the last prompt token's prefill routing); the frequency adds a
                 1e-6-scaled tie-break among the other experts.
    A group's figure is the mean over its layers (every layer has the same tokens)."""
    out = {}
    for phase in PHASES:
        per_layer = {}
        for layer in pset.source_layers:
            nxt = pset.next_layer(layer)
            pairs = traces.pairs(phase, layer)
            n = len(pairs)
            freq = train_frequencies(train, phase, nxt)
            gate = gates.probs(nxt, pairs.a)
            scores = {
                "phaseper": predict_chunked(pset, phase, layer, pairs.a, pairs.w, pairs.e),
                "fate_topk": topk_counts(gates.picks(nxt, pairs.a), gate),
                "fate_probsum": gate,
                "frequency": np.tile(freq.astype(np.float32), (n, 1)),
            }
            if phase == "decode":
                scores["prev_token"] = prev_token_scores(traces, nxt, n, freq)
            steps = request_steps(traces, phase, n)
            per_layer[layer] = {
                "group": pset.group(layer), "next_layer": nxt, "tokens": n,
                **{m: {"recall_at_k": recall_at_k(s, pairs.e_next, traces.k),
                       "table5": table5_accuracy(s, pairs.e_next, steps, traces.num_experts)}
                   for m, s in scores.items()},
            }
        groups = {}
        for g in GROUP_NAMES:  # a group whose only layer is the last MoE layer has no predictor: left out
            members = [v for v in per_layer.values() if v["group"] == g]
            if not members:
                continue
            groups[g] = {m: {metric: float(np.mean([v[m][metric] for v in members])) for metric in METRICS}
                         for m in METHODS if m in members[0]}
            groups[g]["layers"] = [l for l, v in per_layer.items() if v["group"] == g]
        overall = {m: {metric: float(np.mean([v[m][metric] for v in per_layer.values()])) for metric in METRICS}
                   for m in METHODS if m in next(iter(per_layer.values()))}
        out[phase] = {"layers": per_layer, "groups": groups, "all": overall}
    return out


def latency_by_device(pset, t_prompt: int, reps: int) -> dict:
    """`latency` with the predictors' parameters on the CPU backend and, where there is one, on the accelerator
    (host numpy in and out either way), by device name. Leaves the parameters on the last device measured."""
    devices = [jax.devices("cpu")[0]] + [d for d in jax.devices() if d.platform != "cpu"][:1]
    out = {}
    for device in devices:
        pset.to_device(device)
        out[f"{device.platform}:{device.id}"] = {"device_kind": getattr(device, "device_kind", None),
                                                 **latency(pset, t_prompt, reps)}
    return out


def latency(pset, t_prompt: int, reps: int) -> dict:
    """Latency of `predict` per network kind for 1 token and one prompt of `t_prompt` tokens (ms), on the device
    that holds the predictors' parameters."""
    rng = np.random.default_rng(0)
    hp = pset.hp
    out = {}
    for kind in ("shallow", "deep"):
        layer = next(l for l in pset.source_layers if pset.kind(l) == kind)
        for n in (1, t_prompt):
            a = rng.normal(size=(n, hp.dim)).astype(np.float16)
            w = rng.random((n, hp.k)).astype(np.float32)
            e = np.stack([rng.choice(hp.num_experts, hp.k, replace=False) for _ in range(n)]).astype(np.int32)
            for _ in range(5):
                pset.predict("decode", layer, a, w, e)
            times = []
            for _ in range(reps):
                t0 = time.perf_counter()
                pset.predict("decode", layer, a, w, e)
                times.append((time.perf_counter() - t0) * 1e3)
            out[f"{kind}_{n}_tokens"] = {"median_ms": float(np.median(times)),
                                         "p90_ms": float(np.percentile(times, 90))}
    return out


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def acceptance(results: dict) -> dict:
    """`TARGETS` per set and phase (all-layer mean; every group shown) and PhasePer against `BASELINES`."""
    checks = {}
    for name, res in results.items():
        for phase, (metric, target) in TARGETS["in_domain" if name == IN_DOMAIN else "out_of_domain"].items():
            value = res[phase]["all"]["phaseper"][metric]
            groups = {g: row["phaseper"][metric] for g, row in res[phase]["groups"].items()}
            checks[f"{name}_{phase}_{metric}"] = {
                "value": value, "target": f">= {target}", "pass": value >= target,
                "groups": groups, "every_group_passes": all(v >= target for v in groups.values())}
        losses = [f"{phase}/{g}/{metric}: phaseper {row['phaseper'][metric]:.4f} <= {m} {row[m][metric]:.4f}"
                  for phase in PHASES for g, row in res[phase]["groups"].items()
                  for m in BASELINES if m in row for metric in METRICS
                  if row["phaseper"][metric] <= row[m][metric]]
        checks[f"{name}_beats_baselines"] = {"pass": not losses, "failures": losses}
    return checks


def ood_drop(results: dict) -> dict:
    """Held-out minus each other set, in points: prefill Table-5 and decode recall@k of PhasePer."""
    held = results[IN_DOMAIN]
    return {name: {f"{phase}_{metric}": 100 * (held[phase]["all"]["phaseper"][metric]
                                                - res[phase]["all"]["phaseper"][metric])
                   for phase, metric in (("prefill", "table5"), ("decode", "recall_at_k"))}
            for name, res in results.items() if name != IN_DOMAIN}


def text_dedup(description: str) -> dict | None:
    """The near-duplicate lines `corpus.load_corpus` removed from the text a `collect-traces` set was cut from
    (read from its description: split, source, seed); None for the train split or another description."""
    found = re.search(r"split (heldout|ood) \(([\w-]+)\).*seed (\d+)", description)
    if not found:
        return None
    split, source, seed = found.groups()
    data = corpus.load_corpus(seed=int(seed), ood_source=source if split == "ood" else None)
    return data.dedup[split].to_json()


def table(results: dict) -> str:
    """Per set, phase and group: every method's recall@k / Table-5."""
    lines = [f"{'set':10} {'phase':8} {'group':7} " + " ".join(f"{m:>13}" for m in METHODS) + "   (recall@k/Table-5)"]
    for name, res in results.items():
        for phase in PHASES:
            for g, row in {**res[phase]["groups"], "all": res[phase]["all"]}.items():
                cells = [f"{row[m]['recall_at_k']:.3f}/{row[m]['table5']:.3f}" if m in row else "-" for m in METHODS]
                lines.append(f"{name:10} {phase:8} {g:7} " + " ".join(f"{c:>13}" for c in cells))
    return "\n".join(lines)


def plot(results: dict, path: Path) -> None:
    plt = pyplot()
    panels = [(p, m) for p in PHASES for m in ("recall_at_k", "table5")]
    fig, axes = plt.subplots(len(results), len(panels), figsize=(4 * len(panels), 3.2 * len(results)),
                             squeeze=False)
    colors = {"phaseper": "tab:blue", "fate_topk": "tab:orange", "frequency": "tab:gray", "prev_token": "tab:green"}
    for r, (name, res) in enumerate(results.items()):
        for c, (phase, metric) in enumerate(panels):
            ax = axes[r][c]
            groups = res[phase]["groups"]
            names = list(groups)
            methods = [m for m in ("phaseper", *BASELINES) if m in groups[names[0]]]
            width = 0.8 / len(methods)
            for i, m in enumerate(methods):
                vals = [groups[g][m][metric] for g in names]
                ax.bar(np.arange(len(names)) + (i - (len(methods) - 1) / 2) * width, vals, width,
                       label=m, color=colors[m])
            ax.set_xticks(np.arange(len(names)), names)
            ax.set_ylim(0, 1)
            ax.set_title(f"{name}: {phase} {metric}", fontsize=9)
            ax.grid(axis="y", alpha=0.3)
    handles, labels = axes[0][-1].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper center", ncol=len(labels), fontsize=8)
    save_figure(fig, path, dpi=100, rect=(0, 0, 1, 0.94))


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="preset / embedded name / checkpoint directory")
    p.add_argument("--predictors", type=Path, required=True, help="PhasePer checkpoint directory")
    p.add_argument("--train-traces", type=Path, required=True, help="train traces (frequency baseline only)")
    p.add_argument("--eval", action="append", required=True, metavar="NAME=DIR",
                   help=f"evaluation trace set; {IN_DOMAIN!r} is in domain, any other name out of domain")
    p.add_argument("--out-json", type=Path, required=True)
    p.add_argument("--out-png", type=Path, required=True)
    p.add_argument("--latency-reps", type=int, default=200)
    args = p.parse_args(argv)

    gates = Gates(args.model)
    cfg = gates.cfg
    pset, manifest = load_predictors(args.predictors, cfg)
    train = load_traces(args.train_traces)
    sets = dict(item.split("=", 1) for item in args.eval)
    results, descriptions, dedup = {}, {"train": train.description}, {}
    t0 = time.perf_counter()
    for name, directory in sets.items():
        traces = load_traces(directory)
        for tr in (traces, train):
            if tr.fingerprint != cfg.fingerprint():
                raise SystemExit(f"{tr.dir}: traces of fingerprint {tr.fingerprint}, model has {cfg.fingerprint()}")
        descriptions[name] = traces.description
        dedup[name] = text_dedup(traces.description)
        results[name] = evaluate_set(pset, gates, train, traces)
        t_prompt = step_layout(traces)[1]
    sizes = pset.sizes()
    report = {
        "what": "PhasePer against fair baselines, per set, phase and layer group",
        "command": command_line(__file__, argv), "commit": commit(), "machine": machine(),
        "model": cfg.name, "weights": "checkpoint" if resolve(args.model)[1] else "random",
        "fingerprint": cfg.fingerprint(),
        "predictors": {"path": str(args.predictors), "corpus": manifest["corpus"], "hparams": manifest["hparams"],
                       "groups": manifest["groups"], "moe_layers": manifest["moe_layers"],
                       "param_bytes_per_network": sizes,
                       "param_bytes_total": int(sum(sizes[pset.kind(l)] for _, l in pset.keys())),
                       "checkpoint_bytes_on_disk": dir_bytes(args.predictors)},
        "traces": descriptions,
        "text_near_duplicates_removed": dedup,
        "definitions": {
            "recall_at_k": f"per token |top-{cfg.num_experts_per_tok}(scores) & true next-layer experts| / k",
            "table5": "per request: prefill step = one prompt's tokens (predicted count = sum of scores), decode "
                      "step = one token; true top-6 by token count, hit if predicted rank within +-2 of the "
                      "tie-aware true rank",
            "groups": "mean over the group's source layers (layer l predicts l+1; group of l)",
            "fate_topk": "Fate as Fate runs: a token counts for the k experts the next router picks on this layer's "
                         "input; a step ranks experts by that count (ties by summed probability)",
            "fate_probsum": "the same gate, its softmax probabilities summed over a step (reported, not compared)",
        },
        "latency": {"what": "PredictorSet.predict, host numpy in and out, parameters on the named device",
                    "cpu_cores": os.cpu_count(), **latency_by_device(pset, t_prompt, args.latency_reps)},
        "results": results,
        "seconds": round(time.perf_counter() - t0, 2),
    }
    report["acceptance"] = acceptance(results)
    if IN_DOMAIN in results:
        report["ood_drop_points"] = ood_drop(results)
    args.out_json.parent.mkdir(parents=True, exist_ok=True)
    args.out_json.write_text(json.dumps(report, indent=1))
    plot(results, args.out_png)
    print(table(results))
    summary = {name: {phase: {m: {k: round(v, 4) for k, v in vals.items()} for m, vals in res[phase]["all"].items()}
                      for phase in PHASES} for name, res in results.items()}
    passed = {k: v["pass"] for k, v in report["acceptance"].items()}
    print(json.dumps({"summary": summary, "acceptance": passed}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
