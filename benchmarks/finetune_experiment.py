"""Online fine-tuning under a corpus switch: PhasePer predictors trained on the train split meet new text.

Contract
- Loads the model (`--model`) and two copies of a predictor checkpoint (`--predictors`, trained on the train
  split): a FROZEN copy and a copy handed to `phaseper.OnlineFineTuner` (window 16 input-group tokens,
  threshold 25%, 128 prefill / 32 decode recent tokens: the paper's settings unless flags say otherwise).
- Streams requests through the model at batch 1: first `--before` prompts of the in-domain held-out stdlib
  split, then `--after` prompts of another corpus (the switch): `--switch-to ood`, the out-of-domain text of
  `corpus.out_of_domain`, or `cjk`, `corpus.cjk_text`; each request is one prefill
  of `--prompt-len` tokens and `--decode-steps` greedy decode steps, with a jitted layer-by-layer forward
  (`phaseper.collect.walk`) that exposes every MoE layer's input, routing weights and experts. A first,
  unrecorded warm-up request compiles the forwards, the predictors' shapes and the fine-tuner's programs.
- After every forward, per source MoE layer l, both copies predict layer l+1's experts from (a_l, w_l, e_l)
  (prequential: the prediction is made before the tuner sees that forward); the fine-tuned copy's
  prediction and the true experts go to `observe()`. Errors are 1 - recall@k per token.
- Records, per arm: the per-token error at input-group layers (what the tuner's window tracks) as a sliding
  mean over 16 tokens and per request and phase, all-layer recall@k before and after the switch; the
  tuner's trigger count, completed fine-tunes and their seconds; and the off-the-token-path evidence:
  the latency distribution of observe() (timed around each call) against the decode token step time
  (model forward), and the decode step time while a fine-tune was running versus idle.
- Run from the repository root: `PYTHONPATH=. python benchmarks/finetune_experiment.py --predictors DIR
  --out-json FILE --out-png FILE` (the model defaults to `reference-moe`).
- Writes `--out-json` (with the exact command) and `--out-png` (error over time, with and without
  fine-tuning, switch and triggers marked), and two summary JSON lines to stdout.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import tokenizers
from flax import nnx

from _shared import command_line, pyplot, save_figure
from pdscope_jax.phaseper.checkpoint import load_predictors
from pdscope_jax.phaseper.collect import walk
from pdscope_jax.phaseper.finetune import RECENT_TOKENS, OnlineFineTuner, token_errors
from pdscope_jax.phaseper.losses import targets
from pdscope_jax.phaseper.train import adamw, make_step_fns
from pdscope_jax.text import corpus


def _forward(graphdef, state, ids, positions, cache):
    out = walk(nnx.merge(graphdef, state), ids, positions, cache)
    return out.logits[:, -1], out.cache, out.a, out.weights, out.experts


_jit_forward = jax.jit(_forward, static_argnums=0, donate_argnums=4)


def prompts_of(runner, data: corpus.Corpus, split: str, count: int, length: int, seed: int) -> tuple[np.ndarray, str]:
    """[count, length] prompts from the held-out, out-of-domain or CJK part of `data` (split seed 0, as
    collected)."""
    docs = corpus.cjk_text() if split == "cjk" else {"heldout": data.heldout, "ood": data.ood}[split]
    if not docs:
        raise SystemExit(f"no {split} text on this machine (corpus.{'cjk_text' if split == 'cjk' else 'load_corpus'})")
    if runner.tokenizer is not None:
        encode = corpus.tokenizer_encoder(tokenizers.Tokenizer.from_file(str(runner.tokenizer.path)))
    else:
        vocab = runner.config.vocab_size
        encode = lambda texts: [np.frombuffer(t.encode(), np.uint8).astype(np.int32) % vocab  # noqa: E731
                                for t in texts]
    eos = runner.config.eos_token_id or 0
    stream = corpus.token_stream(encode, docs, eos)
    source = {"ood": data.ood_source, "cjk": "cjk (stdlib test/cjkencodings)", "heldout": "stdlib held-out"}[split]
    return corpus.sample_windows(stream, length, count, np.random.default_rng(seed)), source


def run(args) -> dict:
    import pdscope_jax

    runner = pdscope_jax.load(args.model, dtype="float32")
    model, cfg = runner.model, runner.config
    frozen, _ = load_predictors(args.predictors, cfg)
    tuned, manifest = load_predictors(args.predictors, cfg)
    layers = list(tuned.moe_layers)
    sources = tuned.source_layers
    tracked = [l for l in sources if tuned.group(l) in ("input",)]
    data = corpus.load_corpus(seed=0)
    before, src_before = prompts_of(runner, data, "heldout", args.before, args.prompt_len, args.seed)
    after, src_after = prompts_of(runner, data, args.switch_to, args.after, args.prompt_len, args.seed)
    requests = [("in-domain", p) for p in before] + [("ood", p) for p in after]
    graphdef, state = nnx.split(model)
    dtype = model.embed.embedding[...].dtype

    errs = {"tuned": {"prefill": [], "decode": []}, "frozen": {"prefill": [], "decode": []}}  # tracked tokens
    per_request = []
    hits = {arm: {(dom, ph): [0, 0] for dom in ("in-domain", "ood") for ph in ("prefill", "decode")}
            for arm in ("tuned", "frozen")}
    observe_ms, step_ms, step_busy, trigger_tokens = [], [], [], {"prefill": [], "decode": []}

    def score(phase, a, w, e, domain, row):
        """Predict with both arms for every source layer, feed the tuner, record errors."""
        for pos, layer in enumerate(sources):
            e_next = e[pos + 1]
            for arm, pset in (("tuned", tuned), ("frozen", frozen)):
                probs = pset.predict(phase, layer, a[pos], w[pos], e[pos])  # [N, E]
                err = token_errors(probs, e_next)  # [N]
                hits[arm][(domain, phase)][0] += float(np.sum(1 - err))
                hits[arm][(domain, phase)][1] += len(err)
                if layer in tracked:
                    errs[arm][phase].extend(err.tolist())
                    row[f"{arm}_{phase}_errors"].extend(err.tolist())
                if arm == "tuned":
                    t0 = time.perf_counter()
                    if tuner.observe(phase, layer, a[pos], w[pos], e[pos], e_next, probs):
                        trigger_tokens[phase].append(len(errs["tuned"][phase]))
                    observe_ms.append((time.perf_counter() - t0) * 1e3)

    def forward_request(prompt, steps):
        """Yield (phase, a, w, e) for one request's prefill and greedy decode steps, and time each decode step."""
        t = len(prompt)
        cache = model.init_cache(1, t + args.decode_steps, dtype)  # one cache shape: the forwards compile once
        last, cache, a, w, e = _jit_forward(graphdef, state, jnp.asarray(prompt[None]),
                                            jnp.arange(t, dtype=jnp.int32)[None], cache)
        yield "prefill", *(np.asarray(x) for x in (a, w, e))
        for s in range(steps):
            token = jnp.argmax(last, axis=-1).astype(jnp.int32)[:, None]  # [1, 1] greedy
            t0 = time.perf_counter()
            last, cache, a, w, e = _jit_forward(graphdef, state, token, jnp.full((1, 1), t + s, jnp.int32), cache)
            a, w, e = (np.asarray(x) for x in (a, w, e))  # waits for the forward
            step_ms.append((time.perf_counter() - t0) * 1e3)
            yield "decode", a, w, e

    # Warm-up (not recorded): compile the prefill and decode forwards, both arms' predictor shapes, and the
    # fine-tuner's programs (one AdamW step per network kind and recent-buffer size; results discarded), as a
    # runtime would at start-up.
    for phase, a, w, e in forward_request(before[0], 1):
        for pset in (tuned, frozen):
            for pos, layer in enumerate(sources):
                pset.predict(phase, layer, a[pos], w[pos], e[pos])
        for layer in {tuned.kind(l): l for l in sources}.values():
            train_step, logits_fn, loss_fn = make_step_fns(tuned.graphdef(layer))
            rows = RECENT_TOKENS[phase]
            idx = np.arange(rows) % len(a[0])
            y = targets(e[1][idx], tuned.hp.num_experts)
            freq, gamma, coefs = jnp.ones(tuned.hp.num_experts), jnp.float32(2.0), jnp.ones(3)
            st = tuned.state(phase, layer)
            train_step(st, adamw(args.lr).init(st), a[0][idx], w[0][idx], e[0][idx], y, freq, gamma, coefs)
            loss_fn(logits_fn(st, a[0][idx], w[0][idx], e[0][idx]), y, freq, gamma, coefs)
    step_ms.clear()

    t_start = time.perf_counter()
    with OnlineFineTuner(tuned, window=args.window, threshold=args.threshold, steps=args.steps,
                         learning_rate=args.lr) as tuner:
        for i, (domain, prompt) in enumerate(requests):
            row = {"request": i, "domain": domain, **{f"{arm}_{ph}_errors": [] for arm in ("tuned", "frozen")
                                                        for ph in ("prefill", "decode")}}
            for phase, a, w, e in forward_request(prompt, args.decode_steps):
                if phase == "decode":
                    step_busy.append(tuner.busy)  # whether a fine-tune ran as this step finished
                score(phase, a, w, e, domain, row)
            per_request.append({"request": i, "domain": domain,
                                **{key[:-len("_errors")]: float(np.mean(v)) for key, v in row.items()
                                   if key.endswith("_errors") and v}})
        tuner.wait_idle()
        counters = tuner.counters()
    seconds = time.perf_counter() - t_start

    def sliding(x, n):
        x = np.asarray(x, np.float64)
        return (np.convolve(x, np.ones(n) / n, mode="valid") if len(x) >= n else x).tolist()

    tokens_before = {ph: args.before * len(tracked) * (args.prompt_len if ph == "prefill" else args.decode_steps)
                     for ph in ("prefill", "decode")}
    step_arr, busy_arr, obs_arr = np.asarray(step_ms), np.asarray(step_busy), np.asarray(observe_ms)

    def stats(x):
        return {"n": int(len(x)), "median_ms": float(np.median(x)), "p90_ms": float(np.percentile(x, 90)),
                "p99_ms": float(np.percentile(x, 99)), "max_ms": float(np.max(x))} if len(x) else {"n": 0}

    recall = {arm: {f"{dom}/{ph}": (h[0] / h[1] if h[1] else None) for (dom, ph), h in hs.items()}
              for arm, hs in hits.items()}
    return {
        "model": cfg.name, "predictors": str(args.predictors), "predictors_corpus": manifest["corpus"],
        "setup": {"before": f"{args.before} prompts, {src_before}", "after": f"{args.after} prompts, OOD: {src_after}",
                  "prompt_len": args.prompt_len, "decode_steps": args.decode_steps, "batch": 1,
                  "window": args.window, "threshold": args.threshold, "steps_per_finetune": args.steps,
                  "lr": args.lr, "tracked_layers": tracked, "moe_layers": layers,
                  "recent_tokens": tuner.recent_tokens},
        "switch_to": args.switch_to,
        "tracked_tokens_before_switch": tokens_before,
        "recall_at_k_all_layers": recall,
        "tracked_error_mean": {arm: {ph: {"before": (float(np.mean(e_[:tokens_before[ph]])) if tokens_before[ph]
                                                     else None),
                                          "after": float(np.mean(e_[tokens_before[ph]:]))}
                                     for ph, e_ in es.items()} for arm, es in errs.items()},
        "window_error": {arm: {ph: sliding(e_, args.window)[::args.window] for ph, e_ in es.items()}
                         for arm, es in errs.items()},
        "window_error_stride": args.window,
        "per_request": per_request,
        "finetune": {"triggers": counters.triggers, "finetunes": counters.finetunes,
                     "finetune_seconds": counters.finetune_seconds,
                     "seconds_per_finetune": counters.finetune_seconds / max(1, counters.finetunes),
                     "trigger_positions_tracked_tokens": trigger_tokens},
        "token_path": {"observe": stats(obs_arr), "observe_counter_mean_ms": counters.observe_seconds_mean * 1e3,
                       "observe_counter_max_ms": counters.observe_seconds_max * 1e3,
                       "decode_step": stats(step_arr),
                       "decode_step_while_finetuning": stats(step_arr[busy_arr]),
                       "decode_step_while_idle": stats(step_arr[~busy_arr]),
                       "note": "decode step = one jitted model forward (all layers) at batch 1 on this CPU; "
                               "observe() is called once per source layer per forward"},
        "seconds": seconds,
    }


def plot(report: dict, path: Path) -> None:
    plt = pyplot()
    stride = report["window_error_stride"]
    fig, axes = plt.subplots(1, 2, figsize=(12, 3.6))
    for ax, phase in zip(axes, ("prefill", "decode")):
        for arm, color in (("frozen", "tab:gray"), ("tuned", "tab:blue")):
            y = report["window_error"][arm][phase]
            ax.plot(np.arange(len(y)) * stride, y, color=color, lw=0.8,
                    label="without fine-tuning" if arm == "frozen" else "with online fine-tuning")
        switch = report["tracked_tokens_before_switch"][phase]
        ax.axvline(switch, color="red", ls="--", label=f"corpus switch (stdlib -> {report['switch_to']})")
        for pos in report["finetune"]["trigger_positions_tracked_tokens"][phase]:
            ax.axvline(pos, color="tab:green", alpha=0.15, lw=0.6)
        ax.axhline(report["setup"]["threshold"], color="black", ls=":", lw=0.8, label="threshold")
        ax.set_title(f"{phase}: sliding error over {stride} input-group tokens (green: triggers)", fontsize=9)
        ax.set_xlabel("tracked (input-group) tokens")
        ax.set_ylabel("1 - recall@k")
        ax.legend(fontsize=7)
    save_figure(fig, path, dpi=100)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="reference-moe")
    p.add_argument("--predictors", type=Path, required=True)
    p.add_argument("--before", type=int, default=16, help="in-domain (held-out stdlib) prompts before the switch")
    p.add_argument("--after", type=int, default=32, help="out-of-domain prompts after the switch")
    p.add_argument("--switch-to", default="ood", choices=("ood", "cjk"),
                   help="the corpus after the switch: corpus.out_of_domain's text, or corpus.cjk_text")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--decode-steps", type=int, default=32)
    p.add_argument("--window", type=int, default=16)
    p.add_argument("--threshold", type=float, default=0.25)
    p.add_argument("--steps", type=int, default=4, help="AdamW steps per fine-tune")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out-json", type=Path, required=True)
    p.add_argument("--out-png", type=Path, required=True)
    args = p.parse_args(argv)
    report = {"command": command_line(__file__, argv), **run(args)}
    args.out_json.parent.mkdir(parents=True, exist_ok=True)
    args.out_json.write_text(json.dumps(report, indent=1))
    plot(report, args.out_png)
    print(json.dumps({k: report[k] for k in ("recall_at_k_all_layers", "tracked_error_mean", "finetune")}))
    print(json.dumps({k: v for k, v in report["token_path"].items() if k != "note"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
