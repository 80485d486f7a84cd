"""Test session setup: XLA:CPU compiles without LLVM's optimisations (tiny programs: compile time dominates); two
CPU devices stand in for host and accelerator (must run before JAX is first used); one persistent compilation
cache for the session in a temporary directory, shared by the workers and removed at the end (compiling is most of
the suite's time, and every engine a test builds jits its own programs: the same programs, compiled once), off for
tests that count compilations (`compiles_for_real`); no cache of the user's, and no workload-design cache unless a
test turns one on (tests must not fill the user's cache directory, and every test fits what it designs)."""

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
os.environ["PDSCOPE_JAX_COMPILE_CACHE"] = "0"  # runtime.COMPILE_CACHE_ENV; subprocesses inherit it
os.environ["PDSCOPE_WORKLOAD_CACHE"] = "0"  # workloads.cache.ENV: designs are fitted, not kept, unless a test asks
SESSION_CACHE = "PDSCOPE_TESTS_XLA_CACHE"  # the session's cache directory: made by the controller, which the
MADE_HERE = SESSION_CACHE not in os.environ  # workers it starts inherit it from
if MADE_HERE:
    os.environ[SESSION_CACHE] = tempfile.mkdtemp(prefix="pdscope-tests-xla-")


def _use_session_cache() -> None:
    """This process's programs go to and come from the session's cache, however small (as `runtime`'s cache keeps
    them), under jax's file lock (its LRU cache: the workers share the directory)."""
    from jax.experimental.compilation_cache import compilation_cache

    jax.config.update("jax_enable_compilation_cache", True)
    jax.config.update("jax_compilation_cache_dir", os.environ[SESSION_CACHE])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    jax.config.update("jax_compilation_cache_max_size", 8 * 2**30)
    compilation_cache.reset_cache()


_use_session_cache()
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
def _persistent_cache_is_the_sessions():
    """A test that pointed JAX's persistent compilation cache elsewhere, or turned it off, leaves the session's for
    the next test (a test may have deleted its own directory)."""
    yield
    if (jax.config.jax_compilation_cache_dir != os.environ[SESSION_CACHE]
            or not jax.config.jax_enable_compilation_cache):
        _use_session_cache()


@pytest.fixture
def compiles_for_real():
    """No persistent cache during the test: a program it needs is compiled, so a count of compilations counts."""
    from jax.experimental.compilation_cache import compilation_cache

    jax.config.update("jax_enable_compilation_cache", False)
    compilation_cache.reset_cache()
    yield
    _use_session_cache()


def pytest_unconfigure(config):
    if MADE_HERE:  # the controller, once its workers ended (or a run without workers)
        shutil.rmtree(os.environ[SESSION_CACHE], ignore_errors=True)
