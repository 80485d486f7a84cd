"""Pieces shared by the measurement scripts of this folder (`benchmarks/*.py`).

A script run as `python benchmarks/<name>.py` has this folder first on sys.path, hence `from _shared import`.
Contract:
- `command_line(script, argv)` -> the command that reproduces a run, as recorded in the results:
  "python <script's path from the repository root> <argv, shell-quoted>";
- `pyplot()` -> matplotlib.pyplot on the non-interactive Agg backend (no display needed);
- `save_figure(fig, path, dpi, **tight_layout)` lays the figure out, writes it to `path` (creating its folder)
  and closes it;
- `commit()` -> a COMMIT file's content where one lies at the tree's root (a copied tree, such as the GPU node's,
  may carry a stale git HEAD), else HEAD of this checkout, short, with "+dirty" when tracked files differ, else
  "unknown"; `machine()` -> python, jax, usable CPUs, devices, platform.
"""

from __future__ import annotations

import os
import platform
import shlex
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def command_line(script: str | Path, argv: list[str]) -> str:
    path = Path(script).resolve()
    shown = path.relative_to(REPO).as_posix() if path.is_relative_to(REPO) else path.name
    return shlex.join(["python", shown, *argv])


def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: Path, dpi: int, **tight_layout) -> None:
    import matplotlib.pyplot as plt

    fig.tight_layout(**tight_layout)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)


def commit() -> str:
    from pdscope_jax.artifacts.provenance import source_commit

    return source_commit() or "unknown"


def machine() -> dict:
    import jax

    return {"python": platform.python_version(), "jax": jax.__version__, "cpus": len(os.sched_getaffinity(0)),
            "devices": [str(d) for d in jax.devices()], "platform": platform.platform()}
