"""The CUDA bridge's pieces that run without a GPU: its library builds (it reaches CUDA only through the
driver at run time), it declines a non-CUDA accelerator with the reason, and its worker's entry into the CPU
kernel (`cpu_ffn.run`) computes what the kernel's FFI handler does, on bf16, int8 and int4 experts."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pdscope_jax.kernels import build, cpu_ffn, host_experts
from pdscope_jax.quant.formats import quantize

from ffn_reference import routing_case

D, F, E = 256, 160, 6  # int4 groups: gate_up's 64 rows, down's 32


def test_the_bridge_library_builds_without_cuda(kernel):
    assert build.shared_library(host_experts.SOURCE) is not None


def test_a_cpu_accelerator_gets_no_bridge_and_the_reason(kernel):
    weights = [cpu_ffn.HostWeights((0,) * E, (0,) * E)]
    assert host_experts.Bridge.create(weights, (D, F), jax.devices("cpu")[0], 1, 6) is None
    assert "not a CUDA GPU" in host_experts.why_not()


def stacks(name: str):
    """(gate_up [E, D, 2F], down [E, F, D]) bf16, or quantized as `name`."""
    rng = np.random.default_rng(len(name))
    gate_up = jnp.asarray(rng.standard_normal((E, D, 2 * F)) * 0.06, jnp.bfloat16)
    down = jnp.asarray(rng.standard_normal((E, F, D)) * 0.08, jnp.bfloat16)
    return (gate_up, down) if name == "bf16" else (quantize(gate_up, name), quantize(down, name))


def host_weights(gate_up, down, ids):
    """The picks' HostWeights over numpy copies of the stacks (float32 scales, as the kernel reads them), and the
    copies (kept alive while the addresses are used)."""
    if not hasattr(gate_up, "q"):
        arrays = [np.asarray(gate_up), np.asarray(down)]
        gu, dn = arrays
        return cpu_ffn.HostWeights(tuple(gu[i].ctypes.data for i in ids), tuple(dn[i].ctypes.data for i in ids)), arrays
    arrays = [np.asarray(a, np.float32 if a is w.scale else None) for w in (gate_up, down) for a in (w.q, w.scale)]
    gq, gs, dq, ds = arrays
    at = lambda a: tuple(a[i].ctypes.data for i in ids)  # noqa: E731
    groups = (D // gs.shape[1], F // ds.shape[1])
    return cpu_ffn.HostWeights(at(gq), at(dq), gate_up.scheme.bits, at(gs), at(ds), groups), arrays


@pytest.mark.parametrize("name", ["bf16", "int8", "int4"])
@pytest.mark.parametrize("rows, k", [(1, 1), (1, 6), (4, 3)])
def test_the_workers_entry_computes_what_the_kernel_handler_does(kernel, name, rows, k):
    gate_up, down = stacks(name)
    h, coef, ids = routing_case(rows, k, D, E, rows + k)
    want = np.asarray(cpu_ffn.moe_ffn_cpu(h, jnp.asarray(coef), gate_up, down, jnp.asarray(ids), impl="kernel"))
    weights, _kept = host_weights(gate_up, down, ids)
    got = cpu_ffn.run(weights, np.asarray(h), coef, (D, F))
    np.testing.assert_array_equal(got, want)  # the same call plan, the same pool: the same bits
    assert np.any(got != 0) == bool(np.any(coef))  # something computed where any row is routed


def test_the_workers_entry_refuses_what_the_kernel_cannot_take(kernel):
    gate_up, down = stacks("int4")
    h, coef, ids = routing_case(1, 2, D, E, 5)
    weights, _kept = host_weights(gate_up, down, ids)
    with pytest.raises(ValueError, match="multiples of 32"):
        cpu_ffn.run(weights, np.asarray(h), coef, (D, F + 1))
    for groups in [(48, 32), (64, 0), (512, 32)]:  # not a power of two; none; more rows than D
        with pytest.raises(ValueError, match="int4 groups"):
            cpu_ffn.run(dataclasses.replace(weights, groups=groups), np.asarray(h), coef, (D, F))
    with pytest.raises(ValueError, match="bits must be 16, 8 or 4"):
        cpu_ffn.run(dataclasses.replace(weights, bits=5), np.asarray(h), coef, (D, F))


def test_host_weights_join_layers_and_take_picks():
    a = cpu_ffn.HostWeights((1, 2), (3, 4), 8, (5, 6), (7, 8))
    b = cpu_ffn.HostWeights((11, 12), (13, 14), 8, (15, 16), (17, 18))
    both = a + b
    assert both.gate_up == (1, 2, 11, 12) and both.down_scale == (7, 8, 17, 18) and len(both) == 4
    assert both.take([3, 0]) == cpu_ffn.HostWeights((12, 1), (14, 3), 8, (16, 5), (18, 7))
    with pytest.raises(ValueError, match="two formats"):
        a + cpu_ffn.HostWeights((1,), (2,))
    assert [list(x) for x in cpu_ffn.HostWeights((1,), (2,)).address_arrays()] == [[1], [], [2], []]
