"""The CUDA bridge's pieces that run without a GPU: its library builds (it reaches CUDA only through the
driver at run time), it declines a non-CUDA accelerator with the reason, and its worker's entry into the CPU
kernel (`cpu_ffn.run`) computes what the kernel's FFI handler does, on bf16, int8 and int4 experts, reading
their scales as stored (float32 or bf16: bf16 ones give the bits of their float32 copy)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pdscope_jax.kernels import build, cpu_ffn, host_experts
from pdscope_jax.quant.formats import QuantizedWeight, quantize

from ffn_reference import rel, routing_case

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


def with_scales(w, dtype):
    """QuantizedWeight w with its scales cast to `dtype` (float32 -> bf16 rounds, bf16 -> float32 is exact)."""
    return QuantizedWeight(w.q, w.scale.astype(dtype), w.scheme, w.dtype)


def host_weights(gate_up, down, ids):
    """The picks' HostWeights over numpy copies of the stacks (quantized: their scales in the stacks' dtype), and
    the copies (kept alive while the addresses are used)."""
    if not hasattr(gate_up, "q"):
        arrays = [np.asarray(gate_up), np.asarray(down)]
        gu, dn = arrays
        return cpu_ffn.HostWeights(tuple(gu[i].ctypes.data for i in ids), tuple(dn[i].ctypes.data for i in ids)), arrays
    arrays = [np.asarray(a) for w in (gate_up, down) for a in (w.q, w.scale)]
    gq, gs, dq, ds = arrays
    at = lambda a: tuple(a[i].ctypes.data for i in ids)  # noqa: E731
    groups = (D // gs.shape[1], F // ds.shape[1])
    scale_bits = {np.dtype(np.float32): 32, np.dtype(jnp.bfloat16): 16}[gs.dtype]
    return cpu_ffn.HostWeights(at(gq), at(dq), gate_up.scheme.bits, at(gs), at(ds), groups, scale_bits), arrays


# (format, scales): int8 stores float32 scales, int4 bf16 ones; each also with the other type
CASES = [("bf16", None), ("int8", jnp.float32), ("int8", jnp.bfloat16), ("int4", jnp.bfloat16), ("int4", jnp.float32)]


def quantized_stacks(name: str, scales):
    gate_up, down = stacks(name)
    return (gate_up, down) if scales is None else (with_scales(gate_up, scales), with_scales(down, scales))


@pytest.mark.parametrize("name, scales", CASES)
@pytest.mark.parametrize("rows, k", [(1, 1), (1, 6), (4, 3)])
def test_the_workers_entry_computes_what_the_kernel_handler_does(kernel, name, scales, rows, k):
    gate_up, down = quantized_stacks(name, scales)
    h, coef, ids = routing_case(rows, k, D, E, rows + k)
    want = np.asarray(cpu_ffn.moe_ffn_cpu(h, jnp.asarray(coef), gate_up, down, jnp.asarray(ids), impl="kernel"))
    weights, _kept = host_weights(gate_up, down, ids)
    assert weights.scale_bits == (16 if scales == jnp.bfloat16 else 32)
    got = cpu_ffn.run(weights, np.asarray(h), coef, (D, F))
    np.testing.assert_array_equal(got, want)  # the same call plan, the same pool: the same bits
    assert np.any(got != 0) == bool(np.any(coef))  # something computed where any row is routed


@pytest.mark.parametrize("name", ["int8", "int4"])
@pytest.mark.parametrize("isa", ["portable", None])
@pytest.mark.parametrize("rows, k", [(1, 6), (5, 3)])
def test_bf16_scales_give_the_bits_of_their_float32_copy(kernel, name, isa, rows, k):
    """Scales read as bf16 where they lie and the same scales as a float32 copy: bitwise the same output (bf16 ->
    float32 is exact, and nothing else differs), on either path; both match the XLA dequantize path."""
    gate_up, down = quantized_stacks(name, jnp.bfloat16)  # int8: its scales rounded to bf16 first
    wide = [with_scales(w, jnp.float32) for w in (gate_up, down)]
    h, coef, ids = routing_case(rows, k, D, E, 7 * rows + k)
    narrow, _kept = host_weights(gate_up, down, ids)
    widened, _kept_too = host_weights(*wide, ids)
    assert (narrow.scale_bits, widened.scale_bits) == (16, 32)
    xla = np.asarray(cpu_ffn.moe_ffn_cpu(h, jnp.asarray(coef), gate_up, down, jnp.asarray(ids), impl="xla"))
    fast = cpu_ffn.run(narrow, np.asarray(h), coef, (D, F))
    cpu_ffn.set_isa(isa)
    try:
        got, want = (cpu_ffn.run(w, np.asarray(h), coef, (D, F)) for w in (narrow, widened))
    finally:
        cpu_ffn.set_isa(None)
    np.testing.assert_array_equal(got, want)
    assert rel(got, xla) < 1e-2  # bf16 rounding of the dequantized weights and outputs on the XLA side
    assert rel(got, fast) < 1e-5  # portable against AVX-512: sums scaled per chunk vs per weight
    assert np.any(got != 0)


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
    with pytest.raises(ValueError, match="scale_bits must be 32 .float32. or 16 .bf16."):
        cpu_ffn.run(dataclasses.replace(weights, scale_bits=8), np.asarray(h), coef, (D, F))


def test_host_weights_join_layers_and_take_picks():
    a = cpu_ffn.HostWeights((1, 2), (3, 4), 8, (5, 6), (7, 8))
    b = cpu_ffn.HostWeights((11, 12), (13, 14), 8, (15, 16), (17, 18))
    both = a + b
    assert both.gate_up == (1, 2, 11, 12) and both.down_scale == (7, 8, 17, 18) and len(both) == 4
    assert both.take([3, 0]) == cpu_ffn.HostWeights((12, 1), (14, 3), 8, (16, 5), (18, 7))
    with pytest.raises(ValueError, match="two formats"):
        a + cpu_ffn.HostWeights((1,), (2,))
    with pytest.raises(ValueError, match="two formats"):
        a + dataclasses.replace(b, scale_bits=16)  # one call reads one type of scales
    assert dataclasses.replace(a, scale_bits=16).take([1]).scale_bits == 16
    assert [list(x) for x in cpu_ffn.HostWeights((1,), (2,)).address_arrays()] == [[1], [], [2], []]
