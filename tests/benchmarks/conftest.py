"""Fixtures of the measurement scripts' tests."""

import pytest

from script_import import BENCHMARKS, import_script


@pytest.fixture
def load_script():
    """`load_script(name)` imports benchmarks/NAME.py as it runs by hand (`script_import.import_script`)."""
    return lambda name: import_script(BENCHMARKS / f"{name}.py")
