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


def test_quantized_weights_copy_every_leaf_in_a_donating_program():
    rng = np.random.default_rng(1)
    dst, src = (quantize(jnp.asarray(rng.standard_normal((s, 128, 256)) * 0.1, jnp.bfloat16), "int4") for s in (4, 6))
    rows, slots = jnp.asarray([5, 2], jnp.int32), jnp.asarray([1, -1], jnp.int32)
    before = jax.tree.map(np.asarray, dst)
    copy = jax.jit(lambda d, s, r, t: row_copy.copy_rows(d, s, r, t, interpret=True), donate_argnums=0)
    got = copy(dst, src, rows, slots)
    np.testing.assert_array_equal(np.asarray(got.q[1]), np.asarray(src.q[5]))
    np.testing.assert_array_equal(np.asarray(got.scale[1]), np.asarray(src.scale[5]))
    for slot in (0, 2, 3):
        np.testing.assert_array_equal(np.asarray(got.q[slot]), before.q[slot])


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
    exported = export.export(jax.jit(row_copy._by_kernel), platforms=["cuda"], disabled_checks=unchecked)(
        q, q, index, index)
    assert "xla.gpu.triton" in exported.mlir_module()
