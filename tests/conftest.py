"""Test session setup: two CPU devices stand in for host and accelerator (must run before JAX is first used)."""

import jax

jax.config.update("jax_num_cpu_devices", 2)
