"""The GPU gather-matvec kernel, run through Pallas' interpreter on the CPU backend, against exact references;
and the model paths that use it on a GPU (experts, few-row Linear) against their XLA paths."""

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from pdscope_jax.kernels import gather_matvec as gm
from pdscope_jax.models import experts as ex
from pdscope_jax.models.layers import DenseMLP, Linear
from pdscope_jax.quant.formats import QuantizedWeight, quantize
from tests.kernels.ffn_reference import rel


def reference(x, w, idx):
    """float64 x[a] (rounded to w's dtype) @ w[idx[a]] (quantized: its exact values, dequantized in float32)."""
    xw = np.asarray(jnp.asarray(x).astype(w.dtype).astype(jnp.float32), np.float64)
    dense = w.dequantize(jnp.float32) if isinstance(w, QuantizedWeight) else jnp.asarray(w)
    wf = np.asarray(dense.astype(jnp.float32), np.float64)
    return np.einsum("ak,akn->an", xw, wf[np.asarray(idx)])


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("rows,k,n", [(1, 256, 384), (6, 128, 128), (3, 512, 256)])
def test_matches_the_exact_product(dtype, rows, k, n):
    rng = np.random.default_rng(rows * k + n)
    w = jnp.asarray(rng.standard_normal((5, k, n)), dtype)
    x = jnp.asarray(rng.standard_normal((rows, k)), jnp.float32)
    idx = jnp.asarray(rng.integers(0, 5, rows), jnp.int32)
    got = gm.gather_matvec(x, w, idx, interpret=True)
    assert got.shape == (rows, n) and got.dtype == jnp.float32
    assert rel(got, reference(x, w, idx)) < 1e-6


@pytest.mark.parametrize("scheme", ["int8", "int4"])
@pytest.mark.parametrize("k", [256, 96])  # int4 groups of 64, and of 32 (K an odd multiple of 32)
def test_quantized_weights_match_their_dequantized_product(scheme, k):
    rng = np.random.default_rng(k)
    w = quantize(jnp.asarray(rng.standard_normal((4, k, 256)) * 0.05, jnp.bfloat16), scheme)
    x = jnp.asarray(rng.standard_normal((3, k)), jnp.bfloat16)
    idx = jnp.asarray([3, 0, 3], jnp.int32)
    if scheme == "int8" and k % 64:
        assert not gm.supported(3, k, 256, w.dtype, w.scheme)
        return
    got = gm.gather_matvec(x, w, idx, interpret=True)
    assert rel(got, reference(x, w, idx)) < 1e-6


def test_k_is_cut_by_any_divisor_up_to_the_grids_target():
    assert gm._splits(6, 22, 16) == 22  # an int4 down projection's 22 groups: 2,112 programs, not 192
    assert gm._splits(6, 32, 22) == 16  # a gate_up: the power of two it always took
    assert gm._splits(6, 22, 16, programs=1000) == 2  # 11 parts would pass the target
    assert gm._splits(64, 7, 64) == 1  # a grid already over the target is not cut


def test_splitting_k_keeps_the_sum():
    """One row over a long K is cut into parts (more programs); their partial sums add to the product."""
    k_blocks = 2048 // gm._block_k(jnp.bfloat16)
    assert gm._splits(1, k_blocks, 1) > 1
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.standard_normal((2, 2048, 128)), jnp.bfloat16)
    x = jnp.asarray(rng.standard_normal((1, 2048)), jnp.bfloat16)
    idx = jnp.asarray([1], jnp.int32)
    assert rel(gm.gather_matvec(x, w, idx, interpret=True), reference(x, w, idx)) < 1e-6


@pytest.mark.parametrize("tiles", [gm.Tiles(block_n=64, block_k=32, programs=64, num_warps=8, num_stages=2),
                                   gm.Tiles(block_n=256, block_k=128, programs=2048)])
def test_other_tiles_keep_the_product(tiles):
    """Tiles only cut the work differently: dense and int8 weights give the exact product under other cuts; a
    cut that does not divide the shape is refused."""
    rng = np.random.default_rng(1)
    dense = jnp.asarray(rng.standard_normal((3, 512, 256)), jnp.bfloat16)
    x = jnp.asarray(rng.standard_normal((2, 512)), jnp.float32)
    idx = jnp.asarray([2, 0], jnp.int32)
    for w in (dense, quantize(dense, "int8")):
        assert rel(gm.gather_matvec(x, w, idx, interpret=True, tiles=tiles), reference(x, w, idx)) < 1e-6
    with pytest.raises(ValueError, match="unsupported shapes"):
        gm.gather_matvec(x[:, :480], dense[:, :480], idx, interpret=True, tiles=tiles._replace(block_k=96))


def test_unsupported_shapes_are_refused():
    assert not gm.supported(1, 100, 128, jnp.bfloat16)  # K not a multiple of the K tile
    assert not gm.supported(1, 128, 100, jnp.bfloat16)  # N not a multiple of the N tile
    assert not gm.supported(gm.MAX_ROWS + 1, 128, 128, jnp.bfloat16)
    assert not gm.supported(1, 128, 128, jnp.int8)
    with pytest.raises(ValueError, match="unsupported shapes"):
        gm.gather_matvec(jnp.ones((1, 100)), jnp.ones((1, 100, 128)), jnp.zeros(1, jnp.int32), interpret=True)


def test_on_gpu_runs_the_xla_path_on_the_cpu_and_when_disabled(monkeypatch):
    """Both branches are traced; the CPU backend lowers and runs only the default one."""
    def kernel_fn(x):
        return x + 100

    assert float(jax.jit(lambda x: gm.on_gpu(kernel_fn, lambda x: x + 2, x))(1.0)) == 3.0
    monkeypatch.setattr(gm, "ENABLED", False)
    traced = []
    assert float(gm.on_gpu(lambda x: traced.append(1) or x, lambda x: x * 2, 2.0)) == 4.0
    assert not traced  # disabled: the kernel branch is not even traced


def test_a_kernel_that_does_not_compile_leaves_the_xla_path_with_a_warning(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("Triton lowering failed")

    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(gm, "gather_matvec", type("Broken", (), {"lower": staticmethod(broken)}))
    gm.compiles_here.cache_clear()
    try:
        with pytest.warns(RuntimeWarning, match="PDSCOPE_GPU_KERNELS=0"):
            assert float(gm.on_gpu(lambda x: x + 100, lambda x: x + 2, 1.0)) == 3.0
        with warnings.catch_warnings(record=True) as later:
            warnings.simplefilter("always")
            assert float(gm.on_gpu(lambda x: x + 100, lambda x: x + 2, 1.0)) == 3.0
        assert not later  # checked once per process: no second compile, no second warning
    finally:
        gm.compiles_here.cache_clear()


def test_the_compile_check_works_inside_a_traced_program(monkeypatch):
    """on_gpu runs while the model's program is traced: the check must lower on shapes, not on tracers (a tracer
    would make it fail and turn the kernel off on every GPU)."""
    lowered = []

    @jax.jit
    def stand_in(x, w, idx):  # compiles on the CPU, like the kernel on a GPU
        lowered.append(jax.tree.map(lambda leaf: type(leaf).__name__, (x, w, idx)))
        return jnp.zeros((x.shape[-2], jax.tree.leaves(w)[0].shape[-1]), jnp.float32)

    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    for name in KERNEL_CALLS:
        monkeypatch.setattr(gm, name, stand_in)
    gm.compiles_here.cache_clear()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert float(jax.jit(lambda v: gm.on_gpu(lambda v: v + 100, lambda v: v + 2, v))(1.0)) == 3.0
        assert gm.compiles_here() and len(lowered) == 7  # bf16, int8, int4 weights, each with the activation; a pair
    finally:
        gm.compiles_here.cache_clear()


KERNEL_CALLS = ("gather_matvec", "matvec_parts", "swiglu_matvec")


@pytest.fixture
def kernel_everywhere(monkeypatch):
    """The kernel paths chosen on any backend, the kernel run by the interpreter: what a GPU would run. Gives the
    list of kernel calls made, as (function, its weights' shapes)."""
    calls = []
    for name in KERNEL_CALLS:
        def interpreted(x, w, idx, _name=name, _kernel=getattr(gm, name), **kwargs):
            calls.append((_name, tuple(v.shape for v in (w if isinstance(w, (tuple, list)) else (w,)))))
            kwargs.pop("interpret", None)
            return _kernel(x, w, idx, interpret=True, **kwargs)

        monkeypatch.setattr(gm, name, interpreted)
    monkeypatch.setattr(gm, "on_gpu", lambda kernel_fn, xla_fn, *args: kernel_fn(*args))
    return calls


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_expert_paths_agree_with_xla(dtype, kernel_everywhere, dense_fused):
    rng = np.random.default_rng(1)
    d, f, s = 128, 64, 7
    gate_up = jnp.asarray(rng.standard_normal((s, d, 2 * f)) * 0.1, dtype)
    down = jnp.asarray(rng.standard_normal((s, f, d)) * 0.1, dtype)
    x = jnp.asarray(rng.standard_normal((6, d)), dtype)
    picks = jnp.asarray(rng.integers(0, s, 6), jnp.int32)
    assert ex._kernel_takes(6, gate_up, down)
    xla = jax.vmap(lambda xa, gu, dn: ex.expert_ffn(xa[None], gu, dn)[0])(x, gate_up[picks], down[picks])
    got = ex.picked_experts_ffn(x, gate_up, down, picks)
    tol = 1e-2 if dtype == jnp.bfloat16 else 1e-6  # bf16: the output is rounded to bf16 after sums in two orders
    assert got.dtype == dtype and rel(got, xla) < tol
    assert kernel_everywhere[1][0] == ("swiglu_matvec" if dense_fused else "gather_matvec")
    rows = jnp.asarray(rng.standard_normal((3, 2, d)), dtype)
    stacked = ex.stacked_experts_ffn(rows, gate_up[:3], down[:3])
    assert rel(stacked, jax.vmap(ex.expert_ffn)(rows, gate_up[:3], down[:3])) < tol


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_quantized_expert_paths_agree_with_xla(scheme, fused, kernel_everywhere, monkeypatch):
    monkeypatch.setattr(gm, "FUSED_ACTIVATION", frozenset({scheme} if fused else ()))
    rng = np.random.default_rng(3)
    d, f, s = 128, 64, 5
    gate_up = quantize(jnp.asarray(rng.standard_normal((s, d, 2 * f)) * 0.1, jnp.bfloat16), scheme)
    down = quantize(jnp.asarray(rng.standard_normal((s, f, d)) * 0.1, jnp.bfloat16), scheme)
    x = jnp.asarray(rng.standard_normal((4, d)), jnp.bfloat16)
    picks = jnp.asarray([4, 1, 1, 0], jnp.int32)
    assert ex._kernel_takes(4, gate_up, down)
    xla = jax.vmap(lambda xa, gu, dn: ex.expert_ffn(xa[None], gu, dn)[0])(x, gate_up[picks], down[picks])
    assert rel(ex.picked_experts_ffn(x, gate_up, down, picks), xla) < 1e-2
    assert kernel_everywhere[1][0] == ("swiglu_matvec" if fused else "gather_matvec")
    rows = jnp.asarray(rng.standard_normal((2, 3, d)), jnp.bfloat16)
    slots = jnp.asarray([3, 1], jnp.int32)
    taken = [jax.tree.map(lambda a: a[slots], w) for w in (gate_up, down)]
    assert rel(ex.slots_experts_ffn(rows, gate_up, down, slots), jax.vmap(ex.expert_ffn)(rows, *taken)) < 1e-2


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_slots_path_reads_the_named_slots(dtype, kernel_everywhere):
    rng = np.random.default_rng(4)
    d, f, s = 128, 64, 6
    gate_up = jnp.asarray(rng.standard_normal((s, d, 2 * f)) * 0.1, dtype)
    down = jnp.asarray(rng.standard_normal((s, f, d)) * 0.1, dtype)
    rows = jnp.broadcast_to(jnp.asarray(rng.standard_normal((2, d)), dtype), (3, 2, d))  # every pick, same rows
    slots = jnp.asarray([5, 0, 5], jnp.int32)
    got = ex.slots_experts_ffn(rows, gate_up, down, slots)
    tol = 1e-2 if dtype == jnp.bfloat16 else 1e-6
    assert kernel_everywhere and got.dtype == dtype
    assert rel(got, jax.vmap(ex.expert_ffn)(rows, gate_up[slots], down[slots])) < tol
    assert rel(got[0], got[2]) == 0 and rel(got[0], got[1]) > 0.1  # the slot decides the output


@pytest.mark.parametrize("rows,kernel", [(1, True), (4, True), (5, False)])
def test_linear_uses_the_kernel_for_few_rows_only(rows, kernel, kernel_everywhere):
    layer = Linear(256, 128, use_bias=True, dtype=jnp.float32, param_dtype=jnp.float32, rngs=nnx.Rngs(0))
    layer.bias[...] = jnp.linspace(-1, 1, 128)
    x = jnp.asarray(np.random.default_rng(2).standard_normal((rows, 1, 256)), jnp.float32)
    y = layer(x)
    expected = nnx.Linear.__call__(layer, x)
    assert y.shape == (rows, 1, 128) and bool(kernel_everywhere) == kernel
    assert rel(y, expected) < 1e-6



def test_addressable_follows_the_lowerings_offset_width(monkeypatch):
    big = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype)  # noqa: E731
    wrapping = [big((1664, 704, 2048), jnp.uint8), big((2**30, 2), jnp.bfloat16)]  # 2^31 elements within 4 GiB
    assert all(gm.addressable(w) for w in wrapping)  # the lowering's offsets widened (triton_offsets)
    jax.eval_shape(gm.gather_matvec, big((1, 256), jnp.bfloat16), big((2**16, 256, 128), jnp.bfloat16),  # 4 GiB
                   big((1,), jnp.int32))
    monkeypatch.setattr(gm.triton_offsets, "install", lambda: False)  # a jax whose lowering cannot be widened
    assert gm.addressable(big((64, 2048, 2816), jnp.bfloat16))  # a layer's stack: 32-bit offsets suffice
    assert gm.addressable(big((1664, 1408, 2048), jnp.bfloat16))  # over 4 GiB: the lowering offsets in 64 bits
    assert not any(gm.addressable(w) for w in wrapping)
    with pytest.raises(ValueError, match="unsupported shapes"):
        jax.eval_shape(gm.gather_matvec, big((1, 128), jnp.bfloat16), big((2**17, 128, 128), jnp.bfloat16),
                       big((1,), jnp.int32))
    jax.eval_shape(gm.gather_matvec, big((1, 128), jnp.bfloat16), big((2**17 - 1, 128, 128), jnp.bfloat16),
                   big((1,), jnp.int32))  # one slot less: within the 32-bit offsets


def test_slots_path_copies_the_weights_the_kernel_cannot_reach(kernel_everywhere, monkeypatch):
    rng = np.random.default_rng(5)
    d, f, s = 128, 64, 6
    gate_up = jnp.asarray(rng.standard_normal((s, d, 2 * f)) * 0.1, jnp.float32)
    down = jnp.asarray(rng.standard_normal((s, f, d)) * 0.1, jnp.float32)
    rows = jnp.asarray(rng.standard_normal((3, 2, d)), jnp.float32)
    slots = jnp.asarray([4, 0, 2], jnp.int32)
    monkeypatch.setattr(gm, "addressable", lambda w: w.shape[:2] != (s, f))  # the whole `down` out of reach
    got = ex.slots_experts_ffn(rows, gate_up, down, slots)
    # gate_up read in place, down from a copy of the three slots (dense: the activation between the calls)
    assert kernel_everywhere == [("matvec_parts", (gate_up.shape,)), ("gather_matvec", ((3, f, d),))]
    assert rel(got, jax.vmap(ex.expert_ffn)(rows, gate_up[slots], down[slots])) < 1e-6


def test_picked_path_keeps_xla_for_weights_out_of_the_kernels_reach(kernel_everywhere, monkeypatch):
    rng = np.random.default_rng(6)
    d, f, s = 128, 64, 4
    gate_up = jnp.asarray(rng.standard_normal((s, d, 2 * f)) * 0.1, jnp.float32)
    down = jnp.asarray(rng.standard_normal((s, f, d)) * 0.1, jnp.float32)
    x, picks = jnp.asarray(rng.standard_normal((3, d)), jnp.float32), jnp.asarray([3, 0, 3], jnp.int32)
    monkeypatch.setattr(gm, "addressable", lambda w: w.shape[1] != f)  # `down` out of reach
    got = ex.picked_experts_ffn(x, gate_up, down, picks)
    assert not kernel_everywhere  # XLA's path, not a kernel call that would raise
    assert rel(got, jax.vmap(lambda xa, gu, dn: ex.expert_ffn(xa[None], gu, dn)[0])(x, gate_up[picks],
                                                                                   down[picks])) < 1e-6


@pytest.mark.parametrize("scheme", [None, "int8", "int4"])
def test_the_kernel_lowers_to_triton_for_cuda_here(scheme):
    """Cross-lowered for CUDA on this machine (jax.export): every operation the kernel uses has a Triton lowering
    rule, so a rule Pallas lacks fails in CI, not first on a GPU."""
    from jax import export

    w = jax.ShapeDtypeStruct((4, 1408, 2048), jnp.bfloat16)
    w = w if scheme is None else jax.eval_shape(lambda: quantize(jnp.ones(w.shape, w.dtype), scheme))
    x, idx = jax.ShapeDtypeStruct((6, 1408), jnp.bfloat16), jax.ShapeDtypeStruct((6,), jnp.int32)
    unchecked = [export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    exported = export.export(jax.jit(gm.gather_matvec), platforms=["cuda"], disabled_checks=unchecked)(x, w, idx)
    assert "xla.gpu.triton" in exported.mlir_module()


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_parts_of_a_pair_sum_to_both_products(dtype):
    rng = np.random.default_rng(7)
    gate, up = (jnp.asarray(rng.standard_normal((256, 384)), dtype) for _ in range(2))
    x = jnp.asarray(rng.standard_normal((2, 256)), jnp.float32)
    parts = gm.matvec_parts(x, (gate[None], up[None]), jnp.zeros(2, jnp.int32), interpret=True)
    assert parts.shape[1:] == (2, 768) and parts.shape[0] > 1  # K cut into parts, gate's columns first
    summed = np.asarray(parts, np.float64).sum(axis=0)
    first = jnp.zeros(2, jnp.int32)
    assert rel(summed[:, :384], reference(x, gate[None], first)) < 1e-6
    assert rel(summed[:, 384:], reference(x, up[None], first)) < 1e-6


@pytest.mark.parametrize("dtype,scheme", [(jnp.float32, None), (jnp.bfloat16, None), (jnp.bfloat16, "int8"),
                                          (jnp.bfloat16, "int4")])
def test_the_down_call_computes_the_activation(dtype, scheme):
    """swiglu_matvec: swiglu of the summed parts, rounded to the weights' dtype, times each row's weights."""
    rng = np.random.default_rng(8)
    f, n = 192, 256
    w = jnp.asarray(rng.standard_normal((3, f, n)) * 0.1, dtype)
    w = w if scheme is None else quantize(w, scheme)
    h_parts = jnp.asarray(rng.standard_normal((5, 2, 2 * f)), jnp.float32)
    idx = jnp.asarray([2, 0], jnp.int32)
    got = gm.swiglu_matvec(h_parts, w, idx, interpret=True)
    act = ex.swiglu(h_parts.sum(axis=0)).astype(w.dtype)
    assert got.shape == (2, n) and rel(got, reference(act, w, idx)) < 1e-6


@pytest.fixture(params=[False, True], ids=["activation_between", "activation_fused"])
def dense_fused(request, monkeypatch):
    """Both forms of a dense FFN: the activation in an XLA kernel between the calls (the default) or in the down
    call."""
    monkeypatch.setattr(gm, "FUSED_ACTIVATION", gm.FUSED_ACTIVATION | {"dense"} if request.param
                        else gm.FUSED_ACTIVATION - {"dense"})
    return request.param


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_the_shared_mlp_runs_two_kernel_calls(dtype, kernel_everywhere, dense_fused):
    """DenseMLP of a few rows: gate and up in one call, then the down call (which computes the activation where
    fused); the projections' own path agrees (bf16: it rounds gate and up to bf16 before the activation)."""
    mlp = DenseMLP(128, 256, nnx.Rngs(0), dtype)
    x = jnp.asarray(np.random.default_rng(9).standard_normal((1, 2, 128)), dtype)
    got = mlp(x)
    down_call = "swiglu_matvec" if dense_fused else "gather_matvec"
    assert [name for name, _ in kernel_everywhere] == ["matvec_parts", down_call]
    assert got.shape == x.shape and got.dtype == dtype
    assert rel(got, mlp._projections(x)) < (1e-2 if dtype == jnp.bfloat16 else 1e-6)
    kernel_everywhere.clear()
    mlp(jnp.ones((1, 5, 128), dtype))  # more rows than the kernel takes: XLA's products
    assert not kernel_everywhere


@pytest.mark.parametrize("call", ["pair", "swiglu", "swiglu_int4"])
def test_the_new_calls_lower_to_triton_for_cuda_here(call):
    from jax import export

    w = jax.ShapeDtypeStruct((1, 2048, 1408), jnp.bfloat16)
    idx = jax.ShapeDtypeStruct((1,), jnp.int32)
    unchecked = [export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    if call == "pair":
        fn = lambda x, w, idx: gm.matvec_parts(x, (w, w), idx)  # noqa: E731
        args = (jax.ShapeDtypeStruct((1, 2048), jnp.bfloat16),)
    else:
        w = jax.ShapeDtypeStruct((1, 1408, 2048), jnp.bfloat16)
        if call == "swiglu_int4":  # the even and odd elements split in the kernel
            w = jax.eval_shape(lambda: quantize(jnp.ones(w.shape, w.dtype), "int4"))
        fn, args = gm.swiglu_matvec, (jax.ShapeDtypeStruct((32, 1, 2816), jnp.float32),)
    exported = export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=unchecked)(*args, w, idx)
    assert "xla.gpu.triton" in exported.mlir_module()


@pytest.mark.parametrize("scheme", [None, "int8", "int4"])
def test_each_row_reads_its_own_source(scheme):
    """src: row a reads slot idx[a] of source src[a]; sources of different slot counts, one kind of weight."""
    rng = np.random.default_rng(11)

    def weights(slots):
        w = jnp.asarray(rng.standard_normal((slots, 128, 256)) * 0.1, jnp.bfloat16)
        return w if scheme is None else quantize(w, scheme)

    sources = (weights(3), weights(5), weights(2))
    x = jnp.asarray(rng.standard_normal((4, 128)), jnp.bfloat16)
    src, idx = jnp.asarray([2, 0, 1, 1], jnp.int32), jnp.asarray([1, 2, 4, 0], jnp.int32)
    got = np.asarray(gm.gather_matvec(x, sources, idx, interpret=True, src=src))
    for a in range(4):
        expected = reference(x[a:a + 1], sources[int(src[a])], idx[a:a + 1])
        assert rel(got[a:a + 1], expected) < 1e-6
    with pytest.raises(ValueError, match="unsupported"):  # sources of different kinds
        gm.gather_matvec(x, (sources[0], jnp.zeros((2, 128, 128), jnp.bfloat16), sources[2]), idx, interpret=True,
                         src=src)


def test_a_pair_and_the_activation_read_each_rows_source():
    rng = np.random.default_rng(12)
    pool, bank = (jnp.asarray(rng.standard_normal((s, 128, 256)), jnp.float32) for s in (4, 3))
    x = jnp.asarray(rng.standard_normal((3, 128)), jnp.float32)
    src, idx = jnp.asarray([1, 0, 1], jnp.int32), jnp.asarray([2, 3, 0], jnp.int32)
    parts = gm.matvec_parts(x, ((pool, pool), (bank, bank)), idx, interpret=True, src=src)
    summed = np.asarray(parts, np.float64).sum(axis=0)
    picked = jnp.stack([(pool, bank)[int(s)][int(i)] for s, i in zip(src, idx)])
    first = jnp.arange(3, dtype=jnp.int32)
    assert rel(summed[:, :256], reference(x, picked, first)) < 1e-6
    assert rel(summed[:, 256:], reference(x, picked, first)) < 1e-6
    h_parts = jnp.asarray(rng.standard_normal((2, 3, 256)), jnp.float32)
    down = jnp.asarray(rng.standard_normal((4, 128, 256)), jnp.float32), jnp.asarray(
        rng.standard_normal((3, 128, 256)), jnp.float32)
    got = gm.swiglu_matvec(h_parts, down, idx, interpret=True, src=src)
    act = ex.swiglu(h_parts.sum(axis=0))
    assert rel(got, reference(act, jnp.stack([down[int(s)][int(i)] for s, i in zip(src, idx)]), first)) < 1e-6


@pytest.mark.parametrize("scheme", [None, "int4"])
def test_sources_lower_to_triton_for_cuda_here(scheme):
    """The per-row branch on a loaded source index has Triton lowering rules (cross-lowered for CUDA)."""
    from jax import export

    w = jax.ShapeDtypeStruct((4, 2048, 1536), jnp.bfloat16)
    w = w if scheme is None else jax.eval_shape(lambda: quantize(jnp.ones(w.shape, w.dtype), scheme))
    x, idx = jax.ShapeDtypeStruct((8, 2048), jnp.bfloat16), jax.ShapeDtypeStruct((8,), jnp.int32)
    unchecked = [export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    fn = jax.jit(lambda x, w1, w2, w3, idx, src: gm.gather_matvec(x, (w1, w2, w3), idx, src=src))
    exported = export.export(fn, platforms=["cuda"], disabled_checks=unchecked)(x, w, w, w, idx, idx)
    assert "xla.gpu.triton" in exported.mlir_module()
