"""`runtime.hold_gpu_to_budget`: before the backends start, XLA's GPU preallocation is set from the budget (the
driver's answer stood in for here); a user's own setting, preallocation turned off, backends already started or
no CUDA driver leave the environment as it was; a later, larger budget than the process was held to is refused
with the fix. The driver helper (`cuda_driver`) answers None without a driver and names the driver's errors."""

import pytest
from jax._src import xla_bridge

from pdscope_jax import cuda_driver, runtime

TOTAL = 141 * 10**9  # an H200's memory


@pytest.fixture
def unstarted(monkeypatch):
    """A process whose backends have not started, on a GPU of TOTAL bytes; the settings cleared."""
    monkeypatch.setattr(xla_bridge, "backends_are_initialized", lambda: False)
    monkeypatch.setattr(cuda_driver, "total_memory", lambda: TOTAL)
    for name in (runtime.PREALLOCATION_ENV, "XLA_PYTHON_CLIENT_PREALLOCATE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(runtime, "_held_bytes", None)
    return monkeypatch


def test_the_budget_with_its_slack_becomes_the_fraction(unstarted):
    fraction = runtime.hold_gpu_to_budget(24 * 10**9)
    want = (24e9 * runtime.PREALLOCATION_FACTOR + runtime.PREALLOCATION_SLACK) / TOTAL
    assert fraction == pytest.approx(want) and 0.2 < fraction < 0.21
    assert float(runtime.os.environ[runtime.PREALLOCATION_ENV]) == pytest.approx(want, abs=1e-4)


def test_a_budget_past_the_gpu_is_held_to_90_percent(unstarted):
    assert runtime.hold_gpu_to_budget(10**12) == 0.9


@pytest.mark.parametrize("setting", [(runtime.PREALLOCATION_ENV, "0.5"), ("XLA_PYTHON_CLIENT_PREALLOCATE", "false")])
def test_the_users_own_setting_is_kept(unstarted, setting):
    unstarted.setenv(*setting)
    assert runtime.hold_gpu_to_budget(24 * 10**9) is None
    assert runtime.os.environ.get(runtime.PREALLOCATION_ENV) == ("0.5" if setting[1] == "0.5" else None)


def test_too_late_or_no_gpu_changes_nothing(unstarted):
    unstarted.setattr(xla_bridge, "backends_are_initialized", lambda: True)
    assert runtime.hold_gpu_to_budget(24 * 10**9) is None
    unstarted.setattr(xla_bridge, "backends_are_initialized", lambda: False)
    unstarted.setattr(cuda_driver, "total_memory", lambda: None)
    assert runtime.hold_gpu_to_budget(24 * 10**9) is None
    assert runtime.PREALLOCATION_ENV not in runtime.os.environ


def test_a_later_budget_beyond_the_held_one_is_refused_with_the_fix(unstarted):
    runtime.hold_gpu_to_budget(8 * 10**9)
    unstarted.setattr(xla_bridge, "backends_are_initialized", lambda: True)
    assert runtime.hold_gpu_to_budget(8 * 10**9) is None  # the same budget fits what was held
    with pytest.raises(runtime.RuntimeConfigError, match="load the largest budget first"):
        runtime.hold_gpu_to_budget(24 * 10**9)


def test_the_driver_helper_answers_none_without_a_driver_and_names_errors(monkeypatch):
    import ctypes

    def no_library(name):
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(cuda_driver, "_lib", None)
    monkeypatch.setattr(ctypes, "CDLL", no_library)
    assert cuda_driver.total_memory() is None
    with pytest.raises(OSError, match="libcuda"):
        cuda_driver.driver()

    class FailingDriver:
        def cuGetErrorString(self, code, out):
            out._obj.value = b"CUDA_ERROR_NO_DEVICE"

    with pytest.raises(RuntimeError, match=r"cuInit failed: CUDA error 100 \(CUDA_ERROR_NO_DEVICE\)"):
        cuda_driver.check(FailingDriver(), 100, "cuInit")
    cuda_driver.check(FailingDriver(), 0, "cuInit")  # 0 is success: nothing raised
