"""Training of the reference MoE: initialisation, loss, optimizer, learning-rate schedule and the loop.

Weights are float32 masters; forward and backward run on a copy cast to the compute dtype (`cast`). The loss
is next-token cross-entropy plus `balance_coef` times the expert balance loss (`balance_loss`). AdamW
(`make_optimizer`) is applied with the learning rate of `lr_at`: linear warm-up, then cosine decay to 10%.
`fit` runs the loop until its horizon (epochs or `--steps`) or the wall-time budget, re-fixing the horizon
after timing the first steps so the schedule ends where the budget does; it returns the loss curve.
The jitted programs: `train_step` (params and optimizer state donated) and `eval_loss`, from `make_fns`.
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import dataclass
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from pdscope_jax import models
from pdscope_jax.config import ModelConfig
from pdscope_jax.models.layers import router_logits
from pdscope_jax.phaseper.collect import walk
from pdscope_jax.text import corpus


def param_count(state) -> int:
    return int(sum(np.prod(x.shape) for x in jax.tree.leaves(state)))


def init_params(cfg: ModelConfig, seed: int):
    """(graphdef, float32 state) of the family's own initialisation, run as one compiled program."""
    graphdef, _ = nnx.split(models.abstract_model(cfg, jnp.float32))
    state = jax.jit(lambda: nnx.state(models.build(cfg, nnx.Rngs(seed), jnp.float32)))()
    return graphdef, state


def balance_loss(model, walked, num_experts: int) -> jax.Array:
    """Mean over MoE layers of E * sum_i f_i * P_i (1 when routing is uniform).

    f_i: fraction of the N*K top-k assignments that went to expert i (no gradient); P_i: mean over tokens of
    the router's softmax probability of i, recomputed from the router input `a` and the router kernel.
    """
    layers = [layer for layer in model.layers if layer.is_moe]
    m, n, k = walked.experts.shape
    total = 0.0
    for pos, layer in enumerate(layers):
        probs = jax.nn.softmax(router_logits(walked.a[pos], layer.mlp.gate.kernel[...]), axis=-1)  # [N, E]
        f = jnp.zeros((num_experts,), jnp.float32).at[walked.experts[pos].reshape(-1)].add(1.0) / (n * k)
        total = total + num_experts * jnp.sum(jax.lax.stop_gradient(f) * probs.mean(axis=0))
    return total / m


def make_fns(graphdef, cast, tx, balance_coef: float, num_experts: int):
    """Jitted train step and eval loss over (params, ...) with the graphdef closed over."""

    def losses(params, batch):
        model = nnx.merge(graphdef, cast(params))
        ids, targets = batch[:, :-1], batch[:, 1:]
        positions = jnp.broadcast_to(jnp.arange(ids.shape[1], dtype=jnp.int32), ids.shape)
        walked = walk(model, ids, positions)
        ce = optax.softmax_cross_entropy_with_integer_labels(walked.logits, targets).mean()
        return ce, balance_loss(model, walked, num_experts)

    def objective(params, batch):
        ce, bal = losses(params, batch)
        return ce + balance_coef * bal, (ce, bal)

    def train_step(params, opt_state, batch, lr):
        (_, (ce, bal)), grads = jax.value_and_grad(objective, has_aux=True)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, jax.tree.map(lambda u: -lr * u, updates))
        grad_norm = jnp.sqrt(sum(jnp.sum(jnp.square(g.astype(jnp.float32))) for g in jax.tree.leaves(grads)))
        return params, opt_state, jnp.stack([ce, bal, grad_norm])

    def eval_loss(params, batch):
        return losses(params, batch)[0]

    return jax.jit(train_step, donate_argnums=(0, 1)), jax.jit(eval_loss)


def make_optimizer(weight_decay: float) -> optax.GradientTransformation:
    """AdamW without its learning rate: the step multiplies by -lr (decoupled decay scales with lr too)."""

    def decay_mask(params):  # matrices only; norms' scales keep their value
        return jax.tree.map(lambda x: x.ndim >= 2, params)

    return optax.chain(optax.clip_by_global_norm(1.0), optax.scale_by_adam(b1=0.9, b2=0.95, eps=1e-8),
                       optax.add_decayed_weights(weight_decay, decay_mask))


def lr_at(step: int, peak: float, warmup: int, horizon: int) -> float:
    """Linear warm-up to `peak` over `warmup` steps, then cosine decay to peak / 10 at `horizon`."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, horizon - warmup))
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


@dataclass
class Fit:
    """The outcome of `fit`: trained float32 params, the loss curve (one row per eval, step 0 first), steps
    done, the final horizon, seconds per step (None when too few steps were timed) and the loop's wall time."""

    params: object
    log: list[dict]
    steps: int
    horizon: int
    step_seconds: float | None
    train_seconds: float


def fit(args: argparse.Namespace, params, opt_state, train_step, evaluate: Callable[[object], dict],
        train_stream: np.ndarray, rng: np.random.Generator) -> Fit:
    """Train `params` on windows sampled from `train_stream` with the flags of `args` (max_seconds, epochs,
    steps, batch, seq_len, lr, warmup, eval_every); `evaluate(params)` gives the eval losses of each log row.
    Consumes (donates) `params` and `opt_state`; prints one line per logged row."""
    length = args.seq_len + 1
    log, pending = [], []
    t_loop = time.perf_counter()
    deadline = t_loop + args.max_seconds
    epoch_steps = len(train_stream) / (args.batch * args.seq_len)
    horizon = max(1, min(args.steps, math.ceil(args.epochs * epoch_steps)))
    step_seconds, calibrate_at = None, min(horizon, 40)
    step, t_calib = 0, None
    log.append({"step": 0, "seconds": 0.0, "train_loss": None, **evaluate(params)})  # compiles the eval
    while step < horizon:
        if step == 3:  # the first steps compile; time from here
            jax.block_until_ready(params)
            t_calib = time.perf_counter()
        if step == calibrate_at and step > 3:
            jax.block_until_ready(params)
            step_seconds = (time.perf_counter() - t_calib) / (step - 3)
            t_eval = time.perf_counter()
            evaluate(params)
            per_step = step_seconds + (time.perf_counter() - t_eval) / args.eval_every
            horizon = min(horizon, step + int(0.97 * (deadline - time.perf_counter()) / per_step))
            print(f"step time {step_seconds * 1e3:.1f} ms; training for {horizon} steps", flush=True)
        lr = lr_at(step, args.lr, args.warmup, horizon)
        batch = corpus.sample_windows(train_stream, length, args.batch, rng)
        params, opt_state, metrics = train_step(params, opt_state, jnp.asarray(batch), jnp.float32(lr))
        pending.append(metrics)
        if len(pending) >= 2:  # at most two steps in flight, so the wall clock tracks the device
            pending[-2].block_until_ready()
        step += 1
        if step % args.eval_every == 0 or step == horizon or time.perf_counter() > deadline:
            m = np.asarray(jax.device_get(pending))  # [S, 3]: ce, balance, grad norm
            pending = []
            t_eval = time.perf_counter()
            row = {"step": step, "seconds": round(t_eval - t_loop, 2), "lr": lr,
                   "train_loss": float(m[:, 0].mean()), "balance_loss": float(m[:, 1].mean()),
                   "grad_norm": float(m[:, 2].mean()), **evaluate(params)}
            row["eval_seconds"] = round(time.perf_counter() - t_eval, 3)
            log.append(row)
            print(f"step {step:5d} {row['seconds']:7.1f}s lr {lr:.2e} train {row['train_loss']:.3f} "
                  f"balance {row['balance_loss']:.3f} " + " ".join(
                      f"{k[:-5]} {v:.3f}" for k, v in row.items() if k in ("heldout_loss", "ood_loss")), flush=True)
            if time.perf_counter() > deadline:
                break
    jax.block_until_ready(params)
    train_seconds = time.perf_counter() - t_loop
    if step_seconds is None and t_calib is not None and step > 3:  # too few steps to calibrate (--smoke)
        step_seconds = (train_seconds - (t_calib - t_loop)) / (step - 3)
    return Fit(params, log, step, horizon, step_seconds, train_seconds)
