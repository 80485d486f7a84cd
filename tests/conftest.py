"""Test session setup: XLA:CPU compiles without LLVM's optimisations (tiny programs: compile time dominates); two
CPU devices stand in for host and accelerator (must run before JAX is first used);
no persistent compilation or workload-design cache unless a test turns one on (tests must not fill the user's
cache directory, and every test compiles what it runs and fits what it designs)."""

import gc
import os
from pathlib import Path

# Test programs are tiny: XLA:CPU's LLVM optimisations cost more compile time than they save (about 40 % of a test
# file's time). What the tests check does not depend on them. Subprocesses inherit the flag.
os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""), "--xla_backend_optimization_level=0"]).strip()

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 2)
os.environ["PDSCOPE_JAX_COMPILE_CACHE"] = "0"  # runtime.COMPILE_CACHE_ENV; subprocesses inherit it
os.environ["PDSCOPE_WORKLOAD_CACHE"] = "0"  # workloads.cache.ENV: designs are fitted, not kept, unless a test asks
# and off in this process whatever sets a cache directory
jax.config.update("jax_enable_compilation_cache", False)
# Every program XLA:CPU compiles maps about five memory regions until it is freed; a worker that keeps them all
# crosses the kernel's limit on mappings (vm.max_map_count, 65,530 by default), and the next compile segfaults.
MAPPINGS_BEFORE_CLEARING = 20_000
MAPS = Path("/proc/self/maps")

import pytest  # noqa: E402


def _mappings() -> int:
    with open(MAPS, "rb") as maps:
        return sum(1 for _ in maps)


@pytest.fixture(autouse=True, scope="module")
def _compiled_programs_stay_bounded():
    """After a test module, past MAPPINGS_BEFORE_CLEARING mappings in this process, jax drops the programs it
    compiled (the next module compiles what it runs), so a long run stays far below the kernel's limit."""
    yield
    if MAPS.exists() and _mappings() > MAPPINGS_BEFORE_CLEARING:
        jax.clear_caches()
        gc.collect()


@pytest.fixture(autouse=True)
def _persistent_cache_stays_off():
    """A test that turned JAX's persistent compilation cache on in this process turns it off again: later tests
    compile what they run, and nothing is written to a cache directory (a test may have deleted it)."""
    yield
    if jax.config.jax_compilation_cache_dir:
        from jax.experimental.compilation_cache import compilation_cache

        jax.config.update("jax_compilation_cache_dir", None)
        compilation_cache.reset_cache()
