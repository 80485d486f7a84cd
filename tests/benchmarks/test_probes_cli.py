"""Every measurement script (benchmarks/*.py, benchmarks/probes/probe_*.py, scripts/*.py) answers --help, and its
module docstring is a contract that names only paths that exist."""

import ast
import json
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


# Forks one child per script from a process that imported jax once (most of a script's start), each child running
# the script as `python SCRIPT --help` would: its own process, its folder first on sys.path, __name__ "__main__",
# its output in files, a deadline (SIGALRM ends it). Prints the exit statuses as JSON.
FORKS = r"""
import json, os, runpy, signal, sys, traceback
import jax  # noqa: F401
out, scripts, running, codes = sys.argv[1], sys.argv[2:], {}, {}


def run(i, script):
    for fd, kind in ((1, "out"), (2, "err")):
        os.dup2(os.open(os.path.join(out, f"{i}.{kind}"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
    signal.alarm(120)
    sys.argv, sys.path[0] = [script, "--help"], os.path.dirname(script)
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as stop:  # as the interpreter ends on it: an int is the status, another value is printed
        code = stop.code
        if code is not None and not isinstance(code, int):
            print(code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code or 0)


def reap():
    pid, status = os.wait()
    codes[running.pop(pid)] = os.waitstatus_to_exitcode(status)


for i, script in enumerate(scripts):
    if len(running) == 4:  # a few at a time
        reap()
    sys.stdout.flush()
    pid = os.fork()
    if pid == 0:
        run(i, script)
    running[pid] = i
while running:
    reap()
print(json.dumps([codes[i] for i in range(len(scripts))]))
"""


@pytest.fixture(scope="module")
def helps(tmp_path_factory) -> dict[Path, subprocess.CompletedProcess]:
    """Every script's --help, run as it is run by hand (its own process, its folder first on sys.path): forked
    from one process that imported jax once (importing jax was most of each script's time)."""
    out = tmp_path_factory.mktemp("helps")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    done = subprocess.run([sys.executable, "-c", FORKS, str(out), *map(str, SCRIPTS)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    codes = json.loads(done.stdout.strip().splitlines()[-1])
    return {script: subprocess.CompletedProcess([script, "--help"], code, (out / f"{i}.out").read_text(),
                                                (out / f"{i}.err").read_text())
            for i, (script, code) in enumerate(zip(SCRIPTS, codes))}


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
