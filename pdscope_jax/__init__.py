"""pdscope_jax: a JAX runtime for Mixture-of-Experts LLMs with phase-adaptive expert offloading.

`pdscope_jax.load(name_or_path, ...)` returns a Runner with `logits` and `generate` (see `pdscope_jax.api`).
The public names are imported from `pdscope_jax.api` on first use, so that importing the package (as
`python -m pdscope_jax --help` does) does not start JAX.

Importing the package also sets the XLA flags it runs best under, in `XLA_FLAGS`, before JAX starts a backend
(`xla_defaults`): XLA's GPU command buffers (CUDA graphs) off, because re-recording a graph of a decode step's
thousand kernels cost more host time than launching them (docs/MEASUREMENTS.md, "Command buffers"). A flag the
user already put in `XLA_FLAGS` wins; `PDSCOPE_XLA_DEFAULTS=0` leaves `XLA_FLAGS` alone. JAX reads `XLA_FLAGS`
once, when its first backend starts: a program that computed with JAX before importing pdscope_jax keeps XLA's own.
"""

import importlib
import os

XLA_DEFAULTS = {"--xla_gpu_enable_command_buffer": ""}  # flag -> value (empty: the command-buffer kinds: none)


def xla_defaults(environ=os.environ) -> None:
    """Add each of `XLA_DEFAULTS` to `environ["XLA_FLAGS"]` unless it names that flag already (or opted out)."""
    if environ.get("PDSCOPE_XLA_DEFAULTS", "1").strip() == "0":
        return
    flags = environ.get("XLA_FLAGS", "")
    named = {word.split("=", 1)[0] for word in flags.split()}
    extra = [f"{flag}={value}" for flag, value in XLA_DEFAULTS.items() if flag not in named]
    if extra:
        environ["XLA_FLAGS"] = " ".join([*flags.split(), *extra])


xla_defaults()

__all__ = ["GenerationResult", "Runner", "load"]


def __getattr__(name: str):
    if name in __all__:
        return getattr(importlib.import_module("pdscope_jax.api"), name)
    raise AttributeError(f"module 'pdscope_jax' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
