"""Test session setup: two CPU devices stand in for host and accelerator (must run before JAX is first used);
no persistent compilation cache unless a test turns one on (tests must not fill the user's cache directory, and
every test compiles what it runs)."""

import os

import jax

jax.config.update("jax_num_cpu_devices", 2)
os.environ["PDSCOPE_JAX_COMPILE_CACHE"] = "0"  # runtime.COMPILE_CACHE_ENV; subprocesses inherit it
