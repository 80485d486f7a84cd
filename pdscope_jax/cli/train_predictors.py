"""`pdscope-jax train-predictors`: PhasePer's offline step 2, from a trace directory to a saved checkpoint.

Contract
- `train_predictors_main(argv) -> 0` reads a trace directory written by `pdscope-jax collect-traces` (`--traces`) for
  the model `--model` (preset name, embedded name or checkpoint directory: only its config is read, never its weights)
  and refuses traces whose fingerprint is not the model's.
- Layer groups come from the traces, never from a flag: the inter-layer similarity profile of the prefill MoE inputs
  (`layer_stats.json` of the collection, over every collected token, when present; otherwise
  `phaseper.groups.layer_similarity` over the first traced tokens) goes through `phaseper.groups.detect_groups`. The
  profile and the per-layer routing-weight spread are drawn with `plot_groups` into `--groups-png` (default:
  `layer_groups.png` inside the saved checkpoint directory).
- It trains one predictor per (phase, source MoE layer) with `phaseper.train.train_predictors` (the paper's losses per
  phase and group, a validation split of whole steps, early stopping on the validation loss, best parameters kept, a
  rich progress bar) and saves them with `phaseper.checkpoint.save_predictors` under `<--out>/<model name>/`; the
  manifest holds the fingerprint, the traces' corpus description and metrics = the training metrics + the layer-group
  evidence (similarity, weight spread, boundaries, where the similarity came from) + the trace directory, the parameter
  bytes and the exact command line.
- `--smoke` runs the whole path end to end in seconds, for CI: a tiny random-weight model (`tiny-deepseek-v2-lite`
  unless `--model` names another), random-token prompts collected into `<--out>/smoke-traces` with
  `phaseper.collect.collect_traces`, a short training, the save, and a reload with `load_predictors` whose predictions
  must equal the trained set's (else it raises).
- `check_args(args)` checks every option before anything is collected or trained (--model and --traces given unless
  --smoke, model known, traces readable and of that model, numbers in range, outputs writable) and raises one
  `errors.InputError` naming every problem.
- It prints one JSON line: checkpoint path, groups, per-phase recall@k and Table-5 on the validation split, seconds.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

import numpy as np

from pdscope_jax.phaseper.checkpoint import load_predictors, save_predictors
from pdscope_jax.phaseper.collect import STATS_FILE, read_stats
from pdscope_jax.phaseper.groups import detect_groups, groups_from_traces, plot_groups
from pdscope_jax.phaseper.predictor import PredictorHParams
from pdscope_jax.phaseper.traces import PHASES, TraceError, load_traces
from pdscope_jax.phaseper.train import TrainConfig, train_predictors

SMOKE_MODEL = "tiny-deepseek-v2-lite"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdscope-jax train-predictors",
                                description="Train PhasePer predictors (one per MoE layer and phase) from traces.")
    p.add_argument("--traces", type=Path, help="trace directory from `pdscope-jax collect-traces`")
    p.add_argument("--model", help="preset name, embedded name or checkpoint directory the traces came from "
                                   f"(default with --smoke: {SMOKE_MODEL})")
    p.add_argument("--out", type=Path, default=Path("predictors"),
                   help="root directory; the checkpoint goes to <out>/<model name>/")
    p.add_argument("--groups-png", type=Path, help="similarity / weight-spread plot (default: in the checkpoint)")
    p.add_argument("--epochs", type=int, default=TrainConfig.epochs)
    p.add_argument("--batch-size", type=int, default=TrainConfig.batch_size)
    p.add_argument("--lr", type=float, default=TrainConfig.learning_rate)
    p.add_argument("--weight-decay", type=float, default=TrainConfig.weight_decay)
    p.add_argument("--patience", type=int, default=TrainConfig.patience)
    p.add_argument("--val-fraction", type=float, default=TrainConfig.val_fraction)
    p.add_argument("--lam", type=float, default=TrainConfig.lam, help="lambda of L_expert + lambda * L_focal")
    p.add_argument("--gamma", type=float, default=TrainConfig.gamma, help="focal-loss exponent")
    p.add_argument("--proj-dim", type=int, default=PredictorHParams.proj_dim)
    p.add_argument("--hidden", type=int, default=PredictorHParams.hidden)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", action="store_true", help="no rich progress bar")
    p.add_argument("--smoke", action="store_true", help="tiny random model, collect, train, save, reload (CI)")
    return p


def _smoke_traces(model_name: str, out: Path, seed: int) -> Path:
    """Collect a handful of random-token prompts through a tiny random-weight model into <out>/smoke-traces."""
    import pdscope_jax
    from pdscope_jax.phaseper.collect import collect_traces, moe_layers, write_stats
    from pdscope_jax.phaseper.traces import TraceWriter

    runner = pdscope_jax.load(model_name, weights="random", seed=seed, dtype="float32")
    model, cfg = runner.model, runner.config
    prompts = np.random.default_rng(seed).integers(0, cfg.vocab_size, (8, 16)).astype(np.int32)  # [P, T]
    directory = out / "smoke-traces"
    if directory.exists():
        import shutil

        shutil.rmtree(directory)
    with TraceWriter(directory, cfg.fingerprint(), moe_layers(model), cfg.hidden_size, cfg.num_experts_per_tok,
                     cfg.num_experts, flush_tokens=64,
                     description=f"{model_name} (random weights, float32), 8 random-token prompts x 16 tokens, "
                                 "4 greedy decode steps, batch 4 (smoke)") as writer:
        stats = collect_traces(model, prompts, writer, decode_steps=4, batch_size=4)
    write_stats(stats, directory)
    return directory


def _similarity(traces) -> tuple[np.ndarray, np.ndarray, str]:
    """(similarity [M], routing-weight spread [M], where the similarity came from)."""
    _, similarity, spread = groups_from_traces(traces, "prefill")
    if (traces.dir / STATS_FILE).exists():
        stats = read_stats(traces.dir)
        prefill = stats["phases"]["prefill"]
        if prefill["tokens"] > 0 and len(prefill["similarity"]) == len(traces.layers):
            return np.asarray(prefill["similarity"], np.float32), spread, \
                f"layer_stats.json (prefill, {prefill['tokens']} tokens)"
    return similarity, spread, "traced prefill MoE inputs (first 4096 tokens per layer)"


def check_args(args) -> None:
    """Every problem of the options at once (one InputError); reads the model's config and the traces' manifest."""
    from pdscope_jax.cli import checks
    from pdscope_jax.errors import raise_problems

    problems: list[str] = []
    model_name = args.model or (SMOKE_MODEL if args.smoke else None)
    resolved = None
    if model_name is None:
        problems.append("--model is required (the model the traces were collected from)")
    else:
        resolved = checks.check_model(problems, "--model", model_name)
    if not args.smoke and args.traces is None:
        problems.append("--traces is required (a folder from `pdscope-jax collect-traces`), or pass --smoke")
    elif not args.smoke and checks.check_dir(problems, "--traces", args.traces, "manifest.json",
                                             "pdscope-jax collect-traces --out DIR"):
        try:
            traces = load_traces(args.traces)
            if resolved is not None and traces.fingerprint != resolved[0].fingerprint():
                problems.append(f"--traces {args.traces} were collected from model fingerprint {traces.fingerprint}, "
                                f"but {model_name} has fingerprint {resolved[0].fingerprint()}: pass the model they "
                                "came from, or collect traces of this one")
        except TraceError as err:
            problems.append(f"--traces: {err}")
    for flag, value in (("--epochs", args.epochs), ("--batch-size", args.batch_size), ("--patience", args.patience),
                        ("--proj-dim", args.proj_dim), ("--hidden", args.hidden)):
        checks.check_int(problems, flag, value)
    checks.check_number(problems, "--lr", args.lr, 0, low_open=True)
    checks.check_number(problems, "--val-fraction", args.val_fraction, 0, 1, low_open=True, high_open=True)
    for flag, value in (("--weight-decay", args.weight_decay), ("--lam", args.lam), ("--gamma", args.gamma)):
        checks.check_number(problems, flag, value, 0)
    checks.check_seed(problems, "--seed", args.seed)
    checks.check_writable_dir(problems, "--out", args.out)
    if args.groups_png is not None:
        checks.check_writable_file(problems, "--groups-png", args.groups_png)
    raise_problems(problems, "bad arguments")


def train_predictors_main(argv: list[str] | None = None) -> int:
    from pdscope_jax.api import resolve

    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(argv)
    check_args(args)
    t0 = time.perf_counter()
    model_name = args.model or SMOKE_MODEL
    cfg, _ = resolve(model_name)
    if args.smoke:
        trace_dir = _smoke_traces(model_name, args.out, args.seed)
        args.epochs, args.batch_size = min(args.epochs, 3), min(args.batch_size, 32)
        args.proj_dim, args.hidden = min(args.proj_dim, 16), min(args.hidden, 32)
    else:
        trace_dir = args.traces
    traces = load_traces(trace_dir)

    similarity, spread, similarity_source = _similarity(traces)
    groups = detect_groups(similarity)
    config = TrainConfig(epochs=args.epochs, batch_size=args.batch_size, learning_rate=args.lr,
                         weight_decay=args.weight_decay, val_fraction=args.val_fraction, patience=args.patience,
                         lam=args.lam, gamma=args.gamma)
    hp = PredictorHParams(traces.dim, traces.k, traces.num_experts, proj_dim=args.proj_dim, hidden=args.hidden)
    pset, metrics = train_predictors(traces, groups, hp, seed=args.seed, config=config,
                                     progress=not args.no_progress)
    command = "pdscope-jax train-predictors " + shlex.join(argv)
    metrics["layer_groups"] = {
        "input_end": groups[0], "middle_end": groups[1],
        "similarity": [float(v) for v in similarity], "weight_spread": [float(v) for v in spread],
        "similarity_source": similarity_source,
    }
    metrics["traces"] = {"dir": str(trace_dir), "description": traces.description,
                         "tokens": {p: traces.tokens(p, traces.layers[0]) for p in PHASES}}
    metrics["command"] = command
    target = save_predictors(pset, cfg, args.out, corpus=traces.description, metrics=metrics)
    png = plot_groups(similarity, spread, groups, args.groups_png or target / "layer_groups.png")

    if args.smoke:
        restored, _ = load_predictors(target, cfg)
        pairs = traces.pairs("decode", pset.source_layers[0])
        for phase, layer in pset.keys():
            same = np.allclose(pset.predict(phase, layer, pairs.a, pairs.w, pairs.e),
                               restored.predict(phase, layer, pairs.a, pairs.w, pairs.e), atol=1e-6)
            if not same:
                raise RuntimeError(f"reloaded predictor ({phase}, layer {layer}) differs from the trained one")

    summary = {
        "checkpoint": str(target), "groups_png": str(png), "groups": list(groups),
        "similarity_source": similarity_source,
        "param_bytes": pset.sizes(),
        "validation": {p: {"recall_at_k": metrics["phases"][p]["recall_at_k"], "table5": metrics["phases"][p]["table5"]}
                       for p in PHASES},
        "seconds": round(time.perf_counter() - t0, 2),
    }
    print(json.dumps(summary))
    return 0
