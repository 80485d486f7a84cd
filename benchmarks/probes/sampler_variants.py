"""The sampler as it was with two conditionals (`lax.cond` on "any row uses top_k / top_p" and "every row is
greedy"), beside the package's branch-free one, so a probe can compare them in one process.

Contract: `use(kind)` makes every decode program traced from now on sample with `kind`: "select" (the package's
`generation.sampling.sample`, chunk programs as shipped: their one conditional skips the drawing when every row is
greedy), "select_chunks" (the same, chunk programs without that conditional too) or "conditional"
(`sample_with_conditionals`, the same tokens and logprobs); it patches the modules that call the sampler and clears
jax's caches so that the programs are traced again.
Why it matters: XLA's GPU runtime reads a conditional's predicate back to the host, so the thread launching the
program waits there for the GPU at every step.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pdscope_jax.engine import device_decode, programs
from pdscope_jax.generation import generator, sampling
from pdscope_jax.generation.sampling import F32, _penalized

PACKAGE_SAMPLE = sampling.sample


def _truncated_with_conditional(logits, s):
    logits = logits / jnp.maximum(s.temperature, 1e-6)[:, None]
    needed = jnp.any(s.top_k > 0) | jnp.any(s.top_p < 1)
    return sampling._min_p(jax.lax.cond(needed, lambda x: sampling._nucleus(x, s), lambda x: x, logits), s)


def sample_with_conditionals(logits, state, step, branch=True):  # branch: the chunk programs' argument (ignored)
    logits = logits.astype(F32)
    penalized = _penalized(logits, state)
    greedy = jnp.argmax(penalized, axis=-1).astype(jnp.int32)
    drawn = jax.lax.cond(jnp.all(state.temperature == 0), lambda x: greedy,
                         lambda x: sampling._draw(x, state, step, _truncated_with_conditional), penalized)
    token = jnp.where(state.temperature == 0, greedy, drawn)
    return sampling._picked(jax.nn.log_softmax(logits, axis=-1), token, state)


KINDS = {"select": PACKAGE_SAMPLE, "select_chunks": PACKAGE_SAMPLE, "conditional": sample_with_conditionals}
CHUNK_BRANCHES = generator.CHUNK_SAMPLER_BRANCHES


def use(kind: str) -> None:
    fn = KINDS[kind]
    for module in (device_decode, programs, generator):
        if hasattr(module, "sample"):
            module.sample = fn
    generator.CHUNK_SAMPLER_BRANCHES = CHUNK_BRANCHES and kind != "select_chunks"  # read as a chunk is traced
    generator._compiled.clear()
    jax.clear_caches()
