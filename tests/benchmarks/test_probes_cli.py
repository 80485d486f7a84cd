"""Every measurement script (benchmarks/*.py, benchmarks/probes/probe_*.py, scripts/*.py) answers --help, and its
module docstring is a contract that names only paths that exist."""

import ast
import concurrent.futures
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = sorted([*(p for p in (REPO / "benchmarks").glob("*.py") if not p.name.startswith("_")),
                  *(REPO / "benchmarks" / "probes").glob("probe_*.py"),
                  *(REPO / "scripts").glob("*.py")])
HELPERS = [REPO / "benchmarks" / "_shared.py", REPO / "benchmarks" / "probes" / "_common.py"]
IDS = [p.relative_to(REPO).as_posix() for p in SCRIPTS]


def _help(script: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    return subprocess.run([sys.executable, str(script), "--help"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=120)


@pytest.fixture(scope="module")
def helps() -> dict[Path, subprocess.CompletedProcess]:
    """Every script's --help, run as it is run by hand (its own process, its folder first on sys.path), a few at
    a time: most of the time is importing jax."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=4) as pool:
        return dict(zip(SCRIPTS, pool.map(_help, SCRIPTS)))


def test_the_scripts_are_found():
    assert {"benchmarks/bench_plain.py", "benchmarks/probes/probe_copy_issue.py",
            "scripts/train_reference_moe.py"} <= set(IDS)


@pytest.mark.parametrize("script", SCRIPTS, ids=IDS)
def test_script_answers_help(helps, script):
    done = helps[script]
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("usage:")


@pytest.mark.parametrize("script", SCRIPTS + HELPERS, ids=lambda p: p.relative_to(REPO).as_posix())
def test_docstring_is_a_short_contract_naming_real_paths(script):
    doc = ast.get_docstring(ast.parse(script.read_text()), clean=False)
    assert doc and len(doc.splitlines()) <= 25
    if script not in HELPERS:
        assert script.relative_to(REPO).as_posix() in doc  # how to run it, by its own path
    for path in re.findall(r"\b(?:benchmarks|scripts|pdscope_jax)/[\w/]+\.(?:py|sh)\b", doc):
        assert (REPO / path).exists(), path
    assert not re.search(r"\b[Cc]alls? \d|H200|\b20\d\d-\d\d", doc)  # no measurement history
