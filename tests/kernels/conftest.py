"""The kernels' shared fixtures: every test here runs on the CPU backend, also on a GPU machine (the CPU expert
kernel and the bridge's worker entry are CPU code; Pallas' interpreter stands in for the GPU kernel, whose
`on_gpu` must take its CPU branch; float32 references must not be XLA:GPU's TF32 products); `kernel` skips a
module's tests where the CPU expert kernel is not built, and puts its instruction set back to the best one after
them."""

import jax
import pytest

from pdscope_jax.kernels import cpu_ffn


@pytest.fixture(autouse=True)
def on_the_cpu_backend():
    with jax.default_device(jax.devices("cpu")[0]):
        yield


@pytest.fixture(scope="module")
def kernel():
    if not cpu_ffn.built():
        pytest.skip("the CPU expert kernel is not built here (no C++ compiler or a failed build)")
    yield
    cpu_ffn.set_isa(None)
