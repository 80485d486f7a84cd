"""Which code made a result: the commit every results file records.

Contract: `source_commit()` -> the content of a COMMIT file at the root of the tree this package sits in (a
copied tree, such as the GPU node's, may carry a stale git HEAD, so the copy names its commit), else that tree's
git HEAD, short, with "+dirty" when tracked files differ, else None (an installed package outside a checkout).
"""

from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the checkout's root when the package runs from one


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
