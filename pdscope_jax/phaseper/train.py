"""Offline training of PhasePer predictors on routing traces, and their evaluation.

Contract
- `train_predictors(traces, groups, hparams=None, *, epochs, seed, config, loss_params, progress, phases) ->
  (PredictorSet, metrics)` trains one predictor per (phase of `phases`, source layer) with optax AdamW on the loss
  `losses.phase_loss` prescribes for that phase and group. Each (phase, layer) holds out a validation split: whole steps
  when there are >= 2 steps, else the last tokens; in decode whole sequences where every step has the same >= 2 rows
  (`split_by_sequences`); training stops early when the validation loss has not improved for `config.patience` epochs,
  and the best-validation parameters are kept. With `config.decode_from_prefill`, a decode predictor starts from its
  layer's trained prefill predictor. A phase without traces keeps its freshly initialised predictors (metrics say
  `trained: False`).
- `metrics` = {"phases": {phase: {"recall_at_k", "table5", "val_loss", "layers": {layer: {...}}}}, ...}.
- `evaluate_predictors(pset, traces)` computes the same metrics on every token of `traces`.
- `make_step_fns(graphdef)` and `adamw(lr, wd)`: the jitted AdamW step, shared with online fine-tuning (compiled once
  per network kind and batch shape, whatever the phase, group or hyper-parameters).

Metrics
- recall@k: per token, |top-k predicted experts ∩ true experts of the next layer| / k, with k the model top-k
  (traces.k); averaged over tokens.
- table5 (the paper's Table-5 accuracy): per step (one forward of a layer over its tokens), the true token count c_j of
  every next-layer expert j and the predicted count ĉ_j = sum over the step's tokens of p_j. Experts are ranked by c
  (descending, ties by expert id) and the first m = min(6, #experts with c > 0) are the true top-6. The predicted rank
  of j is its position when ranking by ĉ (descending, ties by id). Because equal counts have no order, j's true rank is
  the interval [#experts with c > c_j, #experts with c >= c_j - 1]; j is a hit if its predicted rank lies within 2
  positions of that interval. table5 = hits / counted experts, summed over all steps.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from pdscope_jax.phaseper.losses import combined_loss, expert_frequencies, loss_coefficients, targets
from pdscope_jax.phaseper.predictor import PredictorHParams, PredictorSet, forward_logits
from pdscope_jax.phaseper.traces import PHASES, LayerPairs, Traces

TABLE5_TOP = 6
TABLE5_TOLERANCE = 2


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    epochs: int = 30
    batch_size: int = 256
    learning_rate: float = 1e-3
    weight_decay: float = 1e-4
    val_fraction: float = 0.15
    patience: int = 4
    lam: float = 1.0  # lambda of L_expert + lambda * L_focal, unless loss_params gives one per layer
    gamma: float = 2.0
    min_freq: float = 1e-2
    eval_chunk: int = 1024
    decode_from_prefill: bool = True  # a decode predictor starts from its layer's trained prefill predictor


# ---- metrics ---------------------------------------------------------------------------------------------
def recall_at_k(probs: np.ndarray, e_next: np.ndarray, k: int) -> float:
    """Mean over tokens of |top-k(probs) ∩ e_next| / k; probs [N,E], e_next [N,K]."""
    if probs.shape[0] == 0:
        return float("nan")
    top = np.argpartition(-probs, k - 1, axis=1)[:, :k]  # [N, k]
    hits = (top[:, :, None] == e_next[:, None, :]).any(axis=2).sum(axis=1)  # [N]
    return float(np.mean(hits / k))


def table5_hits(probs: np.ndarray, e_next: np.ndarray, steps: np.ndarray, num_experts: int,
                top: int = TABLE5_TOP, tolerance: int = TABLE5_TOLERANCE) -> tuple[int, int]:
    """(hits, counted) of the Table-5 metric (see the module docstring) over consecutive steps."""
    hits = counted = 0
    start = 0
    for n in steps:
        sl = slice(start, start + int(n))
        start += int(n)
        true = np.bincount(e_next[sl].reshape(-1), minlength=num_experts)  # [E]
        pred = probs[sl].sum(axis=0)  # [E]
        pred_rank = np.empty(num_experts, np.int64)
        pred_rank[np.lexsort((np.arange(num_experts), -pred))] = np.arange(num_experts)
        order = np.lexsort((np.arange(num_experts), -true))
        m = min(top, int((true > 0).sum()))
        for j in order[:m]:
            lo = int((true > true[j]).sum())
            hi = int((true >= true[j]).sum()) - 1
            hits += int(lo - tolerance <= pred_rank[j] <= hi + tolerance)
            counted += 1
    return hits, counted


def table5_accuracy(probs, e_next, steps, num_experts, top=TABLE5_TOP, tolerance=TABLE5_TOLERANCE) -> float:
    hits, counted = table5_hits(probs, e_next, steps, num_experts, top, tolerance)
    return hits / counted if counted else float("nan")


# ---- jitted steps --------------------------------------------------------------------------------------
def adamw(learning_rate: float, weight_decay: float = 0.0) -> optax.GradientTransformation:
    """AdamW whose hyper-parameters live in the optimizer state, so one compiled step serves any value."""
    return optax.inject_hyperparams(optax.adamw)(learning_rate=learning_rate, weight_decay=weight_decay)


@functools.lru_cache(maxsize=None)
def make_step_fns(graphdef):
    """(train_step, logits_fn, loss_fn) jitted over (state, ...) for one network kind.

    `train_step(state, opt_state, a, w, e, y, freq, gamma, coefs) -> (state, opt_state, loss)` applies one
    AdamW update to `losses.combined_loss` with `coefs = loss_coefficients(phase, group, lambda)`;
    `opt_state` comes from `adamw(...).init(state)`; `loss_fn(z, y, freq, gamma, coefs)`. Cached and with
    every hyper-parameter traced, so all phases, groups and callers share the compiled programs.
    """
    tx = adamw(0.0)  # the update rule only; the actual hyper-parameters are read from opt_state

    def loss_of(state, a, w, e, y, freq, gamma, coefs):
        z = nnx.merge(graphdef, state)(a, w, e)  # [N, E]
        return combined_loss(z, y, freq, gamma, coefs)

    @jax.jit
    def train_step(state, opt_state, a, w, e, y, freq, gamma, coefs):
        loss, grads = jax.value_and_grad(loss_of)(state, a, w, e, y, freq, gamma, coefs)
        updates, opt_state = tx.update(grads, opt_state, state)
        return optax.apply_updates(state, updates), opt_state, loss

    def logits_fn(state, a, w, e):
        return forward_logits(graphdef, state, a, w, e)

    return train_step, logits_fn, jax.jit(combined_loss)


def chunked_logits(logits_fn, state, a, w, e, chunk: int) -> np.ndarray:
    """[N, E] logits in fixed-size chunks (the last one padded), so one compiled shape serves any N."""
    out = []
    for s in range(0, a.shape[0], chunk):
        n = min(chunk, a.shape[0] - s)
        pad = chunk - n if a.shape[0] > chunk else 0
        pa, pw, pe = (np.pad(x[s:s + n], ((0, pad), (0, 0))) for x in (a, w, e))
        out.append(np.asarray(logits_fn(state, pa, pw, pe))[:n])
    return np.concatenate(out) if out else np.zeros((0, 0), np.float32)


def _sigmoid(z: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * z))


# ---- splitting -----------------------------------------------------------------------------------------
def split_by_steps(steps: np.ndarray, val_fraction: float, rng: np.random.Generator):
    """(train_idx, val_idx, val_steps): whole steps go to validation when there are >= 2 steps."""
    starts = np.concatenate([[0], np.cumsum(steps)[:-1]]).astype(np.int64)
    total = int(np.sum(steps))
    if len(steps) >= 2:
        n_val = min(len(steps) - 1, max(1, int(round(val_fraction * len(steps)))))
        val_steps_idx = np.sort(rng.choice(len(steps), n_val, replace=False))
        is_val = np.zeros(len(steps), bool)
        is_val[val_steps_idx] = True
        tok = [np.arange(starts[i], starts[i] + steps[i]) for i in range(len(steps))]
        val_idx = np.concatenate([tok[i] for i in range(len(steps)) if is_val[i]])
        train_idx = np.concatenate([tok[i] for i in range(len(steps)) if not is_val[i]])
        return train_idx, val_idx, steps[is_val].astype(np.int32)
    n_val = max(1, int(round(val_fraction * total)))
    return np.arange(total - n_val), np.arange(total - n_val, total), np.array([n_val], np.int32)


def split_by_sequences(steps: np.ndarray, val_fraction: float, rng: np.random.Generator):
    """Decode traces: a step holds one token of each of B sequences, row i of a batch's every step continuing row
    i's sequence. Tokens of one sequence are alike (a greedy continuation repeats itself), so validation takes whole
    sequences: a random set of rows, the same in every step. Other layouts go to `split_by_steps`."""
    rows = int(steps[0]) if len(steps) else 0
    if rows < 2 or (steps != rows).any():
        return split_by_steps(steps, val_fraction, rng)
    n_val = min(rows - 1, max(1, int(round(val_fraction * rows))))
    is_val = np.zeros(rows, bool)
    is_val[rng.choice(rows, n_val, replace=False)] = True
    is_val = np.tile(is_val, len(steps))
    idx = np.arange(len(is_val))
    return idx[~is_val], idx[is_val], np.full(len(steps), n_val, np.int32)


# ---- training ------------------------------------------------------------------------------------------
def _train_one(pset: PredictorSet, phase: str, layer: int, pairs: LayerPairs, cfg: TrainConfig, epochs: int,
               lam: float, gamma: float, rng: np.random.Generator, on_epoch) -> dict:
    t0 = time.perf_counter()
    num_experts = pset.hp.num_experts
    group = pset.group(layer)
    train_step, logits_fn, loss_fn = make_step_fns(pset.graphdef(layer))
    tx = adamw(cfg.learning_rate, cfg.weight_decay)

    split = split_by_sequences if phase == "decode" else split_by_steps
    train_idx, val_idx, val_steps = split(pairs.steps, cfg.val_fraction, rng)
    y_all = targets(pairs.e_next, num_experts)  # [N, E]
    freq = jnp.asarray(expert_frequencies(pairs.e_next[train_idx], num_experts, cfg.min_freq))  # [E]
    gamma_j, coefs = jnp.float32(gamma), jnp.asarray(loss_coefficients(phase, group, lam))
    val = tuple(x[val_idx] for x in (pairs.a, pairs.w, pairs.e))
    y_val = y_all[val_idx]

    def val_loss(state) -> float:
        z = chunked_logits(logits_fn, state, *val, cfg.eval_chunk)
        return float(loss_fn(z, y_val, freq, gamma_j, coefs))

    state = pset.state(phase, layer)
    opt_state = tx.init(state)
    best_loss, best_state, best_epoch, stale = val_loss(state), state, 0, 0
    batch = min(cfg.batch_size, len(train_idx))
    epoch = 0
    for epoch in range(1, epochs + 1):
        perm = rng.permutation(train_idx)
        for s in range(0, len(perm) - batch + 1, batch):
            idx = np.sort(perm[s:s + batch])
            state, opt_state, _ = train_step(state, opt_state, pairs.a[idx], pairs.w[idx], pairs.e[idx],
                                             y_all[idx], freq, gamma_j, coefs)
        loss = val_loss(state)
        on_epoch(epoch, loss)
        if loss < best_loss - 1e-6:
            best_loss, best_state, best_epoch, stale = loss, state, epoch, 0
        else:
            stale += 1
            if stale >= cfg.patience:
                break
    pset.set_state(phase, layer, best_state)
    probs = _sigmoid(chunked_logits(logits_fn, best_state, *val, cfg.eval_chunk))
    e_val = pairs.e_next[val_idx]
    hits, counted = table5_hits(probs, e_val, val_steps, num_experts)
    return {
        "trained": True,
        "group": group,
        "val_loss": best_loss,
        "recall_at_k": recall_at_k(probs, e_val, pairs.e.shape[1]),
        "table5": hits / counted if counted else float("nan"),
        "table5_counted": counted,
        "best_epoch": best_epoch,
        "epochs_run": epoch,
        "n_train": int(len(train_idx)),
        "n_val": int(len(val_idx)),
        "seconds": time.perf_counter() - t0,
    }


def _summarise(per_layer: dict[int, dict]) -> dict:
    trained = [m for m in per_layer.values() if m.get("trained")]
    summary = {"layers": per_layer}
    for name in ("recall_at_k", "table5", "val_loss"):
        vals = [m[name] for m in trained if np.isfinite(m[name])]
        summary[name] = float(np.mean(vals)) if vals else float("nan")
    return summary


def train_predictors(
    traces: Traces,
    groups: tuple[int, int],
    hparams: PredictorHParams | None = None,
    *,
    epochs: int | None = None,
    seed: int = 0,
    config: TrainConfig | None = None,
    loss_params: Mapping[int, tuple[float, float]] | None = None,
    progress: bool = True,
    phases: Sequence[str] = PHASES,
) -> tuple[PredictorSet, dict]:
    """Train every predictor of `phases` (the others stay as initialised); `loss_params` maps a layer to its
    (lambda, gamma), else config's values."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    cfg = config or TrainConfig()
    epochs = cfg.epochs if epochs is None else epochs
    hp = hparams or PredictorHParams(traces.dim, traces.k, traces.num_experts)
    pset = PredictorSet(hp, traces.layers, groups, seed=seed)
    rng = np.random.default_rng(seed)
    metrics = {"groups": {"input_end": groups[0], "middle_end": groups[1]}, "phases": {}}
    jobs = [(p, l) for p in PHASES if p in phases for l in pset.source_layers]
    t0 = time.perf_counter()
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TimeElapsedColumn(), disable=not progress) as bar:
        overall = bar.add_task("predictors", total=len(jobs))
        per_phase: dict[str, dict[int, dict]] = {p: {} for p in PHASES}
        for phase, layer in jobs:
            pairs = traces.pairs(phase, layer)
            if len(pairs) < 2:
                per_phase[phase][layer] = {"trained": False, "group": pset.group(layer), "n_train": len(pairs)}
                bar.advance(overall)
                continue
            lam, gamma = (loss_params or {}).get(layer, (cfg.lam, cfg.gamma))
            if phase == "decode" and cfg.decode_from_prefill and per_phase["prefill"].get(layer, {}).get("trained"):
                pset.set_state(phase, layer, pset.state("prefill", layer))  # the same next-layer function, more tokens

            def on_epoch(epoch, loss, phase=phase, layer=layer):
                bar.update(overall, description=f"{phase} layer {layer} epoch {epoch} val {loss:.4f}")

            per_phase[phase][layer] = _train_one(pset, phase, layer, pairs, cfg, epochs, lam, gamma, rng,
                                                 on_epoch)
            bar.advance(overall)
    metrics["phases"] = {p: _summarise(per_phase[p]) for p in PHASES}
    metrics["seconds"] = time.perf_counter() - t0
    metrics["config"] = dataclasses.asdict(cfg) | {"epochs": epochs, "seed": seed}
    return pset, metrics


def evaluate_predictors(pset: PredictorSet, traces: Traces, chunk: int = 1024) -> dict:
    """recall@k and Table-5 accuracy of `pset` on every token of `traces` (e.g. an out-of-domain corpus)."""
    out = {}
    for phase in PHASES:
        per_layer = {}
        for layer in pset.source_layers:
            pairs = traces.pairs(phase, layer)
            if len(pairs) == 0:
                per_layer[layer] = {"trained": False, "group": pset.group(layer)}
                continue
            state = pset.state(phase, layer)
            graphdef = pset.graphdef(layer)

            def logits_fn(st, a, w, e, graphdef=graphdef):
                return forward_logits(graphdef, st, a, w, e)

            probs = _sigmoid(chunked_logits(logits_fn, state, pairs.a, pairs.w, pairs.e, chunk))
            per_layer[layer] = {
                "trained": True,
                "group": pset.group(layer),
                "recall_at_k": recall_at_k(probs, pairs.e_next, pairs.e.shape[1]),
                "table5": table5_accuracy(probs, pairs.e_next, pairs.steps, pset.hp.num_experts),
                "val_loss": float("nan"),
                "tokens": len(pairs),
            }
        out[phase] = _summarise(per_layer)
    return {"phases": out}

