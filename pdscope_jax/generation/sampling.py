"""The one sampler: every sampling setting is a traced array, so changing a setting compiles nothing.

Contract:
- `SamplingParams` (frozen): temperature (0: greedy), top_k (None/0: off), top_p, min_p, presence_penalty,
  frequency_penalty, repetition_penalty, seed. `problems(vocab_size)` lists what is wrong (empty when nothing).
- `SamplingState` (a pytree of arrays, one row per sequence): the settings as [B] arrays, the per-row seeds,
  `counts` [B, V] int32 (tokens generated so far) and `seen` [B, V] bool (tokens of the prompt).
  `SamplingState.create(params | [params per row], prompt_ids [B, T], vocab_size, device)` builds it.
- `sample(logits [B, V], state, step, branch=False) -> (Sampled, state')`: the pure function the programs call
  inside their own jit; `sample_jit` is it jitted alone. `branch=True` skips the drawing (its sort over the
  vocabulary) when every row is greedy, by a conditional: for programs whose conditionals run on the device
  (command buffers), not for those where XLA's runtime would read the predicate back to the host. Order:
  repetition penalty on seen or generated tokens (positive logits divided, negative multiplied, as transformers
  does), presence and frequency penalties on generated tokens (as OpenAI does), then rows with temperature 0 take
  the argmax; the others divide by the temperature, keep the top_k most likely, the smallest set whose probability
  reaches top_p, the tokens whose probability is at least min_p times the largest, and draw with key
  fold_in(key(seed_row), step). So a row's tokens depend on its own settings, seed and step only, not on the batch
  it runs in. state' counts the picked token.
- `Sampled`: token [B] int32; logprob [B] and the TOP_LOGPROBS most likely (top_ids, top_logprobs [B, N]) of
  the model's own distribution, log_softmax of the raw logits (before penalties and temperature).
With defaults (greedy, no penalty) the token is argmax(logits), bit for bit what the old static sampler gave.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

TOP_LOGPROBS = 20  # alternatives reported per step (OpenAI's maximum); computed always, so no shape depends on it
F32 = jnp.float32
TOP_CHUNK = 1024  # vocabulary entries per chunk of the two-stage top-k (`top_k_chunked`)


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_real(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0: greedy (argmax); above 0 divides the logits
    top_k: int | None = None  # keep the k most likely tokens; None or 0: all
    top_p: float = 1.0  # keep the smallest set whose probability reaches top_p; 1: all
    min_p: float = 0.0  # drop tokens less likely than min_p times the most likely; 0: none
    presence_penalty: float = 0.0  # OpenAI's: subtracted once from the logit of every token generated so far
    frequency_penalty: float = 0.0  # OpenAI's: subtracted from a generated token's logit once per occurrence
    repetition_penalty: float = 1.0  # transformers': seen tokens' positive logits divided by it, negative multiplied
    seed: int = 0  # a row draws with fold_in(key(seed), step)

    def problems(self, vocab_size: int) -> list[str]:
        """What is wrong with these settings, each with its valid range (empty when nothing)."""
        out = []
        t = self.temperature
        if not _is_real(t) or t < 0:
            out.append(f"temperature must be a finite number >= 0 (0: greedy), got {t!r}")
        k = self.top_k
        if k is not None and (not _is_int(k) or not 1 <= k <= vocab_size):
            out.append(f"top_k must be in [1, {vocab_size}] (the vocabulary) or None, got {k!r}")
        if not _is_real(self.top_p) or not 0 < self.top_p <= 1:
            out.append(f"top_p must be a number in (0, 1] (1: off), got {self.top_p!r}")
        if not _is_real(self.min_p) or not 0 <= self.min_p <= 1:
            out.append(f"min_p must be a number in [0, 1] (0: off), got {self.min_p!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_real(value) or not -2 <= value <= 2:
                out.append(f"{name} must be a number in [-2, 2] (0: off), got {value!r}")
        r = self.repetition_penalty
        if not _is_real(r) or r <= 0:
            out.append(f"repetition_penalty must be a finite number > 0 (1: off), got {r!r}")
        if not _is_int(self.seed) or not 0 <= self.seed < 2**32:
            out.append(f"seed must be an integer in [0, 2**32) (jax keys keep 32 bits), got {self.seed!r}")
        return out


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SamplingState:
    temperature: jax.Array  # [B] f32
    top_k: jax.Array  # [B] int32, 0: off
    top_p: jax.Array  # [B] f32
    min_p: jax.Array  # [B] f32
    presence: jax.Array  # [B] f32
    frequency: jax.Array  # [B] f32
    repetition: jax.Array  # [B] f32
    seed: jax.Array  # [B] uint32
    counts: jax.Array  # [B, V] int32: tokens generated so far
    seen: jax.Array  # [B, V] bool: tokens of the prompt

    @classmethod
    def create(cls, params: SamplingParams | Sequence[SamplingParams], prompt_ids, vocab_size: int,
               device=None) -> "SamplingState":
        """The state of a batch whose row b has settings params[b] (one SamplingParams: every row) and prompt
        prompt_ids[b] (ids, [B, T]; None: no prompt tokens seen)."""
        b = len(prompt_ids) if isinstance(params, SamplingParams) else len(params)
        rows = [params] * b if isinstance(params, SamplingParams) else list(params)
        col = lambda name, dtype: np.asarray([getattr(p, name) for p in rows], dtype)  # noqa: E731
        seen = np.zeros((b, vocab_size), bool)
        if prompt_ids is not None:
            for row, ids in enumerate(prompt_ids):
                seen[row, np.asarray(ids, np.int64)] = True
        host = cls(col("temperature", np.float32), np.asarray([p.top_k or 0 for p in rows], np.int32),
                   col("top_p", np.float32), col("min_p", np.float32), col("presence_penalty", np.float32),
                   col("frequency_penalty", np.float32), col("repetition_penalty", np.float32),
                   col("seed", np.uint32), np.zeros((b, vocab_size), np.int32), seen)
        return jax.device_put(host, device)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Sampled:
    token: jax.Array  # [B] int32
    logprob: jax.Array  # [B] f32
    top_ids: jax.Array  # [B, N] int32
    top_logprobs: jax.Array  # [B, N] f32


def _penalized(logits, s: SamplingState):
    generated = s.counts > 0
    r = s.repetition[:, None]
    rep = jnp.where(logits > 0, logits / r, logits * r)
    logits = jnp.where(generated | s.seen, rep, logits)
    return logits - s.frequency[:, None] * s.counts - s.presence[:, None] * generated


def _nucleus(x, s: SamplingState):
    """x [B, V] with -inf outside each row's top_k / top_p set (the top token always stays); one sort serves both.
    A row using neither keeps x."""
    v = x.shape[-1]
    ordered = jnp.sort(x, axis=-1)[:, ::-1]
    k = jnp.where(s.top_k > 0, s.top_k, v)
    kth = jnp.take_along_axis(ordered, (k - 1)[:, None], axis=-1)
    ordered = jnp.where(ordered < kth, -jnp.inf, ordered)
    probs = jax.nn.softmax(ordered, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # mass of the strictly more likely tokens
    # the most likely token always stays; top_p 1 keeps every token top_k kept (a sum of probabilities may
    # round below 1, which must not bring back the tokens top_k removed)
    keep = (before < s.top_p[:, None]) | (s.top_p[:, None] >= 1) | (jnp.arange(v) == 0)
    floor = jnp.min(jnp.where(keep & (ordered > -jnp.inf), ordered, jnp.inf), axis=-1, keepdims=True)
    return jnp.where(x < floor, -jnp.inf, x)


def _min_p(logits, s: SamplingState):
    probs = jax.nn.softmax(logits, axis=-1)
    floor = s.min_p[:, None] * jnp.max(probs, axis=-1, keepdims=True)
    return jnp.where(probs < floor, -jnp.inf, logits)


def _truncated(logits, s: SamplingState):
    """Scaled logits with -inf outside each row's top_k / top_p / min_p set (the top token always stays)."""
    logits = logits / jnp.maximum(s.temperature, 1e-6)[:, None]
    # computed whether or not a row uses it: a conditional would make the thread launching the program wait for
    # the GPU at every step (XLA's GPU runtime reads the predicate back), which costs more than one sort
    logits = jnp.where(((s.top_k > 0) | (s.top_p < 1))[:, None], _nucleus(logits, s), logits)
    return _min_p(logits, s)


def _draw(x, state: SamplingState, step, truncated=_truncated):
    """One token per row of x [B, V], drawn from `truncated(x, state)` with each row's seed folded with its step."""
    steps = jnp.broadcast_to(jnp.asarray(step), state.seed.shape)  # one step per row (batching: ragged)
    keys = jax.vmap(lambda seed, k: jax.random.fold_in(jax.random.key(seed), k))(state.seed, steps)
    return jax.vmap(jax.random.categorical)(keys, truncated(x, state)).astype(jnp.int32)


def top_k_chunked(x, n: int, chunk: int = TOP_CHUNK):
    """`lax.top_k(x, n)` of x [B, V] (values, indices), the same ties included, in two stages: the top n of each
    chunk of V, then the top n of those. Why: over a whole vocabulary XLA's GPU top_k is a radix sort of every row;
    the chunks' sorts are small (what each costs on the GPU: docs/MEASUREMENTS.md). Exact: each of the n largest lies
    in its chunk's n largest, and the candidates stay in index order among equal values, as top_k breaks ties (the
    lower index first)."""
    b, v = x.shape
    if v <= 2 * chunk or n > chunk:
        return jax.lax.top_k(x, n)
    chunks = -(-v // chunk)
    padded = jnp.pad(x, ((0, 0), (0, chunks * chunk - v)), constant_values=-jnp.inf)  # after every real entry
    values, at = jax.lax.top_k(padded.reshape(b, chunks, chunk), n)
    at = (at + (jnp.arange(chunks, dtype=at.dtype) * chunk)[:, None]).reshape(b, chunks * n)
    values, pos = jax.lax.top_k(values.reshape(b, chunks * n), n)
    return values, jnp.take_along_axis(at, pos, axis=-1)


def _picked(raw, token, state: SamplingState) -> tuple[Sampled, SamplingState]:
    """The `Sampled` of `token` [B] under log-probabilities raw [B, V], and the state with the token counted."""
    top_logprobs, top_ids = top_k_chunked(raw, min(TOP_LOGPROBS, raw.shape[-1]))
    picked = Sampled(token, jnp.take_along_axis(raw, token[:, None], axis=-1)[:, 0], top_ids.astype(jnp.int32),
                     top_logprobs)
    counts = state.counts.at[jnp.arange(token.shape[0]), token].add(1)
    return picked, dataclasses.replace(state, counts=counts)


def sample(logits: jax.Array, state: SamplingState, step, branch: bool = False) -> tuple[Sampled, SamplingState]:
    """See the module docstring. logits [B, V] (any float dtype); step: int, int32 scalar array, or int32 [B]
    (each row's own step, as continuous batching needs)."""
    logits = logits.astype(F32)
    penalized = _penalized(logits, state)
    greedy = jnp.argmax(penalized, axis=-1).astype(jnp.int32)

    def drawn():
        return jnp.where(state.temperature == 0, greedy, _draw(penalized, state, step))

    if branch:
        token = jax.lax.cond(jnp.all(state.temperature == 0), lambda: greedy, drawn)
    else:
        token = drawn()  # no conditional: `_truncated`
    return _picked(jax.nn.log_softmax(logits, axis=-1), token, state)


sample_jit = jax.jit(sample, donate_argnums=1)
