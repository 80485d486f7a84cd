"""The engine's CPU experts through the CPU expert kernel: one program per layer, the XLA path's numbers."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pdscope_jax
from pdscope_jax.engine import cpu_experts
from pdscope_jax.engine.cpu_experts import CpuExperts
from pdscope_jax.kernels import cpu_ffn
from pdscope_jax.runtime import select_devices
from pdscope_jax.store.expert_store import ExpertStore

E, D, F = 8, 64, 32

needs_kernel = pytest.mark.skipif(not cpu_ffn.available(), reason="the CPU expert kernel does not run here")


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _store():
    rng = np.random.default_rng(0)
    store = ExpertStore(select_devices())
    store.add_layer(1, jnp.asarray(rng.standard_normal((E, D, 2 * F)) * 0.1, jnp.bfloat16),
                    jnp.asarray(rng.standard_normal((E, F, D)) * 0.1, jnp.bfloat16))
    return store


def _groups(rng, tokens, experts):
    chosen = rng.choice(E, experts, replace=False)
    out = []
    for e in chosen:
        rows = np.sort(rng.choice(tokens, rng.integers(1, tokens + 1), replace=False))
        out.append((int(e), rows, rng.uniform(0.1, 1.0, rows.size).astype(np.float32)))
    return out


@needs_kernel
@pytest.mark.parametrize("tokens, experts", [(1, 1), (1, 6), (3, 5), (8, 8)])
def test_kernel_path_matches_the_xla_path_in_one_program(tokens, experts):
    store = _store()
    rng = np.random.default_rng(tokens * 10 + experts)
    h = jax.device_put(jnp.asarray(rng.standard_normal((tokens, D)), jnp.bfloat16), store.devices.cpu)
    groups = _groups(rng, tokens, experts)
    fast, xla = CpuExperts(store, kernel=True), CpuExperts(store, kernel=False)
    y, want = fast.dispatch(1, h, groups), xla.dispatch(1, h, groups)
    assert y.dtype == jnp.float32 and y.shape == (tokens, D) and y.devices() == {store.devices.cpu}
    assert rel(y, want) < 1e-2  # bf16: the XLA path rounds each expert's output, the kernel only the activation
    # one program for the whole layer, its expert count padded to a power of two
    assert fast._shapes == {("kernel", tokens, cpu_experts.kernel_bucket(experts), True)}
    assert all(path == "dense" for path, *_ in xla._shapes)
    assert fast.expert_runs == xla.expert_runs == experts


@needs_kernel
def test_kernel_path_precompiles_every_bucket_and_leaves_many_rows_to_xla():
    store = _store()
    cpu = CpuExperts(store, kernel=True)
    cpu.precompile(1, 4, jnp.bfloat16)
    assert cpu._shapes == {("kernel", 4, k, True) for k in (1, 2, 4, 8)}  # E = 8 experts
    assert cpu.expert_runs == 0
    rng = np.random.default_rng(5)
    many = cpu_experts.KERNEL_MAX_ROWS + 1
    h = jax.device_put(jnp.asarray(rng.standard_normal((many, D)), jnp.bfloat16), store.devices.cpu)
    cpu.dispatch(1, h, _groups(rng, many, 3))
    assert ("dense", many, 3, True) in cpu._shapes  # above KERNEL_MAX_ROWS rows: the XLA dense path


def test_float32_weights_never_take_the_kernel():
    rng = np.random.default_rng(1)
    store = ExpertStore(select_devices())
    store.add_layer(1, rng.standard_normal((E, D, 2 * F)).astype(np.float32),
                    rng.standard_normal((E, F, D)).astype(np.float32))
    cpu = CpuExperts(store, kernel=True)
    h = jax.device_put(rng.standard_normal((2, D)).astype(np.float32), store.devices.cpu)
    cpu.dispatch(1, h, _groups(rng, 2, 3))
    assert {path for path, *_ in cpu._shapes} == {"dense"}


@needs_kernel
def test_offloaded_bf16_decode_runs_the_kernel_and_agrees_with_the_xla_path():
    ids = np.random.default_rng(0).integers(0, 256, size=(1, 6)).astype(np.int32)
    runs = {}
    for kernel in (True, False):
        runner = pdscope_jax.load("tiny-deepseek-v2-lite", dtype="bfloat16", policy="static", gpu_memory="1GB",
                                  expert_pool="100KB", max_seq_len=64, cpu_kernel=kernel)
        logits = runner.logits(ids)  # 6 rows: within KERNEL_MAX_ROWS, so prefill's CPU experts take it too
        out = runner.generate(ids, max_new_tokens=4)
        runs[kernel] = (logits, np.asarray(out.tokens), set(runner.engine.cpu_experts._shapes))
    (kernel_logits, kernel_tokens, kernel_shapes), (xla_logits, xla_tokens, xla_shapes) = runs[True], runs[False]
    assert any(path == "kernel" for path, *_ in kernel_shapes)
    assert not any(path == "kernel" for path, *_ in xla_shapes)
    assert rel(kernel_logits, xla_logits) < 2e-2  # bf16 sums in another order
    # the first generated token agrees; later ones may drift (the bf16 contract)
    assert kernel_tokens.shape == xla_tokens.shape == (1, 4) and kernel_tokens[0, 0] == xla_tokens[0, 0]
