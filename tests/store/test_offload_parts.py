"""Offload building blocks on two CPU devices: runtime config, budget, slot pool, expert store, CPU experts."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pdscope_jax.models.layers import expert_ffn
from pdscope_jax.store.budget import (DECODE_MARGIN, FILL_GROUP_BYTES, FILL_GROUPS_IN_FLIGHT, BudgetError,
                                     decode_activation_bytes, plan_budget)
from pdscope_jax.engine import cpu_experts
from pdscope_jax.store import expert_store, slot_pool
from pdscope_jax.engine.cpu_experts import CpuExperts
from pdscope_jax.store.expert_store import ExpertStore
from pdscope_jax.store.slot_pool import SlotPool
from pdscope_jax.presets import preset
from pdscope_jax.runtime import RuntimeConfig, RuntimeConfigError, bucket, parse_size, select_devices

E, D, F = 8, 64, 32


def test_parse_size_units():
    assert parse_size("24GB") == 24 * 10**9
    assert parse_size("8GiB") == 8 * 2**30
    assert parse_size("1.5g") == 1_500_000_000
    assert parse_size(" 512 MB ") == 512 * 10**6
    assert parse_size(1024) == 1024


@pytest.mark.parametrize("bad", ["24 gigs", "GB", "-3GB", "", "1e9", True, [24]])
def test_parse_size_rejects_malformed(bad):
    with pytest.raises(RuntimeConfigError, match="gpu_memory"):
        RuntimeConfig(gpu_memory=bad)


def test_runtime_config_is_frozen_and_hashable():
    rc = RuntimeConfig(gpu_memory="24GB", expert_pool="8GB", policy="ondemand", policy_options={"b": 1, "a": 2})
    assert rc.gpu_memory == 24 * 10**9 and rc.expert_pool == 8 * 10**9
    assert rc.policy_options == (("a", 2), ("b", 1))
    assert hash(rc) == hash(RuntimeConfig(gpu_memory=24 * 10**9, expert_pool=8 * 10**9, policy="ondemand",
                                          policy_options=(("a", 2), ("b", 1))))
    with pytest.raises(Exception):
        rc.policy = "x"
    with pytest.raises(RuntimeConfigError, match="decode_buckets"):
        RuntimeConfig(decode_buckets=(4, 2))
    assert bucket(3, (1, 2, 4)) == 4 and bucket(9, (4, 8)) == 16


def test_select_devices_uses_two_cpu_devices():
    dev = select_devices()
    assert dev.accel == jax.devices("cpu")[1] and dev.cpu == jax.devices("cpu")[0]


def test_budget_splits_and_fails_with_numbers():
    cfg = preset("deepseek-v2-lite")
    rc = RuntimeConfig(gpu_memory="24GB", expert_pool="8GB")
    b = plan_budget(cfg, rc, non_expert_bytes=3 * 10**9, kv_cache_bytes=10**8, itemsize=2)
    assert b.slot_bytes == cfg.expert_bytes(2)
    assert b.pool <= 8 * 10**9 and b.slots == 8 * 10**9 // b.slot_bytes
    assert b.planned <= b.total
    uncapped = plan_budget(cfg, rc.replace(expert_pool=None), non_expert_bytes=3 * 10**9, kv_cache_bytes=10**8,
                           itemsize=2)
    assert uncapped.slots > b.slots and uncapped.planned <= uncapped.total
    with pytest.raises(BudgetError, match=r"non-expert weights 3\.00 GB.*budget 2\.00 GB"):
        plan_budget(cfg, rc.replace(gpu_memory="2GB"), non_expert_bytes=3 * 10**9, kv_cache_bytes=0, itemsize=2)


def test_decode_step_reserve_counts_its_expert_copies_and_a_second_kv_cache_not_the_tiled_combine():
    cfg, kv = preset("deepseek-v2-lite"), 129 * 10**6
    rc = RuntimeConfig(gpu_memory="24GB", max_seq_len=4160)
    one = decode_activation_bytes(cfg, rc, 2, kv)
    k, expert = cfg.num_experts_per_tok, cfg.expert_bytes(2)
    # a layer's pulled misses and the next layer's copies ahead: two copies per pick, and the second KV cache
    assert one >= DECODE_MARGIN * (2 * k * expert + kv)
    # but not the tiled combine's gathered tile weights (about 58 experts), which a one-token step never runs
    assert one < DECODE_MARGIN * (2 * k * expert + kv) + 8 * expert
    assert abs(one - decode_activation_bytes(cfg, rc, 2) - DECODE_MARGIN * kv) <= 1
    # more rows than experts: at most a whole layer's copies twice
    wide = decode_activation_bytes(cfg, rc.replace(max_batch=16), 2)
    assert wide >= DECODE_MARGIN * 2 * cfg.num_experts * expert


def test_decode_bank_takes_what_decode_leaves_of_prefills_activations_and_staging():
    cfg = preset("deepseek-v2-lite")
    parts = dict(non_expert_bytes=3 * 10**9, kv_cache_bytes=10**8, itemsize=2)
    b = plan_budget(cfg, RuntimeConfig(gpu_memory="24GB"), **parts)
    assert 0 < b.decode_activations < b.activations
    room, layers = (b.activations + b.staging - b.decode_activations) // b.slot_bytes, len(cfg.moe_layers)
    # the bank and its fill's staging (groups of a layer's share, at most FILL_GROUP_BYTES each) fill the room
    group = min(-(-b.decode_slots // layers), FILL_GROUP_BYTES // b.slot_bytes)
    assert group == 7 and b.decode_fill_group == group  # DeepSeek-V2-Lite: 17.3 MB experts, 7 in 128 MiB
    assert b.decode_fill_staging == FILL_GROUPS_IN_FLIGHT * group * b.slot_bytes
    assert b.decode_slots + FILL_GROUPS_IN_FLIGHT * group <= room < b.decode_slots + 1 + FILL_GROUPS_IN_FLIGHT * group
    assert b.decode_bank == b.decode_slots * b.slot_bytes
    assert b.planned <= b.total and b.planned_decode <= b.total
    assert b.pool + b.decode_bank >= 17 * 10**9  # issue 22: a 24 GB budget holds >= 17 GB of experts in decode
    capped = plan_budget(cfg, RuntimeConfig(gpu_memory="14GB", expert_pool="5GB"), **parts)
    assert capped.pool + capped.decode_bank <= 5 * 10**9 and capped.decode_slots > 0  # the cap covers both
    off = plan_budget(cfg, RuntimeConfig(gpu_memory="24GB", decode_bank=False), **parts)
    assert off.decode_slots == 0 and off.slots == b.slots
    every = len(cfg.moe_layers) * cfg.num_experts
    roomy = plan_budget(cfg, RuntimeConfig(gpu_memory="40GB"), **parts)
    assert roomy.slots < every and roomy.slots + roomy.decode_slots == every  # never more slots than experts


def test_decode_bank_opens_and_closes_beside_the_pool():
    pool = _pool(3)
    assert pool.decode_slots == 0 and len(pool.banks) == 1
    pool.open_decode_bank(2)
    (gate_up, down), (bank_gu, bank_dn) = pool.banks
    assert gate_up.shape == (3, D, 2 * F) and bank_gu.shape == (2, D, 2 * F) and bank_dn.shape == (2, F, D)
    assert pool.decode_slots == 2 and pool.num_slots == 3  # the host table still covers the pool alone
    pool.close_decode_bank()
    assert pool.decode_slots == 0 and len(pool.banks) == 1
    pool.open_decode_bank(0)
    assert len(pool.banks) == 1


def test_decode_bank_in_pieces_of_a_layers_experts_numbers_its_slots_after_the_pool():
    """`pieces`: pairs of E slots each, the last the rest; their slots count together, and a program's banks
    handed back replace every piece."""
    pool = _pool(3)
    pool.open_decode_bank(2 * E + 1, pieces=True)
    (gate_up, _), *pieces = pool.banks
    assert [(gu.shape[0], dn.shape) for gu, dn in pieces] == [(E, (E, F, D)), (E, (E, F, D)), (1, (1, F, D))]
    assert pool.decode_slots == 2 * E + 1 and pool.num_slots == 3
    marked = tuple((gu + 1, dn) for gu, dn in pieces)
    pool.banks = ((gate_up, pool.down), *marked)
    assert all(float(gu[0, 0, 0]) == 1.0 for gu, _ in pool.banks[1:])
    pool.close_decode_bank()
    assert pool.decode_slots == 0 and len(pool.banks) == 1


def test_a_bank_no_free_block_holds_is_allocated_in_pieces_and_says_so(monkeypatch):
    """Where the device's allocator says its largest free block is smaller than the bank's gate_up array, the bank
    is allocated in pieces of a layer's experts (with a warning naming the setting); where it is large enough, or
    the device does not say (the CPU), in one array."""
    pool = _pool(3)
    gate_up_slot = D * 2 * F * 4  # float32
    monkeypatch.setattr(slot_pool, "_largest_free", lambda device: (2 * E + 1) * gate_up_slot - 1)
    with pytest.warns(UserWarning, match="decode_bank_pieces"):
        pool.open_decode_bank(2 * E + 1)
    assert [gu.shape[0] for gu, _ in pool.banks[1:]] == [E, E, 1]
    pool.close_decode_bank()
    for largest in ((2 * E + 1) * gate_up_slot, None):
        monkeypatch.setattr(slot_pool, "_largest_free", lambda device, largest=largest: largest)
        pool.open_decode_bank(2 * E + 1)
        assert [gu.shape[0] for gu, _ in pool.banks[1:]] == [2 * E + 1]
        pool.close_decode_bank()


def test_a_bank_whose_one_array_runs_out_of_memory_opens_in_pieces_and_other_errors_are_raised(monkeypatch):
    """Where allocating the bank's one array runs out of memory (the allocator's own figures said it would fit,
    or said nothing), the bank opens in pieces of a layer's experts with a warning naming the setting; an error
    that is not a lack of memory is raised as it came."""
    pool = _pool(3)
    allocate = slot_pool._allocate

    def short_of_memory(slots, *args):
        if slots > E:
            raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1.33GiB.")
        return allocate(slots, *args)

    monkeypatch.setattr(slot_pool, "_allocate", short_of_memory)
    with pytest.warns(UserWarning, match="could not be allocated.*decode_bank_pieces"):
        pool.open_decode_bank(2 * E + 1)
    assert [gu.shape[0] for gu, _ in pool.banks[1:]] == [E, E, 1]
    pool.close_decode_bank()

    def broken(slots, *args):
        raise jax.errors.JaxRuntimeError("INTERNAL: something else")

    monkeypatch.setattr(slot_pool, "_allocate", broken)
    with pytest.raises(jax.errors.JaxRuntimeError, match="INTERNAL"):
        pool.open_decode_bank(2 * E + 1)
    assert pool.decode_slots == 0


def test_a_failed_bank_frees_what_it_allocated_before_it_opens_in_pieces(monkeypatch):
    """The arrays a failed one-array bank made would live on in the error's traceback, and the pieces tried next
    would find no room for them: they are freed first. Where down fails as it is allocated, gate_up is freed;
    where waiting on the bank fails, every array of it is."""
    pool = _pool(3)
    made, put, wait = [], jax.device_put, jax.block_until_ready
    out_of_memory = jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1.33GiB.")

    def down_fails(x, sharding):
        if x.shape[0] > E and x.shape[1] == F:  # the one array's down (pieces have E slots)
            raise out_of_memory
        made.append(put(x, sharding))
        return made[-1]

    monkeypatch.setattr(slot_pool.jax, "device_put", down_fails)
    with pytest.warns(UserWarning, match="could not be allocated"):
        pool.open_decode_bank(2 * E + 1)
    assert made[0].shape[0] == 2 * E + 1 and made[0].is_deleted()
    assert [gu.shape[0] for gu, _ in pool.banks[1:]] == [E, E, 1] and not any(a.is_deleted() for a in made[1:])
    pool.close_decode_bank()
    monkeypatch.setattr(slot_pool.jax, "device_put", put)

    waited = []

    def wait_fails(tree):
        if jax.tree.leaves(tree)[0].shape[0] > E:
            waited.extend(jax.tree.leaves(tree))
            raise out_of_memory
        return wait(tree)

    monkeypatch.setattr(slot_pool.jax, "block_until_ready", wait_fails)
    with pytest.warns(UserWarning, match="could not be allocated"):
        pool.open_decode_bank(2 * E + 1)
    assert len(waited) == 2 and all(a.is_deleted() for a in waited)
    assert [gu.shape[0] for gu, _ in pool.banks[1:]] == [E, E, 1]
    assert all(not a.is_deleted() for a in jax.tree.leaves(pool.banks[1:]))


def test_the_largest_block_an_allocator_could_hand_out():
    """Its largest free block, or what it may still grow by where more; None where the device does not say."""
    class Device:
        def __init__(self, stats):
            self.stats = stats

        def memory_stats(self):
            return self.stats

    held = {"largest_free_block_bytes": 5, "pool_bytes": 100, "bytes_limit": 100}
    assert slot_pool._largest_free(Device(held)) == 5
    assert slot_pool._largest_free(Device({**held, "bytes_limit": 120})) == 20
    assert slot_pool._largest_free(Device(None)) is None
    assert slot_pool._largest_free(Device({"largest_free_block_bytes": 5})) is None


def _pool(slots, layers=(1, 2)):
    return SlotPool(slots, layers, E, D, F, jnp.float32, select_devices().accel)


def test_slot_pool_lru_and_protection():
    pool = _pool(4)
    assert not pool.can_double_buffer
    s = pool.allocate(1, np.array([0, 1, 2]))
    assert sorted(s.tolist()) == [0, 1, 2] and pool.resident(1)[:3].all()
    pool.touch(1, np.array([0]))  # expert 0 is now the most recent
    s2 = pool.allocate(2, np.array([5, 6]))  # one free slot, then the LRU of layer 1 (expert 1)
    assert pool.slot_of(1)[1] == -1 and pool.slot_of(1)[0] >= 0 and pool.evictions == 1
    assert set(s2.tolist()) == {3, int(s[1])}
    with pytest.raises(ValueError, match="slots needed"):
        pool.allocate(1, np.array([3, 4, 5]), protect=(2,))
    pool.release(2, np.array([5]))
    assert pool.slot_of(2)[5] == -1 and pool.free_slots(protect=(1,)) == 2
    with pytest.raises(ValueError, match="already resident"):
        pool.allocate(1, np.array([0]))


def test_slot_pool_takes_free_then_preferred_then_lru_slots():
    pool = _pool(5)
    pool.allocate(1, np.array([0, 1, 2, 3]))
    pool.touch(1, np.array([0, 1, 2]))  # expert 3 of layer 1 is now the least recently used
    prefer = pool.slot_of(1)[[1]]
    first = pool.allocate(2, np.array([4, 5]), prefer=prefer)  # the free slot, then the preferred one
    assert pool.resident(1)[[0, 2, 3]].all() and not pool.resident(1)[1]
    assert int(prefer[0]) in first.tolist()
    pool.allocate(2, np.array([6]), prefer=np.zeros(0, np.int32))  # nothing preferred: least recently used
    assert not pool.resident(1)[3] and pool.resident(1)[[0, 2]].all()


def _stacks(seed=0, dtype=np.float32):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((E, D, 2 * F)).astype(dtype) * 0.1, rng.standard_normal((E, F, D)).astype(dtype) * 0.1)


def test_even_share_leaves_two_layer_buffers_and_over_share_names_the_least_wanted():
    """Four MoE layers of E experts in 2E + 4 slots: two whole layers and two experts in each of the other two.
    Beyond that share a layer's least wanted residents (by its scores, ties the higher ids) are named first;
    excluded layers and layers within their share name none."""
    layers = (1, 2, 3, 4)
    assert _pool(2 * E + 4, layers).even_share == 2
    assert _pool(2 * E - 1, layers).even_share == 0  # no two buffers: nothing streams
    assert _pool(2 * E, (1, 2)).even_share == E
    pool = _pool(2 * E + 4, layers)
    pool.allocate(1, np.array([0, 1, 2, 3]))
    pool.allocate(2, np.array([4, 5]))
    pool.allocate(3, np.arange(E))
    scores = {1: np.array([0, 9, 1, 8] + [0] * (E - 4)), 2: np.zeros(E), 3: np.zeros(E)}
    named = pool.over_share(2, exclude=(3,), wanted=scores.get)
    assert sorted(named.tolist()) == sorted(pool.slot_of(1)[[0, 2]].tolist())  # layer 1 keeps 1 and 3
    by_id = pool.over_share(2, exclude=(), wanted=None)
    np.testing.assert_array_equal(np.sort(by_id), np.sort(np.concatenate(
        [pool.slot_of(1)[[2, 3]], pool.slot_of(3)[np.arange(2, E)]])))  # the lowest ids kept
    assert pool.over_share(E, exclude=()).size == 0


def test_store_aliases_cpu_views_and_writes_slots_in_place():
    dev = select_devices()
    store = ExpertStore(dev)
    gu, dn = _stacks()
    store.add_layer(1, gu, dn)
    assert store.host_bytes == gu.nbytes + dn.nbytes
    assert store.host_bytes_per_model_byte == 1.0 and store.cpu_copy_bytes == 0
    pinned, _ = store.host_weights(1, 3)
    on_cpu, _ = store.cpu_weights(1, 3)
    assert pinned.sharding.memory_kind == "pinned_host" and on_cpu.devices() == {dev.cpu}
    assert on_cpu.unsafe_buffer_pointer() == pinned.unsafe_buffer_pointer()
    np.testing.assert_array_equal(np.asarray(on_cpu), gu[3])

    pool = _pool(4)
    address = pool.gate_up.unsafe_buffer_pointer()
    slots = pool.allocate(1, np.array([5, 2, 7]))
    written = store.write(pool, 1, np.array([5, 2, 7]), slots)
    assert written.nbytes == 3 * (gu[0].nbytes + dn[0].nbytes) and store.bytes_moved == written.nbytes
    np.testing.assert_array_equal(np.asarray(written.done), slots)
    assert pool.gate_up.unsafe_buffer_pointer() == address  # donated: written in place
    for e, s in zip((5, 2, 7), slots):
        np.testing.assert_array_equal(np.asarray(pool.gate_up[s]), gu[e])
        np.testing.assert_array_equal(np.asarray(pool.down[s]), dn[e])
    assert store.compiled_programs == 1  # one pull-and-commit program, for three experts

    copies = ExpertStore(dev, cpu_view="copy")
    copies.add_layer(1, gu, dn)
    assert copies.host_bytes_per_model_byte == 2.0
    if dev.accel.platform == "cpu":  # the driver's page-locking needs a GPU
        with pytest.raises(ValueError, match=r"host_alloc='driver' page-locks memory through the CUDA driver.*'jax'"):
            ExpertStore(dev, host_alloc="driver")
        assert ExpertStore(dev).host_alloc == "jax"  # what "auto" picks without a GPU
    assert store.layer_stacks(1) is None  # whole-layer stacks only when asked for (or free, with the driver)
    stacked = ExpertStore(dev, stacks=True)
    stacked.add_layer(1, gu, dn)
    np.testing.assert_array_equal(np.asarray(stacked.layer_stacks(1)[0]), gu)
    assert stacked.layer_stacks(1)[1].sharding.memory_kind == "pinned_host"
    assert stacked.host_bytes_per_model_byte == 2.0  # a second copy with jax pinning


def test_store_checks_an_alias_by_address_and_its_values_once(monkeypatch):
    store = ExpertStore(select_devices())
    gu, dn = _stacks()
    compared = []
    real = np.array_equal
    monkeypatch.setattr(expert_store.np, "array_equal", lambda a, b: compared.append(a.shape) or real(a, b))
    store.add_layer(1, gu, dn)
    assert store.cpu_copy_bytes == 0 and len(compared) == 1  # every part aliased; values compared for the first
    pinned, _ = store.host_weights(1, 0)
    other = np.zeros_like(np.asarray(pinned))  # the right shape, not pinned's memory
    assert store._reads_same_bytes(pinned, other) is False and len(compared) == 1  # refused by its address


def test_store_write_of_many_experts_stages_then_commits(monkeypatch):
    monkeypatch.setattr(expert_store, "FUSED_MAX", 2)  # three experts are "many": stage + commit
    store = ExpertStore(select_devices())
    gu, dn = _stacks()
    store.add_layer(1, gu, dn)
    pool = _pool(4)
    slots = pool.allocate(1, np.array([6, 0, 3]))
    written = store.write(pool, 1, np.array([6, 0, 3]), slots)
    assert written.nbytes == store.bytes_moved == 3 * (gu[0].nbytes + dn[0].nbytes)
    for e, s in zip((6, 0, 3), slots):
        np.testing.assert_array_equal(np.asarray(pool.gate_up[s]), gu[e])
        np.testing.assert_array_equal(np.asarray(pool.down[s]), dn[e])
    assert store.compiled_programs == 1  # one commit, three experts padded to four


@pytest.mark.parametrize("tokens, experts, programs", [
    (5, 2, {("dense", 5, 2, True)}),  # few rows: one dense program for both experts
    (5, 8, {("dense", 5, 8, True)}),
    (3, 7, {("dense", 3, 7, True)}),
    # many rows: one gathered program per expert, the first one making the accumulator
    (40, 3, {("gathered", 40, r, first) for r in (16, 32) for first in (True, False)}),
])
def test_cpu_experts_match_direct_computation(tokens, experts, programs):
    dev = select_devices()
    store = ExpertStore(dev)
    gu, dn = _stacks(1)
    store.add_layer(1, gu, dn)
    rng = np.random.default_rng(2)
    h = rng.standard_normal((tokens, D)).astype(np.float32)
    chosen = rng.choice(E, experts, replace=False)
    groups = [(int(e), np.sort(rng.choice(tokens, rng.integers(1, min(tokens, 20) + 1), replace=False)),
               rng.uniform(0.1, 1.0, tokens).astype(np.float32)) for e in chosen]
    groups = [(e, rows, w[: rows.size]) for e, rows, w in groups]
    cpu = CpuExperts(store, min_rows=16)
    y = cpu.dispatch(1, jax.device_put(h, dev.cpu), groups)
    assert y.devices() == {dev.cpu}
    want = np.zeros_like(h)
    for e, rows, w in groups:
        want[rows] += np.asarray(expert_ffn(jnp.asarray(h[rows]), gu[e], dn[e])) * w[:, None]
    np.testing.assert_allclose(np.asarray(y), want, rtol=1e-5, atol=1e-6)
    assert cpu._shapes <= programs and cpu.expert_runs == experts
    cpu.precompile(1, tokens, np.float32)
    assert cpu.expert_runs == experts  # warm-up runs are not counted
    # each as a layer's first program and as a later one. Few rows: dense, 1-8 experts. Many (40): h compacted
    # to 16 rows (dense, 16 programs) or whole (gathered, row buckets 16, 32, 64)
    assert cpu.compiled_programs == (16 if tokens <= 16 else 16 + 6)


def test_compact_rows_give_the_same_result_as_the_whole_input():
    """The CPU experts on only the rows they read, added back at those rows, equal them on the whole input."""
    dev = select_devices()
    store = ExpertStore(dev)
    gu, dn = _stacks(1)
    store.add_layer(1, gu, dn)
    rng = np.random.default_rng(3)
    n = 300
    h = rng.standard_normal((n, D)).astype(np.float32)
    groups = [(e, np.sort(rng.choice(n, size, replace=False)), rng.uniform(0.1, 1.0, size).astype(np.float32))
              for e, size in ((1, 30), (4, 3), (6, 41))]
    take, compact = cpu_experts.compact_rows(groups, n, min_rows=8)
    distinct = np.unique(np.concatenate([rows for _, rows, _ in groups]))
    assert take.size == cpu_experts.compact_size(distinct.size, n, 8) == 128 and take.dtype == np.int32
    np.testing.assert_array_equal(take[:distinct.size], distinct)
    cpu = CpuExperts(store, min_rows=8)
    whole = np.asarray(cpu.dispatch(1, jax.device_put(h, dev.cpu), groups))
    part = np.asarray(cpu.dispatch(1, jax.device_put(h[take], dev.cpu), compact))
    added = np.zeros_like(whole)
    np.add.at(added, take, part)  # the padding repeats row 0 and adds zeros there
    np.testing.assert_allclose(added, whole, rtol=1e-6, atol=1e-6)
    assert cpu_experts.compact_sizes(40, 16) == [16, 40]
    assert cpu_experts.compact_sizes(4096, 8) == [8, 32, 128, 512, 2048, 4096]
    assert [cpu_experts.compact_size(r, 300, 8) for r in (1, 8, 9, 33, 129, 300)] == [8, 8, 32, 128, 300, 300]


def test_pull_counts_are_exact_up_to_eight_then_powers_of_two():
    assert expert_store.pull_counts(6) == [0, 1, 2, 3, 4, 5, 6]
    assert expert_store.pull_counts(48) == [0, 1, 2, 3, 4, 5, 6, 7, 8, 16, 32, 48]


def test_store_stages_a_whole_stack_where_one_copy_per_array_costs_more():
    dev = select_devices()
    gu, dn = _stacks()
    plain = ExpertStore(dev)
    plain.add_layer(1, gu, dn)
    assert plain.whole_from(1) is None and not plain.moves_whole(1, E)  # no stack kept: experts one by one
    store = ExpertStore(dev, stacks=True)
    store.add_layer(1, gu, dn)
    # tiny experts: two copies of a few KB cost more than the whole 200 KB stack in two
    assert store.whole_from(1) == 2
    assert not store.moves_whole(1, 1) and store.moves_whole(1, 3)
    assert not store.moves_whole(1, 3, np.array([True, False, False]))  # an int4 copy asked for: one by one

    pool = _pool(4)
    experts = np.array([6, 0, 3])
    slots = pool.allocate(1, experts)
    staged = store.stage(1, experts)
    assert staged.stack is not None and staged.gate_ups == () and len(staged.arrays) == 2
    assert store.count_staged(1, experts) == staged.nbytes == gu.nbytes + dn.nbytes == store.bytes_moved
    store.commit(pool, staged, slots)
    for e, s in zip(experts, slots):
        np.testing.assert_array_equal(np.asarray(pool.gate_up[s]), gu[e])
        np.testing.assert_array_equal(np.asarray(pool.down[s]), dn[e])
    untouched = np.setdiff1d(np.arange(4), slots)
    assert not np.asarray(pool.gate_up[untouched]).any()  # the padding row was copied nowhere
    assert store.compiled_programs == 1  # three experts padded to four

    one = store.stage(1, np.array([5]))  # below whole_from: the expert's own arrays
    assert one.stack is None and len(one.gate_ups) == 1 and store.count_staged(1, [5]) == gu[5].nbytes + dn[5].nbytes


def test_warm_up_counts_reach_both_sides_of_the_whole_stack_switch():
    from pdscope_jax.engine.warmup import _padded_counts

    assert _padded_counts(64) == [1, 2, 4, 8, 16, 32, 64]
    assert _padded_counts(64, 27) == [1, 2, 4, 8, 16, 26, 27, 32, 64]  # 26 pads to 32 one by one, 27 whole
    assert _padded_counts(8, 8) == [1, 2, 4, 7, 8] and _padded_counts(0, 3) == []


def test_an_int4_stores_host_addresses_compute_what_the_xla_path_does():
    """An int4 store (the tiny preset's shapes, bf16 scales kept as stored) gives the addresses of its pinned
    integers and bf16 scales with its groups; the kernel's entry (`cpu_ffn.run`, the bridge's worker) reads them in
    place to the XLA dequantize path's numbers, and to the bits of the kernel's program on the same experts."""
    from pdscope_jax.kernels import cpu_ffn
    from pdscope_jax.quant.formats import quantize

    if not cpu_ffn.built():
        pytest.skip("the CPU expert kernel is not built here")
    cfg, rng = preset("tiny-deepseek-v2-lite"), np.random.default_rng(4)
    e, d, f = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    store, stacks = ExpertStore(select_devices()), {}
    for layer in cfg.moe_layers:
        stacks[layer] = [quantize(jnp.asarray(rng.standard_normal(shape) * 0.1), "int4", jnp.bfloat16)
                         for shape in ((e, d, 2 * f), (e, f, d))]
        store.add_layer(layer, *stacks[layer])
    h = jnp.asarray(rng.standard_normal((3, d)), jnp.bfloat16)
    coef = np.array([[0.5, 0.0, 0.25], [0.25, 1.0, 0.0], [0.0, 0.0, 0.0]], np.float32)  # the last: no row
    ids = np.array([5, 0, 2], np.int32)
    for layer in cfg.moe_layers:
        weights = store.host_addresses(layer)
        # D = 64 rows of gate_up: groups of gcd(64, 64); F = 32 rows of down: gcd(32, 64)
        assert (weights.bits, weights.scale_bits, weights.groups, len(weights)) == (4, 16, (64, 32), e)
        got = cpu_ffn.run(weights.take(ids), np.asarray(h), coef, (d, f))
        gate_up, down = stacks[layer]
        xla = np.asarray(cpu_ffn.moe_ffn_cpu(h, jnp.asarray(coef), gate_up, down, jnp.asarray(ids), impl="xla"))
        assert np.linalg.norm(got - xla) / np.linalg.norm(xla) < 1e-2  # bf16 rounding apart
        kernel = cpu_ffn.moe_ffn_cpu(h, jnp.asarray(coef), gate_up, down, jnp.asarray(ids), impl="kernel")
        np.testing.assert_array_equal(got, np.asarray(kernel))
