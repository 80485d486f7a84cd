"""The sampler as it was with two conditionals (`lax.cond` on "any row uses top_k / top_p" and "every row is
greedy"), beside the package's branch-free one, so a probe can compare them in one process.

Contract: `use(kind)` makes every decode program traced from now on sample with `kind`: "select" (the package's
`generation.sampling.sample`) or "conditional" (`sample_with_conditionals`, the same tokens and logprobs); it
patches the modules that call the sampler and clears jax's caches so that the programs are traced again.
Why it matters: XLA's GPU runtime reads a conditional's predicate back to the host, so the thread launching the
program waits there for the GPU at every step.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from pdscope_jax.engine import device_decode, programs
from pdscope_jax.generation import generator, sampling
from pdscope_jax.generation.sampling import F32, TOP_LOGPROBS, Sampled, _penalized

PACKAGE_SAMPLE = sampling.sample


def _truncated_with_conditional(logits, s):
    v = logits.shape[-1]
    logits = logits / jnp.maximum(s.temperature, 1e-6)[:, None]

    def nucleus(x):
        ordered = jnp.sort(x, axis=-1)[:, ::-1]
        k = jnp.where(s.top_k > 0, s.top_k, v)
        kth = jnp.take_along_axis(ordered, (k - 1)[:, None], axis=-1)
        ordered = jnp.where(ordered < kth, -jnp.inf, ordered)
        probs = jax.nn.softmax(ordered, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs
        keep = (before < s.top_p[:, None]) | (s.top_p[:, None] >= 1) | (jnp.arange(v) == 0)
        floor = jnp.min(jnp.where(keep & (ordered > -jnp.inf), ordered, jnp.inf), axis=-1, keepdims=True)
        return jnp.where(x < floor, -jnp.inf, x)

    needed = jnp.any(s.top_k > 0) | jnp.any(s.top_p < 1)
    logits = jax.lax.cond(needed, nucleus, lambda x: x, logits)
    probs = jax.nn.softmax(logits, axis=-1)
    floor = s.min_p[:, None] * jnp.max(probs, axis=-1, keepdims=True)
    return jnp.where(probs < floor, -jnp.inf, logits)


def sample_with_conditionals(logits, state, step):
    logits = logits.astype(F32)
    raw = jax.nn.log_softmax(logits, axis=-1)
    penalized = _penalized(logits, state)
    greedy = jnp.argmax(penalized, axis=-1).astype(jnp.int32)

    def draw(x):
        steps = jnp.broadcast_to(jnp.asarray(step), state.seed.shape)
        keys = jax.vmap(lambda seed, k: jax.random.fold_in(jax.random.key(seed), k))(state.seed, steps)
        return jax.vmap(jax.random.categorical)(keys, _truncated_with_conditional(x, state)).astype(jnp.int32)

    drawn = jax.lax.cond(jnp.all(state.temperature == 0), lambda x: greedy, draw, penalized)
    token = jnp.where(state.temperature == 0, greedy, drawn)
    top_logprobs, top_ids = jax.lax.top_k(raw, min(TOP_LOGPROBS, raw.shape[-1]))
    picked = Sampled(token, jnp.take_along_axis(raw, token[:, None], axis=-1)[:, 0], top_ids.astype(jnp.int32),
                     top_logprobs)
    counts = state.counts.at[jnp.arange(token.shape[0]), token].add(1)
    return picked, dataclasses.replace(state, counts=counts)


KINDS = {"select": PACKAGE_SAMPLE, "conditional": sample_with_conditionals}


def use(kind: str) -> None:
    fn = KINDS[kind]
    for module in (device_decode, programs, generator):
        if hasattr(module, "sample"):
            module.sample = fn
    generator._compiled.clear()
    jax.clear_caches()
