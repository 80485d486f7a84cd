"""Decode as one accelerator program per step (offload.device_decode): its residency rules on a hand-made pool,
and the engine's tokens against the plain model's for both ways of copying experts, batches, and the fallback."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pdscope_jax.models.layers import expert_ffn
from pdscope_jax.engine import bank_slots, decode, device_decode, pool_table
from pdscope_jax.store import expert_store, slot_pool
from pdscope_jax.store.slot_pool import SlotPool
from pdscope_jax.runtime import RuntimeConfig, RuntimeConfigError, select_devices
from pdscope_jax.sched import planner_class
from pdscope_jax.sched.registry import POLICIES
from bridge_stand_in import StandInBridge
from test_offload_engine import Reference, _slots

E, D, F = 4, 8, 4
NOTHING_AHEAD = {"copied_ahead": 0, "used_ahead": 0, "predicted_hits": 0, "predicted_total": 0}


@pytest.fixture(scope="module")
def experts():
    rng = np.random.default_rng(0)
    gate_up = rng.standard_normal((E, D, 2 * F)).astype(np.float32)
    down = rng.standard_normal((E, F, D)).astype(np.float32)
    return gate_up, down


def _pool(devices, gate_up, down, resident: dict[int, int]) -> SlotPool:
    """A 3-slot pool of one MoE layer (layer 5) holding `resident` {expert: slot}."""
    pool = SlotPool(3, (5,), E, D, F, jnp.float32, devices.accel)
    for clock, (expert, slot) in enumerate(resident.items(), start=1):
        pool.owner_layer[slot], pool.owner_expert[slot], pool.last_use[slot] = 5, expert, clock
        pool._slot_of[5][expert] = slot
        pool.gate_up = pool.gate_up.at[slot].set(gate_up[expert])
        pool.down = pool.down.at[slot].set(down[expert])
    return pool


def _run_layer(experts, stacks: bool, resident: dict[int, int], bonus, picks: dict[int, float], h: np.ndarray,
               host=None, ahead=None):
    """One MoE layer of one row through `_routed_experts` on a `_pool` holding `resident`; the row routes to
    `picks` {expert: weight}; `host` the step's `HostExperts`, `ahead` what the layer before copied ahead. Checks
    its output against the experts' weighted sum. -> (pool, counts, table)."""
    devices = select_devices()
    gate_up, down = experts
    pinned = jax.sharding.SingleDeviceSharding(devices.accel, memory_kind="pinned_host")
    if stacks:
        layer = (jax.device_put(gate_up, pinned), jax.device_put(down, pinned))
    else:
        layer = (tuple(jax.device_put(g, pinned) for g in gate_up), tuple(jax.device_put(d, pinned) for d in down))
    pool = _pool(devices, gate_up, down, resident)
    table = pool_table.upload(pool, (5,), None if bonus is None else np.array(bonus), devices.accel)
    on_accel = lambda a: jax.device_put(a, devices.accel)  # noqa: E731
    ids, weights = on_accel(np.array([list(picks)], np.int32)), on_accel(np.array([list(picks.values())], np.float32))
    y, pool.banks, table, _ = jax.jit(functools.partial(device_decode._routed_experts, host=host, ahead=ahead),
                                     static_argnums=0)(
        0, on_accel(h), weights, ids, layer, pool.banks, table)
    want = sum(w * expert_ffn(jnp.asarray(h), gate_up[e], down[e]) for e, w in picks.items())
    np.testing.assert_allclose(np.asarray(y), np.asarray(want), rtol=1e-5, atol=1e-5)
    return pool, pool_table.download(table, pool, (5,)), table


@pytest.mark.parametrize("stacks, exact_pulls", [(True, 8), (True, 1), (False, 8)])
@pytest.mark.parametrize("bonus", [None, [[900, 10, 5, 800]]])
def test_a_layer_copies_its_misses_and_keeps_them_by_the_rule(experts, stacks, exact_pulls, bonus, monkeypatch):
    """Experts 0 and 1 resident (used at clocks 1 and 2); the layer runs at clock 3 and its row picks experts 1, 2,
    3. LRU: the two misses take the free slot and expert 0's. Bonuses: the misses, most worth first (3: 3 + 800,
    2: 3 + 5), against the slots least worth keeping (the free one, then expert 0's: 1 + 900): expert 3 takes the
    free slot, expert 2 is not worth expert 0's.
    With exact_pulls 1 the two misses copy three experts (a rounded-up branch): the same result."""
    monkeypatch.setattr(expert_store, "EXACT_PULLS", exact_pulls)
    gate_up, down = experts
    h = np.random.default_rng(1).standard_normal((1, D)).astype(np.float32)
    pool, counts, table = _run_layer(experts, stacks, {0: 0, 1: 1}, bonus, {3: 0.5, 1: 0.3, 2: 0.2}, h)
    kept = {2, 3} if bonus is None else {0, 3}
    assert counts == {"activated": 3, "hits": 1, "evictions": 1 if bonus is None else 0, "on_host": 0, **NOTHING_AHEAD}
    assert set(pool.owner_expert[pool.owner_expert >= 0]) == kept | {1}
    for expert in kept | {1}:  # every resident slot holds its expert's weights
        slot = pool.slot_of(5)[expert]
        np.testing.assert_array_equal(np.asarray(pool.gate_up[slot]), gate_up[expert])
        np.testing.assert_array_equal(np.asarray(pool.down[slot]), down[expert])
    assert np.asarray(table.routed)[0].tolist() == [0, 1, 1, 1]


def test_slots_are_numbered_over_the_banks_one_after_the_other():
    """A pool of 3 slots and a bank of 2: slots 3 and 4 are the bank's rows 0 and 1, reads and writes alike; a
    target past both banks is dropped."""
    pool = [np.arange(3 * 2, dtype=np.float32).reshape(3, 2), np.arange(3, dtype=np.float32) + 10]
    bank = [np.arange(2 * 2, dtype=np.float32).reshape(2, 2) + 100, np.arange(2, dtype=np.float32) + 110]
    banks = (tuple(map(jnp.asarray, pool)), tuple(map(jnp.asarray, bank)))
    taken = bank_slots.take(banks, jnp.array([4, 0, 3, 2]))
    np.testing.assert_array_equal(taken[0], np.stack([bank[0][1], pool[0][0], bank[0][0], pool[0][2]]))
    np.testing.assert_array_equal(taken[1], [111, 10, 110, 12])
    parts = (-np.ones((3, 2), np.float32) * [[1], [2], [3]], -np.array([1, 2, 3], np.float32))
    (p_gu, p_dn), (b_gu, b_dn) = bank_slots.put(banks, jnp.array([1, 4, 7]), parts)
    np.testing.assert_array_equal(p_dn, [10, -1, 12])
    np.testing.assert_array_equal(b_dn, [110, -2])
    np.testing.assert_array_equal(p_gu[1], [-1, -1])
    np.testing.assert_array_equal(b_gu, [bank[0][0], [-2, -2]])


def test_decode_bank_serves_decode_and_is_gone_after_it(ds):
    """A budget whose pool holds 5 slots while decode gets 6 more in the bank: the plain model's tokens, more
    hits than the pool alone gives, the bank closed once decode ends and the pool's table whole."""
    slot = ds.cfg.expert_bytes(4)
    probe = ds.runner("ondemand", 1)
    fixed = probe.budget.fixed
    config = probe.runtime.replace(gpu_memory=fixed + 5 * slot + slot // 2, expert_pool=11 * slot)
    hits = {}
    for bank in (True, False):
        runner = type(probe)(ds.model, config.replace(decode_bank=bank))
        assert runner.pool.num_slots == 5 and runner.budget.decode_slots == (6 if bank else 0)
        np.testing.assert_array_equal(runner.generate(ds.ids, ds.new).tokens, ds.tokens)
        decode = runner.stats["decode"]
        assert decode["device_steps"] == ds.new - 1
        hits[bank] = decode["hits"]
        assert runner.pool.decode_slots == 0 and len(runner.pool.banks) == 1
        owners = runner.pool.owner_layer >= 0
        assert all(runner.pool.slot_of(int(layer))[expert] == slot_no for slot_no, (layer, expert) in
                   enumerate(zip(runner.pool.owner_layer, runner.pool.owner_expert)) if owners[slot_no])
    assert hits[True] > hits[False]


def test_a_step_that_copies_nothing_fills_the_decode_bank_once_as_it_opens(ds):
    """static, its misses computed by the host (XLA ops, the bridge's stand-in): its steps copy nothing, so the
    decode bank (6 slots beside a pool of 5) is filled as decode starts, 2 experts for each of the 3 MoE layers:
    the plain model's tokens, those bytes counted as moved, more hits than without the bank, and the bank gone
    after decode."""
    runner_type, config, slot = _host_computes_every_miss(ds)
    hits = {}
    for bank in (True, False):
        runner = runner_type(ds.model, config.replace(decode_bank=bank))
        assert runner.decode_host(1).copies is False
        np.testing.assert_array_equal(runner.generate(ds.ids, ds.new).tokens, ds.tokens)
        decode = runner.stats["decode"]
        assert decode["experts_placed"] == (6 if bank else 0)
        assert decode["bytes_moved"] == decode["experts_placed"] * slot
        hits[bank] = decode["hits"]
        assert runner.pool.decode_slots == 0
    assert hits[True] > hits[False]


def test_a_decode_bank_in_pieces_gives_the_plain_models_tokens_and_the_same_hits(ds):
    """A bank of 10 slots beside a pool of 5, as one array and as pieces of a layer's 8 experts (8 + 2): the fill
    writes each expert into its piece, the steps read them where they lie (the plain model's tokens), and the hits
    and bytes moved are those of the one array."""
    runner_type, config, slot = _host_computes_every_miss(ds)
    decode = {}
    for pieces in (False, True):
        runner = runner_type(ds.model, config.replace(expert_pool=15 * slot, decode_bank_pieces=pieces))
        assert runner.decode_slots == 10 and ds.cfg.num_experts == 8
        np.testing.assert_array_equal(runner.generate(ds.ids, ds.new).tokens, ds.tokens)
        decode[pieces] = {k: runner.stats["decode"][k] for k in ("hits", "experts_placed", "bytes_moved")}
        assert runner.pool.decode_slots == 0
    assert decode[True] == decode[False] and decode[True]["experts_placed"] == 10


def test_a_bank_no_free_block_holds_opens_in_pieces_and_decodes_the_plain_models_tokens(ds, monkeypatch):
    """Where the allocator has no free block for the bank's one array, decode opens it in pieces (8 + 2 slots)
    though `decode_bank_pieces` is off, warns, and still gives the plain model's tokens."""
    runner_type, config, slot = _host_computes_every_miss(ds)
    runner = runner_type(ds.model, config.replace(expert_pool=15 * slot))
    monkeypatch.setattr(slot_pool, "_largest_free", lambda device: slot)
    opened, close = [], runner.pool.close_decode_bank
    monkeypatch.setattr(runner.pool, "close_decode_bank",
                        lambda: opened.append(len(runner.pool.banks) - 1) or close())
    with pytest.warns(UserWarning, match="decode_bank_pieces"):
        np.testing.assert_array_equal(runner.generate(ds.ids, ds.new).tokens, ds.tokens)
    assert opened[-1] == 2 and not runner.runtime.decode_bank_pieces


@pytest.mark.parametrize("policy", ["ondemand", "pdscope"])
def test_steps_that_copy_into_a_bank_in_pieces_keep_the_plain_models_tokens(ds, policy):
    """Policies whose steps copy misses into the slots write them into the bank's pieces too (each bank written
    where the slot lies): the plain model's tokens, and the hits and bytes moved of one array."""
    runner_type, config, slot = _host_computes_every_miss(ds)
    placed = {}
    for pieces in (False, True):
        runner = runner_type(ds.model, config.replace(policy=policy, expert_pool=15 * slot, decode_bank_pieces=pieces,
                                                      decode_cpu_experts="off", policy_options=()))
        np.testing.assert_array_equal(runner.generate(ds.ids, ds.new).tokens, ds.tokens)
        assert runner.stats["decode"]["device_steps"] == ds.new - 1
        placed[pieces] = (runner.stats["decode"]["hits"], runner.stats["decode"]["bytes_moved"])
    assert placed[True] == placed[False] and min(placed[True]) > 0


def _host_computes_every_miss(ds):
    """(runner class, config, expert bytes): `static` with a pool of 5 slots and a decode bank of 6, its misses
    computed by the host (XLA ops, the bridge's stand-in), so its steps copy nothing."""
    slot = ds.cfg.expert_bytes(4)
    probe = ds.runner("static", 1)
    config = probe.runtime.replace(gpu_memory=probe.budget.fixed + 5 * slot + slot // 2, expert_pool=11 * slot,
                                   decode_cpu_experts="xla", policy_options=(("hot_per_layer", 1),))
    return type(probe), config, slot


def test_without_a_hot_table_the_bank_takes_each_layers_most_routed_experts(ds, monkeypatch):
    """The decode bank's order is the run's routing so far (this generation's prefill), ties by id."""
    runner_type, config, _ = _host_computes_every_miss(ds)
    runner = runner_type(ds.model, config)
    ranks, fill = [], pool_table.bank_fill
    monkeypatch.setattr(pool_table, "bank_fill", lambda pool, moe, rank, rows: ranks.append(rank) or fill(
        pool, moe, rank, rows))
    runner.generate(ds.ids, ds.new)
    routed = runner.activation_counts["prefill"]
    want = np.stack([np.argsort(-routed[layer], kind="stable") for layer in ds.cfg.moe_layers])
    assert len(ranks) == 1 and (want != np.arange(ds.cfg.num_experts)).any()  # not the order by id
    np.testing.assert_array_equal(ranks[0], want)
    assert runner.stats["decode"]["experts_placed"] == 6


def test_the_bank_is_filled_by_layer_in_turn_with_each_layers_most_wanted_absent_experts(experts):
    devices = select_devices()
    pool = SlotPool(4, (2, 5), E, D, F, jnp.float32, devices.accel)
    pool.owner_layer[0], pool.owner_expert[0] = 5, 3
    pool._slot_of[5][3] = 0
    rank = np.array([[3, 2, 1, 0], [3, 2, 1, 0]])
    assert pool_table.bank_fill(pool, (2, 5), rank, 5) == [(0, 3), (1, 2), (0, 2), (1, 1), (0, 1)]
    assert pool_table.bank_fill(pool, (2, 5), None, 3) == [(0, 0), (1, 0), (0, 1)]
    pool.open_decode_bank(2)
    table = pool_table.upload(pool, (2, 5), None, devices.accel, [(0, 3), (1, 2)])
    assert np.asarray(table.slot_of).tolist() == [[-1, -1, -1, 4], [-1, -1, 5, 0]]
    assert np.asarray(table.owner).tolist()[4:] == [3, E + 2]


def test_upload_then_download_leaves_the_pool_as_it_was(experts):
    devices = select_devices()
    pool = _pool(devices, *experts, {2: 0, 0: 2})
    before = (pool.owner_layer.copy(), pool.owner_expert.copy(), pool.slot_of(5))
    pool_table.download(pool_table.upload(pool, (5,), None, devices.accel), pool, (5,))
    after = (pool.owner_layer, pool.owner_expert, pool.slot_of(5))
    for a, b in zip(before, after):
        np.testing.assert_array_equal(a, b)


@pytest.fixture(scope="module")
def ds():
    return Reference("tiny-deepseek-v2-lite", batch=1, prompt=20, new=10)


def test_the_decode_step_traces_a_layer_kind_once(ds, monkeypatch):
    """The step's MoE layers are one nested program with the position as a value: building the step traces the
    layers' expert code once for all three MoE layers (ondemand: no copies ahead, so every layer is of one kind),
    and the tokens stay the plain model's."""
    traced = []
    routed = device_decode._routed_experts
    monkeypatch.setattr(device_decode, "_routed_experts", lambda m, *a, **k: traced.append(m) or routed(m, *a, **k))
    # a step traced by an earlier test would be reused without tracing: forget the traces of the step and of its
    # nested experts program only (jax.clear_caches() would make every later test compile all it runs again)
    device_decode.build_decode_step().clear_cache()
    device_decode._experts_program.clear_cache()
    runner = ds.runner("ondemand", _slots(ds, "small"))
    np.testing.assert_array_equal(runner.generate(ds.ids, ds.new).tokens, ds.tokens)
    assert runner.stats["decode"]["device_steps"] == ds.new - 1 and len(ds.cfg.moe_layers) == 3
    assert len(traced) == 1 and isinstance(traced[0], jax.core.Tracer)


@pytest.mark.parametrize("stacks", [False, True])
def test_warmup_compiles_every_size_of_the_decode_banks_fill(ds, stacks, monkeypatch):
    """Decode's bank fill writes groups of at most a layer's share, whose sizes follow the real prompt's routing
    (warm-up's dummy tokens may give other sizes): after warm-up, writing any such group into the bank, or staging
    any count into the pool, compiles nothing, whether the count moves experts one by one or (stacks) the whole
    layer."""
    slot = ds.cfg.expert_bytes(4)
    # a copy's own cost at a quarter of an expert's bytes' time: of 8 experts, 6 or more move whole, and 5 pads to
    # the size 8 that whole stacks also take
    monkeypatch.setattr(expert_store, "COPY_SECONDS", slot / expert_store.LINK_BYTES_PER_SECOND / 4)
    runner_type, config, _ = _host_computes_every_miss(ds)
    runner = runner_type(ds.model, config, expert_stacks=stacks)
    runner.warmup(1, ds.ids.shape[1], ds.new)
    compiled = runner.compiled_programs["slot_commit"]
    layer, store = ds.cfg.moe_layers[-1], runner.store
    runner.pool.open_decode_bank(runner.decode_slots)
    pooled, bank = runner.pool.banks
    group = runner.budget.decode_fill_group
    for n in range(1, min(group, runner.decode_slots) + 1):
        bank = store.write_bank(bank, layer, np.arange(n), np.arange(n))
    runner.pool.banks = (pooled, bank)
    runner.pool.close_decode_bank()
    for n in range(1, min(ds.cfg.num_experts, runner.pool.num_slots) + 1):
        experts = np.arange(n)
        runner.pool.release(layer, experts)
        store.commit(runner.pool, store.stage(layer, experts), runner.pool.allocate(layer, experts))
    assert runner.decode_slots == 6 and group == 2 and runner.compiled_programs["slot_commit"] == compiled
    assert store.whole_from(layer) == (6 if stacks else None)


def test_warmup_compiles_the_fills_writes_into_each_shape_of_bank_piece(ds):
    """A bank in pieces of 8 and 2 slots: after warm-up, a group of any size the fill writes into either piece
    compiles nothing."""
    runner_type, config, slot = _host_computes_every_miss(ds)
    runner = runner_type(ds.model, config.replace(expert_pool=15 * slot, decode_bank_pieces=True))
    runner.warmup(1, ds.ids.shape[1], ds.new)
    compiled = runner.compiled_programs["slot_commit"]
    layer, store, group = ds.cfg.moe_layers[-1], runner.store, runner.budget.decode_fill_group
    runner.pool.open_decode_bank(runner.decode_slots, pieces=True)
    pooled, *pieces = runner.pool.banks
    assert [piece[0].shape[0] for piece in pieces] == [8, 2]
    for i, piece in enumerate(pieces):
        for n in range(1, min(group, piece[0].shape[0]) + 1):
            pieces[i] = store.write_bank(pieces[i], layer, np.arange(n), np.arange(n))
    runner.pool.banks = (pooled, *pieces)
    runner.pool.close_decode_bank()
    assert runner.compiled_programs["slot_commit"] == compiled


@pytest.mark.parametrize("stacks", [True, False])
@pytest.mark.parametrize("policy", ["ondemand", "pdscope"])
def test_decode_on_device_matches_plain_model(ds, policy, stacks):
    """Evictions on every step (a pool of 5 slots), the pdscope run with a hot table's bonuses."""
    config = ds.runner(policy, _slots(ds, "small")).runtime
    if policy == "pdscope":
        counts = {layer: np.arange(ds.cfg.num_experts)[::-1] + 1 for layer in ds.cfg.moe_layers}
        config = config.replace(policy_options=(("activation_counts", counts),))
    runner = type(ds.runner(policy, 1))(ds.model, config, expert_stacks=stacks)
    out = runner.generate(ds.ids, ds.new)
    np.testing.assert_array_equal(out.tokens, ds.tokens)
    decode = runner.stats["decode"]
    assert decode["device_steps"] == decode["steps"] == ds.new - 1 and decode["tokens"] == ds.new - 1
    loaded = decode["experts_loaded_now"]
    assert decode["activated"] == decode["hits"] + loaded and loaded > 0
    assert decode["bytes_moved"] == loaded * ds.cfg.expert_bytes(4) and runner.stats["evictions"] > 0
    assert sum(c.sum() for c in runner.activation_counts["decode"].values()) == (ds.new - 1) * len(
        ds.cfg.moe_layers) * ds.cfg.num_experts_per_tok
    # jax's pinned arrays need a second copy for whole-layer stacks; the driver's buffers (a GPU) are the stacks
    assert runner.store.host_bytes_per_model_byte == (2.0 if stacks and runner.store.host_alloc == "jax" else 1.0)


def test_batched_decode_on_device_matches_plain_model():
    ref = Reference("tiny-deepseek-v2-lite", batch=2, prompt=12, new=5, seed=3)
    runner = ref.runner("ondemand", 7, max_batch=2)  # more slots than a step's distinct experts per layer (6)
    np.testing.assert_array_equal(runner.generate(ref.ids, ref.new).tokens, ref.tokens)
    assert runner.stats["decode"]["device_steps"] == ref.new - 1


def test_a_pool_too_small_for_a_layer_decodes_on_the_host(ds):
    runner = ds.runner("ondemand", ds.cfg.num_experts_per_tok)  # no slot to spare for a miss
    np.testing.assert_array_equal(runner.generate(ds.ids, ds.new).tokens, ds.tokens)
    decode = runner.stats["decode"]
    assert decode["device_steps"] == 0 and decode["steps"] == ds.new - 1


@pytest.mark.parametrize("policy", ["ondemand", "pdscope"])
def test_host_decode_still_matches_plain_model(ds, policy):
    runner = ds.runner(policy, _slots(ds, "small"), device_decode=False)
    np.testing.assert_array_equal(runner.generate(ds.ids, ds.new).tokens, ds.tokens)
    assert runner.stats["decode"]["device_steps"] == 0 and runner.stats["decode"]["planner_calls"] > 0


@pytest.mark.parametrize("policy", list(POLICIES))
def test_decode_runs_on_device_exactly_when_the_planner_and_the_switches_allow(ds, policy):
    """The step executor follows the planner's capability `decodes_on_device` with RuntimeConfig.device_decode
    on, and the host-planned loop otherwise; tokens are the plain model's either way."""
    planner = planner_class(policy)
    on_device = planner.decodes_on_device and planner.decode_copies  # no CUDA bridge here: `static` stays on the host
    runner = ds.runner(policy, _slots(ds, "all" if planner_class(policy).keeps_all_resident else "small"))
    np.testing.assert_array_equal(runner.generate(ds.ids, 3).tokens, ds.tokens[:, :3])
    decode_stats = runner.stats["decode"]
    assert decode_stats["steps"] == 2 and decode_stats["device_steps"] == (2 if on_device else 0)
    assert (decode_stats["planner_calls"] == 0) == on_device
    runner.set_policy(policy, runner.runtime.policy_options, device_decode=False)
    np.testing.assert_array_equal(runner.generate(ds.ids, 3).tokens, ds.tokens[:, :3])
    assert runner.stats["decode"]["device_steps"] == 0 and runner.stats["decode"]["planner_calls"] > 0


def test_the_device_executor_needs_async_io_batched_gpu_a_large_enough_pool_and_steps(ds):
    runner = ds.runner("ondemand", _slots(ds, "small"))
    assert decode.choose(runner, 1, 5) is decode.DeviceDecode
    assert decode.choose(runner, 1, 0) is decode.HostDecode  # nothing to decode
    assert decode.choose(runner, 2, 5) is decode.HostDecode  # 2 rows x top-3 = 6 picks: 5 slots leave no victim
    for switch in ("async_io", "batched_gpu", "device_decode"):
        runner.set_policy("ondemand", **{switch: False})
        assert decode.choose(runner, 1, 5) is decode.HostDecode, switch
        runner.set_policy("ondemand", **{switch: True})


def test_a_miss_worth_less_than_every_evictable_resident_is_used_once(experts):
    """A full pool {0, 1, 3}; the row picks 1, 2, 3 at clock 4, so only expert 0 (1 + 900) could make room for
    expert 2 (4 + 5)."""
    pool, counts, _ = _run_layer(experts, True, {0: 0, 1: 1, 3: 2}, [[900, 10, 5, 800]], {2: 0.6, 1: 0.3, 3: 0.1},
                                 np.ones((1, D), np.float32))
    assert counts == {"activated": 3, "hits": 2, "evictions": 0, "on_host": 0, **NOTHING_AHEAD}
    assert pool.slot_of(5).tolist() == [0, 1, -1, 2]
    np.testing.assert_array_equal(np.asarray(pool.gate_up[0]), experts[0][0])  # its weights untouched


@pytest.mark.parametrize("favourite_bonus, kept", [(5, False), (2, True)])
def test_a_favourite_outlives_its_last_use_by_its_bonus_only(experts, favourite_bonus, kept):
    """A full pool {0, 1, 2} used at clocks 1, 2, 3; experts 1 and 2 worth 9 more, expert 0 (the least recently
    used) `favourite_bonus` more. At clock 4 the row picks expert 3 (no bonus: worth 4): it replaces expert 0 only
    when expert 0's last use plus bonus (1 + 5 = 6, or 1 + 2 = 3) is worth less."""
    pool, counts, _ = _run_layer(experts, True, {0: 0, 1: 1, 2: 2}, [[favourite_bonus, 9, 9, 0]], {3: 1.0},
                                 np.ones((1, D), np.float32))
    assert counts["evictions"] == int(kept)
    assert pool.slot_of(5).tolist() == ([-1, 1, 2, 0] if kept else [0, 1, 2, -1])
    assert pool.last_use[pool.slot_of(5)[1]] == 2  # download gives back last uses, not worths


def _claim_one_by_one(keep, owner, misses, worth, rows):
    """The residency rule as a loop: the first `rows` misses, most worth first (then lowest id), each take the slot
    least worth keeping (the lowest index among equals) when worth more than it. -> each slot's owner after the
    layer."""
    keep, owner = list(keep), list(owner)
    for expert in sorted(misses, key=lambda e: (-worth[e], e))[:rows]:
        victim = min(range(len(keep)), key=lambda s: (keep[s], s))
        if worth[expert] > keep[victim]:
            owner[victim], keep[victim] = expert, worth[expert]
    return owner


def test_pairing_misses_with_victims_equals_claiming_slots_one_by_one():
    """Random pools of one MoE layer (12 experts, 9 slots, some free), random worths (ties included, and LRU),
    4 rows of top-2 (at most 8 picks: `fits`, of which 4 may be kept): the table `_routed_experts` leaves equals
    the rule applied one miss at a time."""
    devices = select_devices()
    e, slots, d, f = 12, 9, 4, 2
    rng = np.random.default_rng(7)
    zeros = lambda *shape: jnp.zeros(shape, jnp.float32)  # noqa: E731
    pinned = jax.sharding.SingleDeviceSharding(devices.accel, memory_kind="pinned_host")
    layer = (jax.device_put(np.zeros((e, d, 2 * f), np.float32), pinned),
             jax.device_put(np.zeros((e, f, d), np.float32), pinned))
    step = jax.jit(device_decode._routed_experts, static_argnums=0)
    for case in range(30):
        residents = rng.choice(e, rng.integers(0, slots + 1), replace=False)
        owner = np.full(slots, -1, np.int32)
        owner[rng.choice(slots, len(residents), replace=False)] = residents
        lru = case % 3 == 0
        bonus = np.zeros(e, np.int32) if lru else rng.integers(0, 4, e).astype(np.int32)
        keep = np.where(owner >= 0, rng.integers(0, 4, slots) + bonus[np.maximum(owner, 0)], -1)  # ties likely
        slot_of = np.full(e, -1, np.int32)
        slot_of[owner[owner >= 0]] = np.flatnonzero(owner >= 0)
        ids = np.stack([rng.choice(e, 2, replace=False) for _ in range(4)]).astype(np.int32)
        table = pool_table.PoolTable(slot_of[None], owner, keep.astype(np.int32), bonus[None], np.int32(4),
                                     np.zeros(len(pool_table.COUNTS), np.int32), np.zeros((1, e), np.int32))
        _, _, after, _ = step(0, zeros(4, d), zeros(4, 2), ids, layer, ((zeros(slots, d, 2 * f), zeros(slots, f, d)),),
                           jax.device_put(table, devices.accel))
        picked = set(ids.reshape(-1).tolist())
        worth = {x: 5 + int(bonus[x]) for x in picked}  # the layer's clock, 5, plus the expert's bonus
        protected = np.where(np.isin(owner, list(picked)), np.iinfo(np.int32).max, keep)
        rows = device_decode.kept_rows(min(ids.size, e))
        want_owner = _claim_one_by_one(protected, owner, sorted(picked - set(residents.tolist())), worth, rows)
        assert np.asarray(after.owner).tolist() == want_owner, case
        got_slot_of = np.asarray(after.slot_of)[0]
        assert all(got_slot_of[x] == s for s, x in enumerate(want_owner) if x >= 0), case
        assert sorted(np.flatnonzero(got_slot_of >= 0).tolist()) == sorted(x for x in want_owner if x >= 0), case


@pytest.mark.parametrize("stacks", [True, False])
@pytest.mark.parametrize("fill_free, on_host", [(False, {2, 3}), (True, {2})])
def test_the_host_computes_the_misses_not_copied(experts, stacks, fill_free, on_host):
    """Experts 0 and 1 resident in 3 slots; the row picks 1, 2, 3 (misses 3 then 2, most worth first). With no
    share copied the host computes both misses and the pool keeps what it held; filling free slots, the first
    miss takes the free slot and only the second goes to the host. The sum is exact either way."""
    h = np.random.default_rng(2).standard_normal((1, D)).astype(np.float32)
    host = device_decode.HostExperts(0.0, None, fill_free)
    pool, counts, _ = _run_layer(experts, stacks, {0: 0, 1: 1}, [[0, 0, 0, 800]], {3: 0.5, 1: 0.3, 2: 0.2}, h, host)
    assert counts == {"activated": 3, "hits": 1, "evictions": 0, "on_host": len(on_host), **NOTHING_AHEAD}
    assert set(pool.owner_expert[pool.owner_expert >= 0]) == {0, 1, 2, 3} - on_host


def test_a_full_copy_share_is_the_step_without_the_host(experts):
    h = np.random.default_rng(3).standard_normal((1, D)).astype(np.float32)
    runs = [_run_layer(experts, True, {0: 0, 1: 1}, None, {3: 0.5, 1: 0.3, 2: 0.2}, h, host)
            for host in (None, device_decode.HostExperts(1.0, None, True))]
    (pool_a, counts_a, _), (pool_b, counts_b, _) = runs
    assert counts_a == counts_b and counts_b["on_host"] == 0
    np.testing.assert_array_equal(pool_a.owner_expert, pool_b.owner_expert)


@pytest.mark.parametrize("share, fill_free, on_host, kept", [
    (1.0, True, set(), {1, 2, 3}), (0.0, True, {2}, {0, 1, 3}),
    (0.5, False, {2}, {0, 1, 3}), (0.0, False, {2, 3}, {0, 1})])
def test_the_bridges_copies_give_the_exact_sum_and_the_same_pool(experts, share, fill_free, on_host, kept,
                                                                  monkeypatch):
    """The bridge's worker copying the misses (`HostExperts.bridge_copies`, a stand-in bridge here): the same row
    layout as the program's own copies, so the same exact sum, the same counts and the same pool; the program
    holds no conditional to size its copies, and writes no weights where it copies nothing; the host computes
    the misses not copied, and none at a share of 1.
    Experts 0 and 1 resident in 3 slots; the row picks 1, 2, 3 (misses 3 then 2, most worth first); all copied,
    2 is worth more than expert 0's slot (LRU ticks) and takes it."""
    stand_in = StandInBridge([experts])
    stand_in.install(monkeypatch)
    h = np.random.default_rng(2).standard_normal((1, D)).astype(np.float32)
    host = device_decode.HostExperts(share, stand_in, fill_free, bridge_copies=True)
    bonus, picks = [[0, 0, 0, 800]], {3: 0.5, 1: 0.3, 2: 0.2}
    pool, counts, _ = _run_layer(experts, True, {0: 0, 1: 1}, bonus, picks, h, host)
    assert counts == {"activated": 3, "hits": 1, "evictions": 0 if 0 in kept else 1, "on_host": len(on_host),
                      **NOTHING_AHEAD}
    assert set(pool.owner_expert[pool.owner_expert >= 0]) == kept
    for expert in kept:  # every resident slot holds its expert's weights
        np.testing.assert_array_equal(np.asarray(pool.gate_up[pool.slot_of(5)[expert]]), experts[0][expert])
    assert len(stand_in.copies) == (1 if host.copies else 0)
    program = jax.make_jaxpr(functools.partial(device_decode._routed_experts, host=host), static_argnums=0)
    table = pool_table.upload(_pool(select_devices(), *experts, {0: 0, 1: 1}), (5,), np.array(bonus),
                                 select_devices().accel)
    jaxpr = program(0, jnp.asarray(h), jnp.ones((1, 3)), jnp.array([[3, 1, 2]], jnp.int32),
                    tuple(jnp.asarray(a) for a in experts), _pool(select_devices(), *experts, {}).banks, table)
    assert "cond" not in {eqn.primitive.name for eqn in jaxpr.eqns}
    weight_writes = [eqn for eqn in jaxpr.eqns
                     if eqn.primitive.name.startswith("scatter") and eqn.invars[0].aval.shape[1:] == (D, 2 * F)]
    assert bool(weight_writes) == host.copies  # a step that copies nothing writes no expert's weights anywhere


def test_a_miss_copied_ahead_is_taken_from_there_and_neither_copied_again_nor_computed(experts, monkeypatch):
    """Experts 0 and 1 resident in 3 slots (LRU); the layer before predicted 0, 1, 2 and copied 2 ahead (its
    ahead rows: row 2 holds expert 2, rows 0 and 1 nothing). The row picks 1, 2, 3: miss 2 takes ahead row 2
    (copy id -2 - 2), the other miss, 3, goes to the host (a copy share of 0.4 of one miss rounds to none, free
    slots not filled); the sum
    is exact although the stand-in's host copy of expert 2 is zeros (so its row came from ahead); 2 enters the
    free slot like any copy; the counts say one used ahead and two of three predicted."""
    gate_up, down = (jnp.asarray(a) for a in experts)
    stand_in = StandInBridge([(gate_up.at[2].set(0.0), down.at[2].set(0.0))])
    stand_in.install(monkeypatch)
    rows = jnp.array([0, 0, 2])
    ahead = device_decode.Ahead(jnp.array([0, 1, 2], jnp.int32), jnp.array([-1, -1, 2], jnp.int32),
                                (gate_up[rows].at[:2].set(0.0), down[rows].at[:2].set(0.0)))
    h = np.random.default_rng(4).standard_normal((1, D)).astype(np.float32)
    host = device_decode.HostExperts(0.4, stand_in, False, bridge_copies=True, ahead=True)
    pool, counts, _ = _run_layer(experts, True, {0: 0, 1: 1}, None, {3: 0.5, 1: 0.3, 2: 0.2}, h, host, ahead)
    assert counts == {"activated": 3, "hits": 1, "evictions": 0, "on_host": 1, "copied_ahead": 0, "used_ahead": 1,
                      "predicted_hits": 2, "predicted_total": 3}
    assert set(pool.owner_expert[pool.owner_expert >= 0]) == {0, 1, 2}
    np.testing.assert_array_equal(np.asarray(pool.gate_up[pool.slot_of(5)[2]]), experts[0][2])


def test_copies_ahead_keep_the_plain_models_tokens_and_count_what_they_predicted(ds, monkeypatch):
    """pdscope (it reads next-layer scores and decodes on the device), its misses copied by the bridge's worker (a
    stand-in here): each
    layer predicts the next one's experts and has them copied ahead. The plain model's tokens with and without
    copies ahead; with them, predicted misses are served from the copies ahead (counted as hits, as the host
    loop counts experts in flight), the bytes moved are the copies made when routed and those made ahead, and
    the run reports its prediction recall; without them it predicts nothing."""
    stats = {}
    for ahead in (True, False):
        runner = ds.runner("pdscope", _slots(ds, "small"), decode_cpu_experts="off", decode_copies_ahead=ahead)
        layers = [tuple(np.stack([np.asarray(a) for a in part]) for part in runner.store.layer_experts(layer))
                  for layer in runner.config.moe_layers]
        stand_in = StandInBridge(layers)
        stand_in.install(monkeypatch)
        split = runner.host_split
        split._bridge = lambda batch, split=split, stand_in=stand_in: split.bridges.setdefault(batch, stand_in)
        assert runner.decode_host(1).copies_ahead == ahead
        np.testing.assert_array_equal(runner.generate(ds.ids, ds.new).tokens, ds.tokens)
        stats[ahead] = decode_stats = runner.stats["decode"]
        assert decode_stats["device_steps"] == ds.new - 1 and decode_stats["cpu_experts"] == 0
        copied = decode_stats["experts_loaded_now"] + decode_stats["experts_prefetched"]
        assert decode_stats["bytes_moved"] == copied * ds.cfg.expert_bytes(4)
        assert decode_stats["activated"] == decode_stats["hits"] + decode_stats["experts_loaded_now"]
        split.bridges.clear()
    assert stats[False]["experts_prefetched"] == 0 and stats[False]["prediction_recall"] is None
    assert 0 < stats[True]["prefetch_used"] <= stats[True]["experts_prefetched"]
    assert 0 < stats[True]["prediction_recall"] <= 1
    assert stats[True]["experts_loaded_now"] < stats[False]["experts_loaded_now"]


@pytest.mark.parametrize("share", [0.0, 0.5])
def test_misses_split_with_the_host_still_give_the_plain_model(ds, share):
    """pdscope with the host's part computed by XLA ops (RuntimeConfig.decode_cpu_experts="xla", the stand-in
    for the CUDA bridge): the plain model's tokens, some experts computed by the host."""
    runner = ds.runner("pdscope", _slots(ds, "small"), decode_cpu_experts="xla", decode_copy_share=share)
    np.testing.assert_array_equal(runner.generate(ds.ids, ds.new).tokens, ds.tokens)
    decode_stats = runner.stats["decode"]
    assert decode_stats["device_steps"] == ds.new - 1 and decode_stats["cpu_experts"] > 0
    assert decode_stats["gpu_experts"] + decode_stats["cpu_experts"] == decode_stats["activated"]
    assert decode_stats["bytes_moved"] == decode_stats["experts_loaded_now"] * ds.cfg.expert_bytes(4)


def test_static_decodes_on_device_only_where_the_host_computes_and_never_copies(ds):
    runner = ds.runner("static", _slots(ds, "small"))
    assert decode.choose(runner, 1, 5) is decode.HostDecode  # "auto": no CUDA bridge on this machine
    runner = ds.runner("static", _slots(ds, "small"), decode_cpu_experts="xla")
    np.testing.assert_array_equal(runner.generate(ds.ids, ds.new).tokens, ds.tokens)
    decode_stats = runner.stats["decode"]
    assert decode_stats["device_steps"] == ds.new - 1 and decode_stats["bytes_moved"] == 0
    assert decode_stats["cpu_experts"] > 0 and decode_stats["experts_loaded_now"] == 0


@pytest.mark.parametrize("field, value", [("decode_cpu_experts", "gpu"), ("decode_copy_share", 1.5),
                                          ("decode_copy_share", "half")])
def test_bad_host_split_settings_are_named(field, value):
    with pytest.raises(RuntimeConfigError, match=field):
        RuntimeConfig(**{field: value})



@pytest.mark.parametrize("bank", [False, True])
def test_zero_copy_decode_reads_the_device_views_and_keeps_the_plain_models_tokens(ds, monkeypatch, bank):
    """RuntimeConfig.decode_zero_copy: the step reads its misses from the store's device views (on a GPU aliases
    of the page-locked stacks; here device-memory copies stand in for them) with no conditional
    (`_routed_in_place`), gives the plain model's tokens, and keeps and counts exactly what the copying step does;
    without views (jax's pinned memory) it copies from the pinned stacks. With a decode bank beside the pool (6
    slots beside 5), a pick lies in one of three sources: the pool, the bank or the views."""
    runner = ds.runner("ondemand", _slots(ds, "small"), decode_zero_copy=True, decode_chunk=4)
    if bank:
        slot = ds.cfg.expert_bytes(4)
        runner = type(runner)(ds.model, runner.runtime.replace(gpu_memory=runner.budget.fixed + 5 * slot + slot // 2,
                                                              expert_pool=11 * slot))
    assert (runner.pool.num_slots, runner.decode_slots) == ((5, 6) if bank else (5, 0))
    assert runner.store.layer_device_views(ds.cfg.moe_layers[0]) is None  # the CPU backend: no driver buffers
    pinned = decode.decode_experts(runner, runner.decode_host(1))
    device = jax.sharding.SingleDeviceSharding(runner.devices.accel, memory_kind="device")
    views = {layer: jax.device_put(runner.store.layer_stacks(layer) or tuple(
        jnp.stack(part) for part in runner.store.layer_experts(layer)), device) for layer in ds.cfg.moe_layers}
    monkeypatch.setattr(runner.store, "layer_device_views", views.get)
    chosen = decode.decode_experts(runner, runner.decode_host(1))
    assert all(isinstance(layer, device_decode.DeviceViews) for layer in chosen)
    assert all(a.sharding.memory_kind == "device" for layer in chosen for a in jax.tree.leaves(layer))
    assert all(a.sharding.memory_kind == "pinned_host" for layer in pinned for a in jax.tree.leaves(layer))
    in_place = []
    traced = device_decode._routed_in_place
    monkeypatch.setattr(device_decode, "_routed_in_place", lambda *a, **k: in_place.append(1) or traced(*a, **k))
    np.testing.assert_array_equal(runner.generate(ds.ids, ds.new).tokens, ds.tokens)
    assert in_place  # the step took the path with no conditional
    keys = ("device_steps", "activated", "hits", "experts_loaded_now", "bytes_moved")
    read_in_place = {key: runner.stats["decode"][key] for key in keys}
    assert read_in_place["device_steps"] == ds.new - 1 and read_in_place["experts_loaded_now"] > 0
    runner.set_policy("ondemand", decode_zero_copy=False, decode_chunk=4)
    assert all(a.sharding.memory_kind == "pinned_host" for layer in decode.decode_experts(runner, None)
               for a in jax.tree.leaves(layer))
    np.testing.assert_array_equal(runner.generate(ds.ids, ds.new).tokens, ds.tokens)
    assert {key: runner.stats["decode"][key] for key in keys} == read_in_place  # the same cache, kept the same way


def test_by_default_views_are_taken_only_where_the_step_reads_every_miss_itself(ds, monkeypatch):
    """decode_zero_copy None (auto): the views where the GPU takes every miss (no host part: no conditional left);
    the pinned stacks where the host computes or the pool holds every expert."""
    runner = ds.runner("ondemand", _slots(ds, "small"))
    assert runner.runtime.decode_zero_copy is None
    views = {layer: runner.store.layer_stacks(layer) or tuple(jnp.stack(part) for part in
                                                              runner.store.layer_experts(layer))
             for layer in ds.cfg.moe_layers}
    monkeypatch.setattr(runner.store, "layer_device_views", views.get)
    assert all(isinstance(layer, device_decode.DeviceViews) for layer in decode.decode_experts(runner, None))
    for host in (device_decode.EVERY_RESIDENT, device_decode.HostExperts(0.5, bridge=object())):
        assert not any(isinstance(layer, device_decode.DeviceViews) for layer in decode.decode_experts(runner, host))
    with pytest.raises(RuntimeConfigError, match="decode_zero_copy"):
        RuntimeConfig(decode_zero_copy="yes")


def test_device_views_are_taken_only_where_the_kernel_reads_a_step_of_that_batch():
    """On a GPU, a batch whose picks times rows exceed the matvec kernel's rows keeps the copying step: XLA's
    fallback would read every pick from host memory."""
    from types import SimpleNamespace

    gate_up, down = jnp.zeros((6, 128, 256), jnp.bfloat16), jnp.zeros((6, 128, 128), jnp.bfloat16)
    engine = SimpleNamespace(config=SimpleNamespace(num_experts_per_tok=4, num_experts=6),
                             pool=SimpleNamespace(banks=((gate_up[:3], down[:3]),)),
                             devices=SimpleNamespace(accel=SimpleNamespace(platform="gpu")))
    views = (gate_up, down)
    assert decode._kernel_reads(engine, views, 1) and decode._kernel_reads(engine, views, 8)  # 4 and 6 x 8 rows
    assert not decode._kernel_reads(engine, views, 16)  # 6 picks x 16 rows: past the kernel's 64
    engine.devices.accel.platform = "cpu"
    assert decode._kernel_reads(engine, views, 16)
