"""The CUDA bridge's pieces that run without a GPU: its library builds (it reaches CUDA only through the
driver at run time), it declines a non-CUDA accelerator with the reason, and its worker's entry into the CPU
kernel computes what the kernel's FFI handler does."""

import ctypes

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pdscope_jax.kernels import build, cpu_ffn, host_experts

from ffn_reference import routing_case

D, F, E = 256, 160, 6


def test_the_bridge_library_builds_without_cuda(kernel):
    assert build.shared_library(host_experts.SOURCE) is not None


def test_a_cpu_accelerator_gets_no_bridge_and_the_reason(kernel):
    addresses = [([0] * E, [0] * E)]
    assert host_experts.Bridge.create(addresses, (D, F), jax.devices("cpu")[0], 1, 6) is None
    assert "not a CUDA GPU" in host_experts.why_not()


@pytest.mark.parametrize("rows, k", [(1, 1), (1, 6), (4, 3)])
def test_the_workers_entry_computes_what_the_kernel_handler_does(kernel, rows, k):
    rng = np.random.default_rng(rows * 10 + k)
    gate_up = np.asarray(jnp.asarray(rng.standard_normal((E, D, 2 * F)) * 0.06, jnp.bfloat16))
    down = np.asarray(jnp.asarray(rng.standard_normal((E, F, D)) * 0.08, jnp.bfloat16))
    h, coef, ids = routing_case(rows, k, D, E, rows + k)
    want = np.asarray(cpu_ffn.moe_ffn_cpu(h, jnp.asarray(coef), jnp.asarray(gate_up), jnp.asarray(down),
                                          jnp.asarray(ids), impl="kernel"))
    lib = cpu_ffn.library()
    run = lib.pdscope_cpu_ffn_run_bf16
    run.restype = ctypes.c_int
    h16 = np.ascontiguousarray(np.asarray(h).view(np.uint16))
    gu_ptrs = (ctypes.c_void_p * k)(*[gate_up[i].ctypes.data for i in ids])
    dn_ptrs = (ctypes.c_void_p * k)(*[down[i].ctypes.data for i in ids])
    out = np.empty((rows, D), np.float32)
    coef = np.ascontiguousarray(coef)
    args = (h16.ctypes.data_as(ctypes.c_void_p), coef.ctypes.data_as(ctypes.c_void_p), ctypes.c_int(rows),
            ctypes.c_int(D), ctypes.c_int(F), ctypes.c_int(k), gu_ptrs, dn_ptrs, out.ctypes.data_as(ctypes.c_void_p))
    assert run(*args) == 0
    np.testing.assert_array_equal(out, want)  # the same call plan, the same pool: the same bits
    bad = list(args)
    bad[4] = ctypes.c_int(F + 1)  # not a multiple of 32
    assert run(*bad) == 1
