"""The CPU expert kernel on int8 and int4 experts: against the XLA dequantize path, an exact float64 reference
(weights q * scale) and the bf16 kernel on the dequantized experts; both instruction sets; scales read as float32
or as bf16 (bitwise the same where they hold the same values); skipping; routing and refusals."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pdscope_jax.kernels import cpu_ffn
from pdscope_jax.quant.formats import QuantizedWeight, quantize

from ffn_reference import exact, rel, routing_case

F, E = 160, 10  # F = 5 blocks of 32 (units split unevenly, an odd one left unpaired); down's int4 group is 32
# (scheme, D): int4 groups along D of 64 (D = 256) and 32 (D = 224, an odd multiple of 32)
FORMATS = [("int8", 256), ("int4", 256), ("int4", 224)]


def case(rows: int, k: int, d: int, seed: int):
    return routing_case(rows, k, d, E, seed)


_stacks: dict = {}


def stacks(name: str, d: int):
    """(gate_up, down) QuantizedWeight stacks [E, D, 2F], [E, F, D] (compute dtype bf16), made once."""
    if (name, d) not in _stacks:
        rng = np.random.default_rng(d)
        gate_up = jnp.asarray(rng.standard_normal((E, d, 2 * F)) * 0.06, jnp.bfloat16)
        down = jnp.asarray(rng.standard_normal((E, F, d)) * 0.08, jnp.bfloat16)
        _stacks[name, d] = (quantize(gate_up, name), quantize(down, name))
    return _stacks[name, d]


@pytest.mark.parametrize("name,d", FORMATS)
@pytest.mark.parametrize("rows", [1, 2, 5, 16])
@pytest.mark.parametrize("k", [1, 3, 8])
def test_kernel_matches_xla_dequantize(kernel, name, d, rows, k):
    gate_up, down = stacks(name, d)
    h, coef, ids = case(rows, k, d, seed=rows * 10 + k)
    stacked = cpu_ffn.moe_ffn_cpu(h, coef, gate_up, down, ids, impl="kernel")  # eager
    listed = jax.jit(lambda h, c, g, dn: cpu_ffn.moe_ffn_cpu(h, c, g, dn, impl="kernel"))(
        h, coef, [gate_up[e] for e in ids], [down[e] for e in ids])
    xla = cpu_ffn.moe_ffn_cpu(h, coef, gate_up, down, ids, impl="xla")
    dense = cpu_ffn.moe_ffn_cpu(h, coef, gate_up.dequantize(), down.dequantize(), ids, impl="kernel")
    assert stacked.dtype == jnp.float32 and stacked.shape == (rows, d)
    np.testing.assert_array_equal(np.asarray(stacked), np.asarray(listed))
    # bf16 rounding: the XLA path rounds the dequantized weights and each expert's output, the kernel the act
    assert rel(stacked, xla) < 1e-2
    assert rel(stacked, dense) < 1e-2
    assert rel(stacked, exact(h, coef, gate_up, down, ids)) < 5e-3
    unrouted = ~(coef != 0).any(axis=0)
    assert np.all(np.asarray(stacked)[unrouted] == 0.0)


@pytest.mark.parametrize("name,d", FORMATS)
@pytest.mark.parametrize("rows", [1, 16])
def test_portable_path_matches(kernel, name, d, rows):
    gate_up, down = stacks(name, d)
    h, coef, ids = case(rows, 4, d, seed=rows)
    # calls run asynchronously and read the instruction set when they run: each is finished before it changes
    fast = jax.block_until_ready(cpu_ffn.moe_ffn_cpu(h, coef, gate_up, down, ids, impl="kernel"))
    assert cpu_ffn.set_isa("portable") == "portable"
    try:
        portable = cpu_ffn.moe_ffn_cpu(h, coef, gate_up, down, ids, impl="kernel")
        listed = jax.jit(lambda h, c, g, dn: cpu_ffn.moe_ffn_cpu(h, c, g, dn, impl="kernel"))(
            h, coef, [gate_up[e] for e in ids], [down[e] for e in ids])
        jax.block_until_ready((portable, listed))
    finally:
        cpu_ffn.set_isa(None)
    np.testing.assert_array_equal(np.asarray(portable), np.asarray(listed))
    assert rel(portable, fast) < 1e-5  # the same weights; sums scaled per chunk vs per weight; exp polynomial
    assert rel(portable, exact(h, coef, gate_up, down, ids)) < 5e-3


def scaled(w, dtype):
    return QuantizedWeight(w.q, w.scale.astype(dtype), w.scheme, w.dtype)


@pytest.mark.parametrize("name,d", FORMATS)
@pytest.mark.parametrize("isa", ["portable", None])
@pytest.mark.parametrize("rows", [1, 6])
def test_bf16_scales_in_the_program_give_the_bits_of_float32_ones(kernel, name, d, isa, rows):
    """The handlers read bf16 scales where they lie (no float32 copy in the program): bitwise what the same scales
    as float32 give (bf16 -> float32 is exact), stacked and listed, on either path; and the XLA path's numbers."""
    gate_up, down = (scaled(w, jnp.bfloat16) for w in stacks(name, d))  # int8: its scales rounded to bf16 first
    wide = [scaled(w, jnp.float32) for w in (gate_up, down)]
    h, coef, ids = case(rows, 4, d, seed=3 * rows)
    listed = jax.jit(lambda h, c, g, dn: cpu_ffn.moe_ffn_cpu(h, c, g, dn, impl="kernel"))
    outs = []
    cpu_ffn.set_isa(isa)
    try:
        for gu, dn in ((gate_up, down), wide):  # each call finished before the instruction set changes
            outs.append(jax.block_until_ready(cpu_ffn.moe_ffn_cpu(h, coef, gu, dn, ids, impl="kernel")))
            outs.append(jax.block_until_ready(listed(h, coef, [gu[e] for e in ids], [dn[e] for e in ids])))
    finally:
        cpu_ffn.set_isa(None)
    for out in outs[1:]:
        np.testing.assert_array_equal(np.asarray(out), np.asarray(outs[0]))
    assert rel(outs[0], cpu_ffn.moe_ffn_cpu(h, coef, gate_up, down, ids, impl="xla")) < 1e-2
    assert rel(outs[0], exact(h, coef, gate_up, down, ids)) < 5e-3


def test_scales_of_two_types_in_one_call_are_widened_to_float32(kernel):
    """One expert's float32 scales among bf16 ones (one call reads one type): the program widens them all, and
    the result is what all bf16 gives."""
    gate_up, down = stacks("int4", 256)
    h, coef, ids = case(3, 3, 256, seed=5)
    gus, dns = [gate_up[e] for e in ids], [down[e] for e in ids]
    mixed = [scaled(gus[0], jnp.float32), *gus[1:]]
    assert gus[1].scale.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(cpu_ffn.moe_ffn_cpu(h, coef, mixed, dns, impl="kernel")),
                                  np.asarray(cpu_ffn.moe_ffn_cpu(h, coef, gus, dns, impl="kernel")))


@pytest.mark.parametrize("name,d", FORMATS)
@pytest.mark.parametrize("rows", [1, 2, 3, 4])
def test_few_row_kernels_match_the_unit_kernels(kernel, name, d, rows):
    """Experts of at most 4 routed rows take the few-row kernels (csrc/ffn_quant.h) where set_quant_rows lets their
    format (int4 by default), else the unit kernels: each row count, every row routed to every expert but the last."""
    gate_up, down = stacks(name, d)
    bits = gate_up.scheme.bits
    h, coef, ids = case(rows, 5, d, seed=40 + rows)
    coef[:-1] = np.random.default_rng(rows).random((4, rows)).astype(np.float32) + 0.1
    before = cpu_ffn.set_quant_rows(-1, bits)
    assert before == (4 if bits == 4 else 0)  # the defaults
    # calls read the setting when they run: each is finished before it changes
    try:
        assert cpu_ffn.set_quant_rows(4, bits) == 4
        few = jax.block_until_ready(cpu_ffn.moe_ffn_cpu(h, coef, gate_up, down, ids, impl="kernel"))
        assert cpu_ffn.set_quant_rows(0, bits) == 0
        units = jax.block_until_ready(cpu_ffn.moe_ffn_cpu(h, coef, gate_up, down, ids, impl="kernel"))
    finally:
        cpu_ffn.set_quant_rows(before, bits)
    assert rel(few, units) < 1e-5  # the same weights, float32 sums in another order
    assert rel(few, exact(h, coef, gate_up, down, ids)) < 5e-3


@pytest.mark.parametrize("name", ["int8", "int4"])
@pytest.mark.parametrize("isa", ["portable", None])
def test_skipped_experts_and_rows_are_not_read(kernel, name, isa):
    """An expert no row is routed to reads none of its bytes: NaN scales there leave the output finite."""
    gate_up, down = stacks(name, 256)
    h, coef, _ = case(3, 3, 256, seed=2)
    coef[1] = 0.0
    poisoned = [QuantizedWeight(w[1].q, jnp.full(w[1].scale.shape, jnp.nan), w.scheme, w.dtype)
                for w in (gate_up, down)]
    gus, dns = [gate_up[0], poisoned[0], gate_up[2]], [down[0], poisoned[1], down[2]]
    cpu_ffn.set_isa(isa)
    try:
        out = np.asarray(cpu_ffn.moe_ffn_cpu(h, coef, gus, dns, impl="kernel"))
    finally:
        cpu_ffn.set_isa(None)
    assert np.all(np.isfinite(out))
    keep = [0, 2]
    want = exact(h, coef[keep], gate_up, down, keep)
    assert rel(out, want) < 5e-3


def test_auto_routes_quantized_experts(kernel):
    gate_up, down = stacks("int8", 256)
    h, coef, ids = case(4, 3, 256, seed=4)
    gus, dns = [gate_up[e] for e in ids], [down[e] for e in ids]
    assert cpu_ffn.kernel_supports(h, gus[0]) and cpu_ffn.kernel_supports(h, gus[0], dns[0])
    auto = cpu_ffn.moe_ffn_cpu(h, coef, gus, dns)
    if cpu_ffn.available():
        np.testing.assert_array_equal(np.asarray(auto), np.asarray(cpu_ffn.moe_ffn_cpu(h, coef, gus, dns,
                                                                                         impl="kernel")))
    else:
        np.testing.assert_array_equal(np.asarray(auto), np.asarray(cpu_ffn.moe_ffn_xla(h, coef, gus, dns)))


def test_float32_compute_dtype_uses_xla_and_kernel_refuses(kernel):
    gate_up, down = stacks("int4", 256)
    h, coef, ids = case(3, 2, 256, seed=6)
    gu32, dn32 = (QuantizedWeight(w.q, w.scale, w.scheme, jnp.float32) for w in (gate_up, down))
    assert not cpu_ffn.kernel_supports(h, gu32)
    auto = cpu_ffn.moe_ffn_cpu(h, coef, gu32, dn32, ids)
    np.testing.assert_array_equal(np.asarray(auto), np.asarray(cpu_ffn.moe_ffn_xla(h, coef, gu32, dn32, ids)))
    assert rel(auto, exact(h, coef, gate_up, down, ids)) < 1e-2
    with pytest.raises(ValueError, match="int4 .compute float32"):
        cpu_ffn.moe_ffn_cpu(h, coef, gu32, dn32, ids, impl="kernel")


def test_mixed_dense_and_quantized_is_refused():
    gate_up, down = stacks("int8", 256)
    h, coef, ids = case(2, 2, 256, seed=8)
    with pytest.raises(ValueError, match="all dense arrays or all QuantizedWeights"):
        cpu_ffn.moe_ffn_cpu(h, coef, [gate_up[e] for e in ids], [down[e].dequantize() for e in ids])
    int4_down = stacks("int4", 256)[1]
    with pytest.raises(ValueError, match="of one scheme"):
        cpu_ffn.moe_ffn_cpu(h, coef, gate_up, int4_down, ids)


def test_auto_falls_back_to_xla_without_the_library(monkeypatch):
    gate_up, down = stacks("int4", 224)
    h, coef, ids = case(3, 3, 224, seed=12)
    want = jax.jit(cpu_ffn.moe_ffn_xla)(h, coef, gate_up, down, ids)
    monkeypatch.setattr(cpu_ffn, "library", lambda: None)  # as where no library could be built
    got = jax.jit(lambda h, c, i, g, dn: cpu_ffn.moe_ffn_cpu(h, c, g, dn, i))(h, coef, ids, gate_up, down)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert rel(got, exact(h, coef, gate_up, down, ids)) < 1e-2
    with pytest.raises(RuntimeError, match="not built"):
        cpu_ffn.moe_ffn_cpu(h, coef, gate_up, down, ids, impl="kernel")
