"""Fixtures of the measurement scripts' tests."""

import importlib.util
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture
def load_script(monkeypatch):
    """`load_script(name)` imports benchmarks/NAME.py as it runs by hand: its folder first on sys.path (for
    `_shared`), under the module name NAME."""

    def load(name: str):
        monkeypatch.syspath_prepend(str(BENCHMARKS))
        spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    return load
