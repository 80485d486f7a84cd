"""pdscope_jax: a JAX runtime for Mixture-of-Experts LLMs with phase-adaptive expert offloading.

`pdscope_jax.load(name_or_path, ...)` returns a Runner with `logits` and `generate` (see `pdscope_jax.api`).
"""

from pdscope_jax.api import GenerationResult, Runner, load

__all__ = ["GenerationResult", "Runner", "load"]
