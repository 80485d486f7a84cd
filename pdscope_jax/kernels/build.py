"""Compile a C++ source of this package into a shared library on first use, cached by content.

Contract: `shared_library(source)` -> the path of a shared library built from `source` (a .cc file) against
the XLA FFI headers of the installed jax (`jax.ffi.include_dir()`), or None when it cannot be built. The
library lands in a cache folder (`PDSCOPE_KERNEL_CACHE`, else `$XDG_CACHE_HOME/pdscope_jax/kernels` or
`~/.cache/pdscope_jax/kernels`, else the temp folder), named by a hash of the source, its folder's headers,
jax's FFI headers, the compiler's version and the flags: a later process reuses it, an edit or a jax upgrade
rebuilds it. The build writes to a temporary name and renames it into place, so concurrent first uses are safe.
The compiler is `$CXX`, else the first of g++, c++, clang++ on PATH. Failure (no compiler, compile error,
unwritable cache) never raises: it warns once, in one line, and returns None, so callers fall back to XLA.
`once(load)` wraps a library's loader so that the first call runs it under a lock and every later call returns
what it returned (None too: a failed build is not retried in this process).
Run `python -m pdscope_jax.kernels.build` to build every kernel ahead of time and print where they are.
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

FLAGS = ["-O3", "-std=c++17", "-fPIC", "-shared", "-pthread"]
SOURCES = Path(__file__).parent / "csrc"
T = TypeVar("T")


def once(load: Callable[[], T]) -> Callable[[], T]:
    """`load` run on the first call only, under a lock (two threads never build one library twice); later calls
    return its first result."""
    lock = threading.Lock()
    first = functools.cache(load)

    @functools.wraps(load)
    def loaded() -> T:
        with lock:
            return first()
    return loaded


def compiler() -> str | None:
    """The C++ compiler to use, or None."""
    for name in ([os.environ["CXX"]] if os.environ.get("CXX") else []) + ["g++", "c++", "clang++"]:
        path = shutil.which(name)
        if path:
            return path
    return None


def cache_dir() -> Path:
    """The first writable of the configured, user and temporary cache folders."""
    candidates = []
    if os.environ.get("PDSCOPE_KERNEL_CACHE"):
        candidates.append(Path(os.environ["PDSCOPE_KERNEL_CACHE"]))
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    candidates.append(Path(base) / "pdscope_jax" / "kernels")
    candidates.append(Path(tempfile.gettempdir()) / f"pdscope_jax_kernels_{os.getuid()}")
    for folder in candidates:
        try:
            folder.mkdir(parents=True, exist_ok=True)
            if os.access(folder, os.W_OK):
                return folder
        except OSError:
            continue
    raise OSError("no writable cache folder for compiled kernels")


def _headers_digest(include: Path) -> bytes:
    digest = hashlib.sha256()
    for header in sorted((include / "xla" / "ffi" / "api").glob("*.h")):
        digest.update(header.read_bytes())
    return digest.digest()


def _fail(source: Path, why: str) -> None:
    warnings.warn(f"pdscope_jax: could not build {source.name} ({why}); using the XLA path", stacklevel=3)


def shared_library(source: Path) -> Path | None:
    """Build (or find already built) the shared library of `source`; None, with one warning, on failure."""
    import jax

    cxx = compiler()
    if cxx is None:
        _fail(source, "no C++ compiler found")
        return None
    include = Path(jax.ffi.include_dir())
    try:
        version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout
        own_headers = b"".join(h.read_bytes() for h in sorted(source.parent.glob("*.h")))
        key = hashlib.sha256(source.read_bytes() + own_headers + _headers_digest(include) + version.encode()
                             + " ".join(FLAGS).encode()).hexdigest()[:16]
        target = cache_dir() / f"{source.stem}-{key}.so"
        if target.exists():
            return target
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(fd)
        result = subprocess.run([cxx, *FLAGS, "-isystem", str(include), str(source), "-o", tmp],
                                capture_output=True, text=True, timeout=600)
        if result.returncode != 0:
            os.unlink(tmp)
            errors = [line for line in result.stderr.splitlines() if "error" in line] or result.stderr.splitlines()
            _fail(source, f"{Path(cxx).name}: {errors[0].strip() if errors else 'exit ' + str(result.returncode)}")
            return None
        os.replace(tmp, target)
        return target
    except (OSError, subprocess.SubprocessError) as error:
        _fail(source, f"{type(error).__name__}: {error}")
        return None


if __name__ == "__main__":
    built = {source.name: shared_library(source) for source in sorted(SOURCES.glob("*.cc"))}
    for name, path in built.items():
        print(f"{name}: {path or 'NOT BUILT'}")
    sys.exit(0 if all(built.values()) else 1)
