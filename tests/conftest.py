"""Test session setup: two CPU devices stand in for host and accelerator (must run before JAX is first used);
no persistent compilation cache unless a test turns one on (tests must not fill the user's cache directory, and
every test compiles what it runs)."""

import os

import jax

jax.config.update("jax_num_cpu_devices", 2)
os.environ["PDSCOPE_JAX_COMPILE_CACHE"] = "0"  # runtime.COMPILE_CACHE_ENV; subprocesses inherit it
# and off in this process whatever sets a cache directory: full runs crashed in XLA compiles made with it on
jax.config.update("jax_enable_compilation_cache", False)


import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _persistent_cache_stays_off():
    """A test that turned JAX's persistent compilation cache on in this process turns it off again: later tests
    compile what they run, and nothing is written to a cache directory (a test may have deleted it)."""
    yield
    if jax.config.jax_compilation_cache_dir:
        from jax.experimental.compilation_cache import compilation_cache

        jax.config.update("jax_compilation_cache_dir", None)
        compilation_cache.reset_cache()
