"""pdscope_jax: a JAX runtime for Mixture-of-Experts LLMs with phase-adaptive expert offloading.

`pdscope_jax.load(name_or_path, ...)` returns a Runner with `logits` and `generate` (see `pdscope_jax.api`).
The public names are imported from `pdscope_jax.api` on first use, so that importing the package (as
`python -m pdscope_jax --help` does) does not start JAX.
"""

import importlib

__all__ = ["GenerationResult", "Runner", "load"]


def __getattr__(name: str):
    if name in __all__:
        return getattr(importlib.import_module("pdscope_jax.api"), name)
    raise AttributeError(f"module 'pdscope_jax' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
