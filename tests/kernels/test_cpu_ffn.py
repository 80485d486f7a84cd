"""The CPU expert kernel against the XLA path and an exact float64 reference; the fallback paths."""

import threading
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pdscope_jax.kernels import build, cpu_ffn

from ffn_reference import exact, rel, routing_case

D, F, E = 256, 160, 10  # F = 5 blocks of 32: units split unevenly over threads


def case(rows: int, k: int, seed: int):
    return routing_case(rows, k, D, E, seed)


@pytest.fixture(scope="module")
def weights():
    rng = np.random.default_rng(0)
    gate_up = jnp.asarray(rng.standard_normal((E, D, 2 * F)) * 0.06, jnp.bfloat16)
    down = jnp.asarray(rng.standard_normal((E, F, D)) * 0.08, jnp.bfloat16)
    return gate_up, down


def fast_paths():
    """The fast instruction sets this CPU runs: AMX-BF16 (bf16 experts of several rows) and AVX-512 BF16."""
    best = cpu_ffn.set_isa(None) if cpu_ffn.built() else None
    return [isa for isa in ("amx_bf16", "avx512_bf16") if best == "amx_bf16" or (best, isa) == ("avx512_bf16",) * 2]


@pytest.mark.parametrize("rows", [1, 3, 5, 13, 16, 17, 33, 64])
@pytest.mark.parametrize("k", [1, 2, 3, 4, 5, 6])
@pytest.mark.parametrize("isa", ["amx_bf16", "avx512_bf16"])
def test_each_fast_path_matches_the_exact_sum(kernel, weights, isa, rows, k):
    """AMX tiles (every expert of at least one row on them) and AVX-512 alone: within bf16 rounding of the exact
    sum and of each other, unrouted rows exactly 0, any row count (one or several blocks of 16) and k."""
    if isa not in fast_paths():
        pytest.skip(f"this CPU has no {isa}")
    gate_up, down = weights
    h, coef, ids = case(rows, k, seed=1000 + rows * 10 + k)
    before = cpu_ffn.set_amx_rows(0)
    try:
        assert cpu_ffn.set_isa(isa) == isa and cpu_ffn.set_amx_rows(1) == 1
        out = np.asarray(cpu_ffn.moe_ffn_cpu(h, coef, gate_up, down, ids, impl="kernel"))
        assert cpu_ffn.set_isa("avx512_bf16") == "avx512_bf16"
        avx = np.asarray(cpu_ffn.moe_ffn_cpu(h, coef, gate_up, down, ids, impl="kernel"))
    finally:
        cpu_ffn.set_isa(None)
        cpu_ffn.set_amx_rows(before)
    assert out.shape == (rows, D) and np.all(out[~(coef != 0).any(axis=0)] == 0.0)
    if not (coef != 0).any():  # no row routed to any expert (a case of one row)
        assert not np.any(out) and not np.any(avx)
        return
    assert rel(out, exact(h, coef, gate_up, down, ids)) < 5e-3
    # another order of float32 sums can round an activation to the neighbouring bf16 value (2^-8 relative)
    assert rel(out, avx) < 2e-3


@pytest.mark.parametrize("amx_rows", [2, 4, 40])
def test_amx_and_avx_experts_in_one_call(kernel, weights, amx_rows):
    """With AMX in use, experts of fewer than `set_amx_rows` routed rows take the AVX-512 kernels in the same
    call; the sum agrees with AVX-512 alone within bf16 rounding of the activations, whatever the threshold."""
    if "amx_bf16" not in fast_paths():
        pytest.skip("this CPU has no AMX-BF16")
    gate_up, down = weights
    h, coef, ids = case(7, 6, seed=77)
    coef[0, 1:] = 0.0  # expert 0: one row; the others several
    before = cpu_ffn.set_amx_rows(0)
    try:
        assert cpu_ffn.set_isa("avx512_bf16") == "avx512_bf16"
        avx = np.asarray(cpu_ffn.moe_ffn_cpu(h, coef, gate_up, down, ids, impl="kernel"))
        assert cpu_ffn.set_isa("amx_bf16") == "amx_bf16"
        assert cpu_ffn.set_amx_rows(amx_rows) == amx_rows and cpu_ffn.set_amx_rows(0) == amx_rows
        mixed = np.asarray(cpu_ffn.moe_ffn_cpu(h, coef, gate_up, down, ids, impl="kernel"))
    finally:
        cpu_ffn.set_isa(None)
        cpu_ffn.set_amx_rows(before)
    assert rel(mixed, avx) < 2e-3
    assert rel(mixed, exact(h, coef, gate_up, down, ids)) < 5e-3


def test_set_isa_keeps_to_what_the_cpu_has(kernel):
    """Asking for an instruction set the CPU lacks gives the best one it has; None gives the best."""
    best = cpu_ffn.set_isa(None)
    try:
        for name in ("amx_bf16", "avx512_bf16", "portable"):
            got = cpu_ffn.set_isa(name)
            order = list(cpu_ffn.ISAS)  # portable, avx512_bf16, amx_bf16: each includes the one before
            assert got == (name if order.index(name) <= order.index(best) else best)
            assert cpu_ffn.isa() == got
    finally:
        cpu_ffn.set_isa(None)
    assert cpu_ffn.isa() == best


@pytest.mark.parametrize("rows", [1, 2, 5, 16, 64])
@pytest.mark.parametrize("k", [1, 3, 8])
def test_kernel_matches_xla(kernel, weights, rows, k):
    gate_up, down = weights
    h, coef, ids = case(rows, k, seed=rows * 10 + k)
    want = exact(h, coef, gate_up, down, ids)
    xla = cpu_ffn.moe_ffn_cpu(h, coef, gate_up, down, ids, impl="xla")
    stacked = cpu_ffn.moe_ffn_cpu(h, coef, gate_up, down, ids, impl="kernel")
    listed = jax.jit(lambda h, c, g, d: cpu_ffn.moe_ffn_cpu(h, c, g, d, impl="kernel"))(
        h, coef, [gate_up[e] for e in ids], [down[e] for e in ids])
    assert stacked.dtype == jnp.float32 and stacked.shape == (rows, D)
    np.testing.assert_array_equal(np.asarray(stacked), np.asarray(listed))  # same kernel, same order
    # bf16 rounding: the XLA path rounds each expert's output to bf16, the kernel only the activation
    assert rel(stacked, xla) < 1e-2
    assert rel(stacked, want) < 5e-3
    assert rel(xla, want) < 1e-2
    unrouted = ~(coef != 0).any(axis=0)
    assert np.all(np.asarray(stacked)[unrouted] == 0.0)


@pytest.mark.parametrize("rows", [1, 16])
def test_portable_path_matches(kernel, weights, rows):
    gate_up, down = weights
    h, coef, ids = case(rows, 4, seed=rows)
    fast = cpu_ffn.moe_ffn_cpu(h, coef, gate_up, down, ids, impl="kernel")
    assert cpu_ffn.set_isa("portable") == "portable"
    try:
        portable = cpu_ffn.moe_ffn_cpu(h, coef, gate_up, down, ids, impl="kernel")
    finally:
        cpu_ffn.set_isa(None)
    assert rel(portable, fast) < 1e-5
    assert rel(portable, exact(h, coef, gate_up, down, ids)) < 5e-3


def test_float32_inputs_and_threads(kernel, weights):
    gate_up, down = weights
    h, coef, ids = case(5, 3, seed=7)
    before = cpu_ffn.threads()
    try:
        assert cpu_ffn.set_threads(3) == 3
        out = cpu_ffn.moe_ffn_cpu(h.astype(jnp.float32), coef, gate_up, down, ids, impl="kernel")
    finally:
        cpu_ffn.set_threads(before)
    assert rel(out, exact(h, coef, gate_up, down, ids)) < 5e-3


def test_kernel_refuses_what_it_cannot_compute(kernel, weights):
    gate_up, down = weights
    h, coef, ids = case(2, 2, seed=3)
    with pytest.raises(ValueError, match="bf16"):
        cpu_ffn.moe_ffn_cpu(h, coef, gate_up.astype(jnp.float32), down.astype(jnp.float32), ids, impl="kernel")


def test_auto_falls_back_to_xla(weights, monkeypatch):
    gate_up, down = weights
    h, coef, ids = case(4, 3, seed=5)
    want = cpu_ffn.moe_ffn_xla(h, coef, gate_up, down, ids)
    monkeypatch.setattr(cpu_ffn, "library", lambda: None)  # as where no library could be built
    assert not cpu_ffn.available() and cpu_ffn.isa() is None and cpu_ffn.threads() == 0
    np.testing.assert_array_equal(np.asarray(cpu_ffn.moe_ffn_cpu(h, coef, gate_up, down, ids)), np.asarray(want))
    with pytest.raises(RuntimeError, match="not built"):
        cpu_ffn.moe_ffn_cpu(h, coef, gate_up, down, ids, impl="kernel")


def test_auto_uses_xla_for_float32_weights(weights):
    gate_up, down = (w.astype(jnp.float32) for w in weights)
    h, coef, ids = case(3, 2, seed=9)
    out = cpu_ffn.moe_ffn_cpu(h, coef, gate_up, down, ids)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(cpu_ffn.moe_ffn_xla(h, coef, gate_up, down, ids)))
    assert rel(out, exact(h, coef, gate_up, down, ids)) < 1e-2


def test_no_experts_gives_zeros():
    h = jnp.ones((3, D), jnp.bfloat16)
    out = cpu_ffn.moe_ffn_cpu(h, np.zeros((0, 3), np.float32), [], [])
    assert out.shape == (3, D) and not np.any(np.asarray(out))


def test_failed_build_warns_once_and_returns_none(tmp_path, monkeypatch):
    monkeypatch.setenv("CXX", "/bin/false")
    monkeypatch.setenv("PDSCOPE_KERNEL_CACHE", str(tmp_path))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert build.shared_library(cpu_ffn.SOURCE) is None
    assert len(caught) == 1 and "using the XLA path" in str(caught[0].message)
    assert not list(tmp_path.glob("*.so"))


def test_a_library_loads_once_across_threads_and_a_failure_is_kept():
    calls = []

    def slow_failing_load():
        calls.append(threading.get_ident())
        threading.Event().wait(0.05)  # hold the lock while the other threads arrive
        return None

    load = build.once(slow_failing_load)
    threads = [threading.Thread(target=load) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert load() is None and len(calls) == 1


def test_profile_splits_each_call_into_phases(kernel, weights):
    gate_up, down = weights
    h, coef, ids = case(16, 3, seed=11)
    cpu_ffn.profile(True)
    try:
        for _ in range(3):
            cpu_ffn.moe_ffn_cpu(h, coef, gate_up, down, ids, impl="kernel").block_until_ready()
        got = cpu_ffn.profile_read()
    finally:
        cpu_ffn.profile(False)
    assert got["calls"] == 3
    assert set(cpu_ffn.PROFILE_FIELDS) <= set(got)
    assert all(got[name] >= 0 for name in cpu_ffn.PROFILE_FIELDS)
    if fast_paths():
        assert got["gate_up"] > 0 and got["down"] > 0  # the fast paths time their phases
    else:  # the portable path times its groups alone
        assert got["gate_up"] == got["act"] == got["down"] == 0 and got["groups"] > 0
    assert got["groups"] >= got["gate_up"] + got["act"] + got["down"] - 1e-6  # phases lie inside the groups
    assert got["slowest_group"] <= got["groups"] + 1e-9
    cpu_ffn.moe_ffn_cpu(h, coef, gate_up, down, ids, impl="kernel").block_until_ready()
    assert cpu_ffn.profile_read()["calls"] == 3  # stopped: later calls are not counted


@pytest.mark.parametrize("rows", [1, 3, 4, 5])
@pytest.mark.parametrize("k", [1, 6])
def test_streamed_path_matches_the_exact_sum(kernel, weights, rows, k):
    """The streamed few-row path (on only when asked): within bf16 rounding of the exact sum, close to the unit
    path, unrouted rows exactly 0; a call with more than 4 rows routed to an expert takes the unit path."""
    if cpu_ffn.isa() not in ("avx512_bf16", "amx_bf16"):
        pytest.skip("the streamed path runs with the AVX-512 kernels only")
    gate_up, down = weights
    h, coef, ids = case(rows, k, seed=100 + rows * 10 + k)
    units = np.asarray(cpu_ffn.moe_ffn_cpu(h, coef, gate_up, down, ids, impl="kernel"))
    try:
        assert cpu_ffn.set_stream(True)
        streamed = np.asarray(cpu_ffn.moe_ffn_cpu(h, coef, gate_up, down, ids, impl="kernel"))
    finally:
        cpu_ffn.set_stream(False)
    assert rel(streamed, exact(h, coef, gate_up, down, ids)) < 5e-3
    assert rel(streamed, units) < 5e-3
    assert np.all(streamed[~(coef != 0).any(axis=0)] == 0.0)
    if rows == 5 and (coef != 0).sum(axis=1).max() > 4:
        np.testing.assert_array_equal(streamed, units)


def test_more_groups_per_thread_change_only_the_summation_order(kernel, weights):
    """Cutting a call into more groups per thread moves where partial sums split, nothing else: the output
    agrees with one group per thread to float32 rounding; a setting <= 0 keeps the current one."""
    gate_up, down = weights
    h, coef, ids = case(4, 3, seed=21)
    before = cpu_ffn.set_groups(0)
    try:
        assert cpu_ffn.set_groups(1) == 1
        one = np.asarray(cpu_ffn.moe_ffn_cpu(h, coef, gate_up, down, ids, impl="kernel"))
        assert cpu_ffn.set_groups(5) == 5
        assert cpu_ffn.set_groups(0) == 5
        five = np.asarray(cpu_ffn.moe_ffn_cpu(h, coef, gate_up, down, ids, impl="kernel"))
    finally:
        cpu_ffn.set_groups(before)
    assert rel(five, one) < 1e-5
    assert np.any(one != 0)


def test_seconds_per_expert_times_the_kernel_on_weights_where_they_lie(kernel):
    """The calibration the host split uses: a positive, finite time per expert from weights read in place, at one
    row and at many (no ordering between the two is asserted: AMX tiles make many rows about as cheap as one, and
    a loaded machine makes any single timing noisy); shapes the kernel cannot take are refused."""
    rng = np.random.default_rng(3)
    experts = [(np.asarray(rng.standard_normal((D, 2 * F)) * 0.05, jnp.bfloat16),
                np.asarray(rng.standard_normal((F, D)) * 0.05, jnp.bfloat16)) for _ in range(6)]
    weights = cpu_ffn.HostWeights(tuple(gu.ctypes.data for gu, _ in experts),
                                  tuple(dn.ctypes.data for _, dn in experts))
    one = cpu_ffn.seconds_per_expert(weights, (D, F), per_call=2, rows=1, repeats=5)
    many = cpu_ffn.seconds_per_expert(weights, (D, F), per_call=2, rows=64, repeats=5)
    assert one is not None and 0 < one < 1.0
    assert many is not None and 0 < many < 1.0
    with pytest.raises(ValueError, match="multiples of 32"):
        cpu_ffn.seconds_per_expert(weights, (D, F + 1))
