"""Decode where the pool holds every routed expert (`device_decode.EVERY_RESIDENT`: no copies, no conditional, no
host part) and decode in chunks of steps (RuntimeConfig.decode_chunk): the plain model's tokens and the one-step
path's statistics, on the CPU backend."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pdscope_jax.engine import device_decode, pool_table
from pdscope_jax.runtime import RuntimeConfig, select_devices
from test_device_decode import D, F, _pool
from test_offload_engine import Reference, _slots


@pytest.fixture(scope="module")
def ds():
    return Reference("tiny-deepseek-v2-lite", batch=1, prompt=20, new=10)


@pytest.fixture(scope="module")
def experts():
    rng = np.random.default_rng(0)
    return rng.standard_normal((4, D, 2 * F)).astype(np.float32), rng.standard_normal((4, F, D)).astype(np.float32)


def test_a_pool_of_every_expert_decodes_without_copies_or_conditionals(ds, experts):
    """Where the pool holds every routed expert (`device_decode.EVERY_RESIDENT`), decode loads those prefill left
    out as it starts (`experts_placed`, the only bytes it moves) and its steps miss nothing: the plain model's
    tokens, every pick a hit, none on the host; a layer's program then neither copies nor holds a conditional
    (XLA's GPU runtime waits for a conditional's predicate on the host: a wait per layer). A smaller pool splits
    as before."""
    every = _slots(ds, "all")
    assert ds.runner("pdscope", every - 1).decode_host(1) is not device_decode.EVERY_RESIDENT
    runner = ds.runner("pdscope", every)
    assert runner.decode_host(1) is device_decode.EVERY_RESIDENT
    np.testing.assert_array_equal(runner.generate(ds.ids, ds.new).tokens, ds.tokens)
    stats = runner.stats["decode"]
    assert stats["device_steps"] == ds.new - 1 and stats["hit_rate"] == 1.0 and stats["cpu_experts"] == 0
    assert stats["bytes_moved"] == stats["experts_placed"] * ds.cfg.expert_bytes(4)
    assert all((runner.pool.slot_of(layer) >= 0).all() for layer in ds.cfg.moe_layers)

    resident = {0: 0, 1: 1, 3: 2}  # the row picks 3, 1, 0: all resident
    program = jax.make_jaxpr(functools.partial(device_decode._routed_experts, host=device_decode.EVERY_RESIDENT),
                             static_argnums=0)
    table = pool_table.upload(_pool(select_devices(), *experts, resident), (5,), None, select_devices().accel)
    h = np.random.default_rng(2).standard_normal((1, D)).astype(np.float32)
    jaxpr = program(0, jnp.asarray(h), jnp.ones((1, 3)), jnp.array([[3, 1, 0]], jnp.int32),
                    tuple(jnp.asarray(a) for a in experts), _pool(select_devices(), *experts, resident).banks, table)
    assert "cond" not in {eqn.primitive.name for eqn in jaxpr.eqns}
    assert " sort[" not in str(jaxpr)  # one row's top-k taken as they come: nothing to order for copies
    assert not [eqn for eqn in jaxpr.eqns  # no expert's weights written anywhere
                if eqn.primitive.name.startswith("scatter") and eqn.invars[0].aval.shape[1:] == (D, 2 * F)]


def test_a_pool_of_every_expert_decodes_in_chunks_of_steps(ds):
    """RuntimeConfig.decode_chunk: where no step misses, several decode steps run in one program (a scan of the
    step; on a GPU as command buffers): the plain model's tokens and the per-step path's statistics; warm-up
    compiles the chunks of its count (9 steps: three of 3), so the run compiles nothing."""
    every = _slots(ds, "all")
    single = ds.runner("pdscope", every)
    single.warmup(1, ds.ids.shape[1], ds.new)  # as the other: the same pool when decode starts
    want = single.generate(ds.ids, ds.new)
    runner = ds.runner("pdscope", every, decode_chunk=3)
    runner.warmup(1, ds.ids.shape[1], ds.new)
    compiled, real = runner.compiled_programs, runner._decode_chunk
    sizes = _chunk_sizes(runner)
    got = runner.generate(ds.ids, ds.new)
    np.testing.assert_array_equal(got.tokens, ds.tokens)
    np.testing.assert_array_equal(got.tokens, want.tokens)
    assert sizes == [3, 3, 3]
    runner._decode_chunk = real
    assert runner.compiled_programs == compiled
    stats, one = runner.stats["decode"], single.stats["decode"]
    for key in ("device_steps", "steps", "tokens", "activated", "hits", "cpu_experts", "bytes_moved"):
        assert stats[key] == one[key], key
    assert stats["device_steps"] == ds.new - 1
    sizes = _chunk_sizes(runner)
    steps = list(runner.steps(ds.ids, 5, streamed=False))  # 4 steps: a chunk of 3, then one of 1, in order
    np.testing.assert_array_equal(np.stack([s.token for s in steps], axis=1), ds.tokens[:, :5])
    assert sizes == [3, 1]
    runner.reset_stats()
    sizes, compiled = _chunk_sizes(runner), runner.compiled_programs
    streamed = list(runner.steps(ds.ids, 9))  # streamed: two chunks of 3, then the 2 steps left a program each
    np.testing.assert_array_equal(np.stack([s.token for s in streamed], axis=1), ds.tokens[:, :9])
    assert sizes == [3, 3] and runner.stats["decode"]["device_steps"] == 8
    assert runner.compiled_programs == compiled  # no chunk of 2 compiled


def _chunk_sizes(runner, program: str = "_decode_chunk") -> list[int]:
    """The step counts of the runner's chunk program `program`, in the order they run (recorded from now on)."""
    sizes, real = [], getattr(runner, program)
    setattr(runner, program, lambda n, *args: sizes.append(n) or real(n, *args))
    return sizes


@pytest.mark.parametrize("policy, options, program, counted", [
    # no bridge, every miss copied by the program (the conditional per layer inside the scan): command buffers
    ("ondemand", {}, "_decode_chunk", "experts_loaded_now"),
    # a host part (XLA computes it: the bridge's stand-in): the program whose calls run as issued
    ("static", {"decode_cpu_experts": "xla"}, "_decode_chunk_issued", "cpu_experts")])
def test_steps_decode_in_chunks_when_asked(ds, policy, options, program, counted):
    """decode_chunk on a small pool's steps: the chunks run in their program and give the plain model's tokens and
    the per-step path's counts."""
    single = ds.runner(policy, _slots(ds, "small"), **options)
    want = single.generate(ds.ids, ds.new)
    runner = ds.runner(policy, _slots(ds, "small"), decode_chunk=4, **options)
    sizes = _chunk_sizes(runner, program)
    got = runner.generate(ds.ids, ds.new)
    np.testing.assert_array_equal(got.tokens, ds.tokens)
    np.testing.assert_array_equal(got.tokens, want.tokens)
    assert sizes == [4, 4, 1]
    stats, one = runner.stats["decode"], single.stats["decode"]
    for key in ("device_steps", "activated", "hits", counted, "bytes_moved"):
        assert stats[key] == one[key], key
    assert stats[counted] > 0


def test_chunk_steps_default_to_32_on_a_gpu_and_1_elsewhere_or_with_xlas_host_part():
    from types import SimpleNamespace

    from pdscope_jax.engine.decode import AUTO_CHUNK, STREAM_CHUNK, chunk_steps

    def engine(platform, chunk=None):
        return SimpleNamespace(runtime=RuntimeConfig(decode_chunk=chunk),
                               devices=SimpleNamespace(accel=SimpleNamespace(platform=platform)))

    assert chunk_steps(engine("gpu"), None, 63) == AUTO_CHUNK == 32
    assert chunk_steps(engine("gpu"), device_decode.EVERY_RESIDENT, 63) == 32
    assert chunk_steps(engine("cpu"), None, 63) == 1
    assert chunk_steps(engine("cpu", 4), None, 63) == chunk_steps(engine("gpu", 4), None, 63) == 4
    assert chunk_steps(engine("gpu"), None, None) == 1  # the steps to come unknown (a batch's session)
    bridged = device_decode.HostExperts(0.5, bridge=object())  # the CUDA bridge computes a part
    assert chunk_steps(engine("gpu"), bridged, 63) == 32 and chunk_steps(engine("cpu"), bridged, 63) == 1
    assert chunk_steps(engine("gpu"), device_decode.HostExperts(1.0), 63) == 32  # every miss copied
    assert chunk_steps(engine("gpu"), device_decode.HostExperts(0.5), 63) == 1  # XLA's host part computes a part
    assert chunk_steps(engine("gpu", 8), device_decode.HostExperts(0.5), 63) == 8  # unless asked
    # a streamed run's tokens arrive a chunk late: shorter chunks, unless a chunk is asked for
    assert chunk_steps(engine("gpu"), bridged, 63, streamed=True) == STREAM_CHUNK == 8
    assert chunk_steps(engine("gpu", 4), bridged, 63, streamed=True) == 4
    assert chunk_steps(engine("cpu"), bridged, 63, streamed=True) == 1


def test_one_rows_every_resident_layer_is_the_general_layer(experts):
    """The one-row layer of a pool of every expert (fewest kernels) gives the general path's output, table and
    counts, and its program holds fewer operations."""
    resident = {0: 0, 1: 1, 3: 2}
    devices = select_devices()
    h = jnp.asarray(np.random.default_rng(3).standard_normal((1, D)).astype(np.float32))
    weights, ids = jnp.asarray([[0.5, 0.3, 0.2]], jnp.float32), jnp.array([[3, 1, 0]], jnp.int32)
    general = device_decode.HostExperts(0.0, fill_free=False)  # copies nothing too, through the general path
    results, sizes = [], []
    for host in (device_decode.EVERY_RESIDENT, general):
        pool = _pool(devices, *experts, resident)
        table = pool_table.upload(pool, (5,), np.arange(4, dtype=np.int32)[None], devices.accel)
        args = (h, weights, ids, tuple(jnp.asarray(a) for a in experts), pool.banks, table)
        program = functools.partial(device_decode._routed_experts, 0, host=host)
        results.append(program(*args))
        sizes.append(len(jax.make_jaxpr(program)(*args).eqns))
    (y, _, table, ahead), (y_general, _, table_general, _) = results
    np.testing.assert_array_equal(y, y_general)
    for name in ("slot_of", "owner", "keep", "bonus", "clock", "counts", "routed"):
        np.testing.assert_array_equal(getattr(table, name), getattr(table_general, name), err_msg=name)
    assert ahead is None and int(table.counts[1]) == 3 and sizes[0] < sizes[1]
