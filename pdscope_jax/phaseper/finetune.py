"""Online fine-tuning of PhasePer predictors, off the token path.

Contract
- The runtime calls `OnlineFineTuner.observe(phase, layer, a [N,D], w [N,K], e [N,K], e_next [N,K],
  scores [N,E])` once the true experts `e_next` of the next layer are known; `scores` is the prediction it
  used (probabilities or logits: only the ranking counts). observe() only does numpy bookkeeping and
  returns at once; it never waits for training.
- Per-token error = 1 - |top-k(scores) ∩ e_next| / k. Errors of tokens seen at input-group layers feed
  one sliding window of the last `window` (16) tokens per phase. When the window is full and its mean
  error exceeds `threshold` (25%), a fine-tune of that phase is triggered and the window starts empty.
- Every observed layer keeps a ring buffer of its most recent tokens: 128 for prefill, 32 for decode.
  A fine-tune job runs on a background worker thread (a queue; at most one job per phase pending): for each
  predictor of the phase with buffered data it runs `steps` AdamW steps on those tokens (tiled up to the
  buffer size so that one compiled shape serves every call) with the loss of its phase and group, then
  swaps the new parameters in with `PredictorSet.set_state` (a single assignment: readers see the old or
  the new parameters, never a mix).
- Counters (`counters()`): tracked (input-group) tokens, triggers, fine-tunes completed, fine-tune seconds, observe()
  calls and latency (mean, max). Worker errors are re-raised by `wait_idle()` and `close()`.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
from collections import deque

import jax.numpy as jnp
import numpy as np

from pdscope_jax.phaseper.losses import expert_frequencies, loss_coefficients, targets
from pdscope_jax.phaseper.predictor import PredictorSet
from pdscope_jax.phaseper.train import adamw, make_step_fns

RECENT_TOKENS = {"prefill": 128, "decode": 32}


def token_errors(scores: np.ndarray, e_next: np.ndarray) -> np.ndarray:
    """[N] per-token miss rate of the top-k of scores [N,E] against the true experts e_next [N,K]."""
    k = e_next.shape[1]
    top = np.argpartition(-scores, k - 1, axis=1)[:, :k]  # [N, K]
    hits = (top[:, :, None] == e_next[:, None, :]).any(axis=2).sum(axis=1)  # [N]
    return 1.0 - hits / k


class ErrorWindow:
    """Sliding window of per-token errors; `push` reports whether the window crossed the threshold."""

    def __init__(self, size: int = 16, threshold: float = 0.25):
        self.size, self.threshold = size, threshold
        self._errors: deque[float] = deque(maxlen=size)
        self._sum = 0.0

    def push(self, errors) -> bool:
        """Append errors one token at a time; True if a full window's mean exceeded the threshold (then the
        window is emptied, so the next trigger needs `size` fresh tokens)."""
        triggered = False
        for err in np.asarray(errors, np.float64).reshape(-1):
            if len(self._errors) == self.size:
                self._sum -= self._errors[0]
            self._errors.append(float(err))
            self._sum += float(err)
            if len(self._errors) == self.size and self._sum / self.size > self.threshold:
                triggered = True
                self._errors.clear()
                self._sum = 0.0
        return triggered

    def mean(self) -> float:
        return self._sum / len(self._errors) if self._errors else 0.0


class _Recent:
    """Ring buffer of the last `capacity` tokens of one (phase, layer)."""

    def __init__(self, capacity: int, dim: int, k: int):
        self.a = np.zeros((capacity, dim), np.float16)
        self.w = np.zeros((capacity, k), np.float32)
        self.e = np.zeros((capacity, k), np.int32)
        self.e_next = np.zeros((capacity, k), np.int32)
        self.pos = self.fill = 0

    def add(self, a, w, e, e_next) -> None:
        cap = self.a.shape[0]
        n = a.shape[0]
        if n >= cap:
            a, w, e, e_next = a[-cap:], w[-cap:], e[-cap:], e_next[-cap:]
            n = cap
        idx = (self.pos + np.arange(n)) % cap
        self.a[idx], self.w[idx], self.e[idx], self.e_next[idx] = a, w, e, e_next
        self.pos = (self.pos + n) % cap
        self.fill = min(cap, self.fill + n)

    def tiled(self):
        """(a, w, e, e_next) with exactly `capacity` rows: the buffered tokens repeated to fill it."""
        idx = np.arange(self.a.shape[0]) % self.fill
        return self.a[idx], self.w[idx], self.e[idx], self.e_next[idx]


@dataclasses.dataclass
class FineTuneCounters:
    tracked_tokens: int = 0  # tokens observed at tracked (input-group) layers
    triggers: int = 0
    finetunes: int = 0
    finetune_seconds: float = 0.0
    observe_calls: int = 0
    observe_seconds_total: float = 0.0
    observe_seconds_max: float = 0.0

    @property
    def observe_seconds_mean(self) -> float:
        return self.observe_seconds_total / self.observe_calls if self.observe_calls else 0.0


class OnlineFineTuner:
    """See the module docstring. Use as a context manager or call `close()` to stop the worker."""

    def __init__(self, pset: PredictorSet, *, window: int = 16, threshold: float = 0.25,
                 recent_tokens: dict[str, int] | None = None, steps: int = 4, learning_rate: float = 1e-4,
                 lam: float = 1.0, gamma: float = 2.0, min_freq: float = 1e-2,
                 track_groups: tuple[str, ...] = ("input",)):
        self.pset = pset
        self.recent_tokens = dict(RECENT_TOKENS if recent_tokens is None else recent_tokens)
        self.steps, self.lam, self.gamma, self.min_freq = steps, lam, gamma, min_freq
        self.track_groups = track_groups
        self._tx = adamw(learning_rate)
        self._windows = {phase: ErrorWindow(window, threshold) for phase in self.recent_tokens}
        self._recent: dict[tuple[str, int], _Recent] = {}
        self._pending: set[str] = set()
        self._lock = threading.Lock()
        self._counters = FineTuneCounters()
        self.last_losses: dict[tuple[str, int], tuple[float, float]] = {}  # (loss before, loss after)
        self._error: BaseException | None = None
        self._jobs: queue.Queue = queue.Queue()
        self._worker = threading.Thread(target=self._run, name="phaseper-finetune", daemon=True)
        self._worker.start()

    # ---- token path ------------------------------------------------------------------------------------
    def observe(self, phase: str, layer: int, a, w, e, e_next, scores) -> bool:
        """Record one layer's step; True if it triggered a fine-tune. Never blocks on training."""
        t0 = time.perf_counter()
        a, w, e, e_next = np.asarray(a), np.asarray(w), np.asarray(e), np.asarray(e_next)
        triggered = False
        with self._lock:
            key = (phase, layer)
            if key not in self._recent:
                self._recent[key] = _Recent(self.recent_tokens[phase], a.shape[1], e.shape[1])
            self._recent[key].add(a, w, e, e_next)
            c = self._counters
            if self.pset.group(layer) in self.track_groups:
                c.tracked_tokens += a.shape[0]
                triggered = self._windows[phase].push(token_errors(np.asarray(scores), e_next))
            if triggered:
                c.triggers += 1
                if phase not in self._pending:
                    self._pending.add(phase)
                    self._jobs.put(phase)
            dt = time.perf_counter() - t0
            c.observe_calls += 1
            c.observe_seconds_total += dt
            c.observe_seconds_max = max(c.observe_seconds_max, dt)
        return triggered

    def window_error(self, phase: str) -> float:
        with self._lock:
            return self._windows[phase].mean()

    def counters(self) -> FineTuneCounters:
        with self._lock:
            return dataclasses.replace(self._counters)

    @property
    def busy(self) -> bool:
        with self._lock:
            return bool(self._pending)

    # ---- worker ----------------------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            phase = self._jobs.get()
            if phase is None:
                return
            t0 = time.perf_counter()
            done = False
            try:
                self._fine_tune(phase)
                done = True
            except BaseException as err:  # surfaced by wait_idle()/close()
                self._error = err
            with self._lock:
                self._pending.discard(phase)
                self._counters.finetunes += int(done)
                self._counters.finetune_seconds += time.perf_counter() - t0

    def _fine_tune(self, phase: str) -> None:
        with self._lock:
            layers = [l for (p, l), buf in self._recent.items()
                      if p == phase and buf.fill > 0 and l in self.pset.source_layers]
        num_experts = self.pset.hp.num_experts
        for layer in layers:
            with self._lock:  # one layer at a time, so observe() never waits for a long copy
                a, w, e, e_next = self._recent[(phase, layer)].tiled()
            group = self.pset.group(layer)
            train_step, logits_fn, loss_fn = make_step_fns(self.pset.graphdef(layer))
            y = targets(e_next, num_experts)  # [C, E]
            freq = jnp.asarray(expert_frequencies(e_next, num_experts, self.min_freq))
            gamma, coefs = jnp.float32(self.gamma), jnp.asarray(loss_coefficients(phase, group, self.lam))
            state = self.pset.state(phase, layer)
            opt_state = self._tx.init(state)
            before = float(loss_fn(logits_fn(state, a, w, e), y, freq, gamma, coefs))
            for _ in range(self.steps):
                state, opt_state, _ = train_step(state, opt_state, a, w, e, y, freq, gamma, coefs)
            after = float(loss_fn(logits_fn(state, a, w, e), y, freq, gamma, coefs))
            self.pset.set_state(phase, layer, state)
            self.last_losses[(phase, layer)] = (before, after)

    # ---- lifecycle -------------------------------------------------------------------------------------
    def wait_idle(self, timeout: float | None = None) -> None:
        """Block until every queued fine-tune has finished (for tests and shutdown, not the token path)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.busy:
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError("fine-tuning still running")
            time.sleep(0.005)
        self._raise_error()

    def _raise_error(self) -> None:
        if self._error is not None:
            err, self._error = self._error, None
            raise RuntimeError("online fine-tuning failed") from err

    def close(self) -> None:
        if self._worker.is_alive():
            self._jobs.put(None)
            self._worker.join()
        self._raise_error()

    def __enter__(self) -> "OnlineFineTuner":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
