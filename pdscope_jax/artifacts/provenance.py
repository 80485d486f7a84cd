"""Which code made a result: the commit every results file records, and a digest of the package's code.

Contract: `source_commit()` -> the content of a COMMIT file at the root of the tree this package sits in (a
copied tree, such as the GPU node's, may carry a stale git HEAD, so the copy names its commit), else that tree's
git HEAD, short, with "+dirty" when tracked files differ, else None (an installed package outside a checkout).
`source_digest()` -> sha256 (hex) of every Python source of the installed package, names and bytes: equal only
for the same code, checkout or not (what a cache of figures that code computes is keyed by). Read once a process.
"""

from __future__ import annotations

import functools
import hashlib
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the checkout's root when the package runs from one
PACKAGE = Path(__file__).resolve().parents[1]


def source_commit() -> str | None:
    marker = ROOT / "COMMIT"
    if marker.is_file():
        return marker.read_text().strip() or None
    try:
        git = lambda *args: subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True,  # noqa: E731
                                           check=True, timeout=10).stdout.strip()
        head = git("rev-parse", "--short", "HEAD")
        return head + ("+dirty" if git("status", "--porcelain", "--untracked-files=no") else "") if head else None
    except (OSError, subprocess.SubprocessError):
        return None


@functools.cache
def source_digest() -> str:
    digest = hashlib.sha256()
    for path in sorted(PACKAGE.rglob("*.py")):
        digest.update(path.relative_to(PACKAGE).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()
