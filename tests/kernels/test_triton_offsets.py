"""The Triton lowering's offsets widened for operands of 2^31 elements or more within 4 GiB (`triton_offsets`):
which operands, how the wrap describes them, and that the kernels over such a slot pool lower for CUDA here."""

import jax
import jax.numpy as jnp
import pytest
from jax._src import core
from jax._src.pallas.triton import lowering

from pdscope_jax.kernels import gather_matvec as gm
from pdscope_jax.kernels import row_copy, triton_offsets
from pdscope_jax.quant.formats import quantize


@pytest.mark.parametrize("shape, dtype, wide", [
    ((1664, 704, 2048), jnp.uint8, True),  # an int4 pool's packed down projections, 2.4 GB
    ((3322, 384, 2048), jnp.uint8, True),  # Qwen3-30B-A3B's at a 16 GB budget, 2.6 GB
    ((2**30, 2), jnp.bfloat16, True),  # exactly 4 GiB
    ((1365, 1024, 1536), jnp.uint8, False),  # just under 2^31 elements
    ((3322, 1024, 1536), jnp.uint8, False),  # 5.2 GB: the lowering's own 64-bit offsets
    ((1664, 1408, 2048), jnp.bfloat16, False),  # 9.6 GB
])
def test_which_operands_need_wide_offsets(shape, dtype, wide):
    assert triton_offsets.needs_wide(shape, dtype) == wide


def test_the_wrap_doubles_only_a_wide_operands_first_axis():
    def info(shape, dtype):
        return lowering.BlockInfo(core.ShapedArray(shape, dtype), (None,) * len(shape), (1,) * len(shape),
                                  shape)
    wide, small = info((3322, 384, 2048), jnp.uint8), info((64, 384, 2048), jnp.uint8)
    got = triton_offsets.described(wide).full_shape_dtype
    assert got.shape == (6644, 384, 2048) and got.dtype == jnp.uint8  # past 4 GiB; the strides (384 x 2048, 2048)
    assert triton_offsets.described(small) is small
    assert triton_offsets.install() and lowering._compute_offsets_from_indices.__wrapped__ is not None


def _pool(slots: int, scheme: str):
    """A quantized slot pool's down stack as shapes: Qwen3-30B-A3B's expert (768 x 2048)."""
    return jax.eval_shape(lambda: quantize(jnp.ones((slots, 768, 2048), jnp.bfloat16), scheme))


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_kernels_over_a_pool_of_2_to_4_gb_lower_for_cuda_here(scheme):
    """Without the wrap the matvec kernel refused these pools (a gathered copy instead) and the row copy would have
    written wrapped addresses; the GPU check of the values is benchmarks/probes/probe_wide_offsets.py."""
    from jax import export

    slots = 3322 if scheme == "int4" else 2000
    w = _pool(slots, scheme)
    assert any(triton_offsets.needs_wide(leaf.shape, leaf.dtype) for leaf in jax.tree.leaves(w))
    assert gm.addressable(w) and row_copy.supported(w)
    x, idx = jax.ShapeDtypeStruct((6, 768), jnp.bfloat16), jax.ShapeDtypeStruct((6,), jnp.int32)
    unchecked = [export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    exported = export.export(jax.jit(gm.gather_matvec), platforms=["cuda"], disabled_checks=unchecked)(x, w, idx)
    assert "xla.gpu.triton" in exported.mlir_module()
    host = _pool(128, scheme)
    copy = export.export(jax.jit(row_copy._by_kernel), platforms=["cuda"], disabled_checks=unchecked)(
        w, host, idx, idx)
    assert "xla.gpu.triton" in copy.mlir_module()
