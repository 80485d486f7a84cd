"""The kernels' shared fixture: `kernel` skips a module's tests where the CPU expert kernel is not built, and
puts its instruction set back to the best one after them."""

import pytest

from pdscope_jax.kernels import cpu_ffn


@pytest.fixture(scope="module")
def kernel():
    if not cpu_ffn.built():
        pytest.skip("the CPU expert kernel is not built here (no C++ compiler or a failed build)")
    yield
    cpu_ffn.set_isa(None)
