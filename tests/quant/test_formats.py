"""The int8 and int4 formats: exact packing, the error each scheme promises, and QuantizedWeight acting as the
dense array it stands for (shape, indexing, moving, inside jit); a scheme's stored bytes without jax imported."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pdscope_jax.quant.formats import (SCHEMES, QuantizedWeight, dense, matmul, pack_int4, quantize, scheme,
                                       unpack_int4, zeros)


def test_int4_packing_round_trips_every_value():
    values = jnp.asarray(np.arange(-8, 8, dtype=np.int8).repeat(6).reshape(-1, 3)[:32])  # [32, 3], all 16 values
    packed = pack_int4(values)
    assert packed.dtype == jnp.uint8 and packed.shape == (16, 3)
    np.testing.assert_array_equal(unpack_int4(packed), values)
    low, high = int(packed[0, 0]) & 0xF, int(packed[0, 0]) >> 4  # row 0 low nibble, row 1 high
    assert (low ^ 8) - 8 == int(values[0, 0]) and (high ^ 8) - 8 == int(values[1, 0])


@pytest.mark.parametrize("name, bound", [("int8", 0.01), ("int4", 0.12)])
def test_relative_error_of_a_gaussian_matrix(name, bound):
    w = jax.random.normal(jax.random.key(0), (2, 128, 96)) * 0.02
    qw = quantize(w, name)
    err = float(jnp.linalg.norm(qw.dequantize() - w) / jnp.linalg.norm(w))
    assert 0 < err < bound
    # symmetric int8 is exact at each column's largest magnitude; int4 maps each group's extreme to -8 exactly
    extreme = jnp.max(jnp.abs(w), axis=-2)
    rounding = 1e-6 if name == "int8" else 2.0**-8  # int4's scales are bf16
    np.testing.assert_allclose(jnp.max(jnp.abs(qw.dequantize()), axis=-2), extreme, rtol=rounding)


def test_int4_groups_follow_the_contraction_size():
    assert quantize(jnp.ones((128, 8)), "int4").scale.shape == (2, 8)  # groups of 64
    assert quantize(jnp.ones((96, 8)), "int4").scale.shape == (3, 8)  # 96 = 3 x 32
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize(jnp.ones((48, 8)), "int4")
    with pytest.raises(ValueError, match="unknown quantization 'int3'.*int8, int4"):
        scheme("int3")


@pytest.mark.parametrize("name", list(SCHEMES))
def test_quantized_weight_acts_as_its_dense_array(name):
    w = jax.random.normal(jax.random.key(1), (4, 64, 32), jnp.float32)
    qw = quantize(w, name, jnp.bfloat16)
    assert qw.shape == (4, 64, 32) and qw.dtype == jnp.bfloat16 and qw.ndim == 3
    assert qw.nbytes == qw.q.nbytes + qw.scale.nbytes < 2 * w.size  # fewer bytes than bf16
    one = qw[2]
    assert isinstance(one, QuantizedWeight) and one.shape == (64, 32)
    np.testing.assert_array_equal(one.dequantize(), qw.dequantize()[2])
    picked = jax.jit(lambda q, i: dense(q[i]))(qw, jnp.array([3, 0]))  # a pytree argument, indexed in jit
    np.testing.assert_array_equal(picked, qw.dequantize()[jnp.array([3, 0])])
    moved = jax.device_put(qw, jax.devices()[1])
    assert {leaf.devices().pop() for leaf in jax.tree.leaves(moved)} == {jax.devices()[1]}
    assert dense(w) is w
    empty = zeros((3,), 64, 32, name, jnp.float32)
    assert empty.shape == (3, 64, 32) and not np.any(empty.dequantize())


def test_a_quantized_configs_bytes_need_no_prior_jax_import():
    """`ModelConfig.expert_bytes` of an int4 scheme (bfloat16 scales) in a process that imported nothing else."""
    import subprocess
    import sys

    code = ("import sys; from pdscope_jax.presets import preset; "
            "print(preset('deepseek-v2-lite').replace(expert_quant='int4').expert_bytes()); "
            "print('jax' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    nbytes, jax_loaded = proc.stdout.split()
    # gate_up [2048, 2816] and down [1408, 2048]: half a byte per weight, a bfloat16 scale per 64 rows
    assert int(nbytes) == 2048 * 2816 // 2 + 2 * 2048 // 64 * 2816 + 1408 * 2048 // 2 + 2 * 1408 // 64 * 2048
    assert jax_loaded == "False"


@pytest.mark.parametrize("name", [None, "int8", "int4"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_matmul_is_the_product_with_the_dense_matrix(name, dtype):
    """quant.formats.matmul: x @ dense(w) in float32, batched as jnp.matmul; int4 through its two halves of rows."""
    rng = np.random.default_rng(5)
    w = jnp.asarray(rng.standard_normal((3, 192, 128)), dtype)  # int4: groups of 64, three a matrix
    w = w if name is None else quantize(w, name)
    x = jnp.asarray(rng.standard_normal((3, 5, 192)), jnp.float32)
    got = matmul(x, w)
    want = np.asarray(x.astype(dtype).astype(jnp.float32), np.float64) @ np.asarray(
        dense(w).astype(jnp.float32), np.float64)
    assert got.shape == (3, 5, 128) and got.dtype == jnp.float32
    assert np.abs(np.asarray(got, np.float64) - want).max() / np.abs(want).max() < 1e-6
    assert matmul(x[0], w[0]).shape == (5, 128)  # one matrix


def test_int4_matmul_writes_no_interleaved_copy():
    """The int4 product's program dequantizes the two halves of rows apart: no concatenate of the whole matrix."""
    w = quantize(jnp.ones((4, 256, 128), jnp.bfloat16), "int4")
    text = jax.jit(matmul).lower(jnp.ones((4, 8, 256), jnp.bfloat16), w).as_text()
    assert "concatenate" not in text
    assert "concatenate" in jax.jit(lambda x, w: x @ dense(w)).lower(jnp.ones((4, 8, 256), jnp.bfloat16), w).as_text()
