"""Test session setup: XLA:CPU compiles without LLVM's optimisations (tiny programs: compile time dominates); two
CPU devices stand in for host and accelerator (must run before JAX is first used); one persistent compilation
cache for the session in a temporary directory (never the user's), shared by the workers and the subprocesses
tests start, removed at the end; no workload-design cache unless a test turns one on (every test fits what it
designs)."""

import gc
import os
import shutil
import tempfile
from pathlib import Path

# Test programs are tiny: XLA:CPU's LLVM optimisations cost more compile time than they save (about 40 % of a test
# file's time). What the tests check does not depend on them. Subprocesses inherit the flag.
os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""), "--xla_backend_optimization_level=0"]).strip()

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 2)
# Many tests build the same tiny models, so most programs recur across test files: compiled once a session, they
# are read back after (the same HLO, flags and jax give the same program). The controller makes the directory
# before it starts the workers, which inherit the variable; so do the subprocesses tests start.
SESSION_CACHE_ENV = "PDSCOPE_TEST_COMPILE_CACHE"
OWNS_SESSION_CACHE = SESSION_CACHE_ENV not in os.environ
if OWNS_SESSION_CACHE:
    os.environ[SESSION_CACHE_ENV] = tempfile.mkdtemp(prefix="pdscope-test-xla-")
SESSION_CACHE = os.environ[SESSION_CACHE_ENV]
os.environ["PDSCOPE_JAX_COMPILE_CACHE"] = SESSION_CACHE  # runtime.COMPILE_CACHE_ENV
os.environ["PDSCOPE_WORKLOAD_CACHE"] = "0"  # workloads.cache.ENV: designs are fitted, not kept, unless a test asks
# Every program XLA:CPU compiles maps about five memory regions until it is freed; a worker that keeps them all
# crosses the kernel's limit on mappings (vm.max_map_count, 65,530 by default), and the next compile segfaults.
MAPPINGS_BEFORE_CLEARING = 20_000
MAPS = Path("/proc/self/maps")

import pytest  # noqa: E402

from pdscope_jax.runtime import enable_compile_cache  # noqa: E402

enable_compile_cache(SESSION_CACHE)


def pytest_unconfigure(config):
    if OWNS_SESSION_CACHE and not hasattr(config, "workerinput"):  # the controller, once the workers are done
        shutil.rmtree(SESSION_CACHE, ignore_errors=True)


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
def _session_cache_restored():
    """A test that pointed JAX's persistent compilation cache elsewhere, or turned it off, gets the session's back:
    nothing later is written to its directory (a test may have deleted it)."""
    yield
    if jax.config.jax_compilation_cache_dir != SESSION_CACHE or not jax.config.jax_enable_compilation_cache:
        from jax.experimental.compilation_cache import compilation_cache

        jax.config.update("jax_enable_compilation_cache", True)
        jax.config.update("jax_compilation_cache_dir", SESSION_CACHE)
        compilation_cache.reset_cache()
