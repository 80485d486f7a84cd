"""The row copy kernel, run through Pallas' interpreter on the CPU backend, and its XLA path: rows land in their
slots, slots out of range are skipped, the other slots keep their values; quantized weights copy every leaf."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pdscope_jax.kernels import row_copy
from pdscope_jax.quant.formats import quantize


@pytest.mark.parametrize("interpret", [True, False])
def test_rows_land_in_their_slots_and_the_rest_stay(interpret):
    rng = np.random.default_rng(0)
    dst = jnp.asarray(rng.standard_normal((5, 64, 256)), jnp.bfloat16)
    src = jnp.asarray(rng.standard_normal((9, 64, 256)), jnp.bfloat16)
    rows, slots = jnp.asarray([3, 7, 1, 2], jnp.int32), jnp.asarray([4, -1, 0, 5], jnp.int32)  # -1, 5: skipped
    got = np.asarray(row_copy.copy_rows(dst, src, rows, slots, interpret=interpret))
    expected = np.array(dst)
    expected[4], expected[0] = np.asarray(src[3]), np.asarray(src[1])
    np.testing.assert_array_equal(got, expected)


def test_a_banks_quantized_leaves_copy_in_one_donating_program():
    """A bank's (gate_up, down), int4: every leaf (packed values, scales; rows of different sizes) in one call."""
    rng = np.random.default_rng(1)

    def bank(slots):
        return tuple(quantize(jnp.asarray(rng.standard_normal((slots, k, n)) * 0.1, jnp.bfloat16), "int4")
                     for k, n in ((128, 256), (64, 128)))

    dst, src = bank(4), bank(6)
    rows, slots = jnp.asarray([5, 2, 0], jnp.int32), jnp.asarray([1, -1, 3], jnp.int32)
    before = jax.tree.map(np.asarray, dst)
    copy = jax.jit(lambda d, s, r, t: row_copy.copy_rows(d, s, r, t, interpret=True), donate_argnums=0)
    got = copy(dst, src, rows, slots)
    for got_leaf, src_leaf, old in zip(jax.tree.leaves(got), jax.tree.leaves(src), jax.tree.leaves(before)):
        np.testing.assert_array_equal(np.asarray(got_leaf[1]), np.asarray(src_leaf[5]))
        np.testing.assert_array_equal(np.asarray(got_leaf[3]), np.asarray(src_leaf[0]))
        for slot in (0, 2):
            np.testing.assert_array_equal(np.asarray(got_leaf[slot]), old[slot])


def test_mismatched_stacks_are_refused_and_odd_rows_take_xla():
    dst = jnp.zeros((3, 64, 256), jnp.bfloat16)
    with pytest.raises(ValueError, match="differ past their first axis"):
        row_copy.copy_rows(dst, jnp.zeros((3, 64, 128), jnp.bfloat16), jnp.zeros(1, jnp.int32), jnp.zeros(1, jnp.int32))
    assert row_copy.supported(dst) and not row_copy.supported(jnp.zeros((3, 3, 5)))
    odd = row_copy.copy_rows(jnp.zeros((3, 3, 5)), jnp.ones((2, 3, 5)), jnp.asarray([1]), jnp.asarray([2]))
    np.testing.assert_array_equal(np.asarray(odd).sum(axis=(1, 2)), [0, 0, 15])


def test_the_kernel_lowers_to_triton_for_cuda_here():
    from jax import export

    q = jax.ShapeDtypeStruct((8, 1024, 1536), jnp.uint8)
    index = jax.ShapeDtypeStruct((4,), jnp.int32)
    unchecked = [export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    scale = jax.ShapeDtypeStruct((8, 32, 1536), jnp.bfloat16)
    exported = export.export(jax.jit(row_copy._by_kernel), platforms=["cuda"], disabled_checks=unchecked)(
        (q, scale), (q, scale), index, index)
    assert "xla.gpu.triton" in exported.mlir_module()
