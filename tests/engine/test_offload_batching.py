"""engine.batching.OffloadBatcher: requests joining and leaving an offloaded batch at step boundaries, with ragged
lengths and chunked prompts, get the greedy float32 tokens each gets alone, with decode steps host-planned (a pool
too small for the device step) or on the device; a batch larger than the engine's budgeted cache is refused."""

import numpy as np
import pytest

import pdscope_jax
from pdscope_jax.engine.batching import OffloadBatcher
from pdscope_jax.errors import InputError
from pdscope_jax.generation.sampling import SamplingParams


@pytest.fixture(scope="module", params=[("pdscope", "40KB"), ("ondemand", None)], ids=["host-planned", "device"])
def runner(request):
    policy, pool = request.param
    runner = pdscope_jax.load("tiny-deepseek-v2-lite", dtype="float32", policy=policy, gpu_memory="1GB",
                              max_seq_len=128, max_batch=3, **({} if pool is None else {"expert_pool": pool}))
    runner.device_path = request.param_index == 1  # the parameter's decode path, checked by the tests
    return runner


def test_ragged_requests_joining_midway_get_their_tokens_alone(runner):
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, runner.config.vocab_size, n) for n in (5, 19, 11, 3)]
    new = [7, 4, 9, 5]
    alone = [runner.generate([p], max_new_tokens=n).tokens[0].tolist() for p, n in zip(prompts, new)]
    batcher = OffloadBatcher(runner.engine, chunk=8)  # 19 prompt tokens: three chunks
    batcher.warmup()
    got, of_slot, waiting, step = {}, {}, list(range(4)), 0
    stats = runner.engine.phase_stats["decode"]
    decode_tokens, device_steps = stats.tokens, stats.device_steps
    while waiting or batcher.active:
        # one request joins every other step (three slots for four: the last waits for a free one)
        if waiting and batcher.free_slots and (step % 2 == 0 or not batcher.active):
            i = waiting.pop(0)
            of_slot[batcher.admit(prompts[i], SamplingParams(), new[i])] = i
            got[i] = []
        for emitted in batcher.step():
            got[of_slot[emitted.slot]].append(emitted.token)
        step += 1
    assert [got[i] for i in range(4)] == alone
    # decode counted the real rows only: every token but each request's first (sampled by its prefill)
    assert stats.tokens - decode_tokens == sum(n - 1 for n in new)
    assert (stats.device_steps > device_steps) == runner.device_path  # the path this parameter is for was taken


def test_a_released_row_frees_its_slot_and_a_new_one_takes_it(runner):
    batcher = OffloadBatcher(runner.engine, max_batch=1, chunk=8)
    prompt = np.arange(1, 6)
    slot = batcher.admit(prompt, SamplingParams(), 50)
    batcher.step()
    batcher.step()
    batcher.release(slot)
    assert batcher.free_slots == 1
    again = batcher.admit(prompt, SamplingParams(), 3)
    tokens = [e.token for _ in range(4) for e in batcher.step()]
    assert again == slot and tokens == runner.generate([prompt], max_new_tokens=3).tokens[0].tolist()


def test_a_batch_beyond_the_budgeted_cache_is_refused_with_the_fix(runner):
    with pytest.raises(InputError, match=r"budgeted for 3 sequences of 128 tokens.*--max-batch, --max-seq-len"):
        OffloadBatcher(runner.engine, max_batch=4)
    with pytest.raises(InputError, match="128 tokens"):
        OffloadBatcher(runner.engine, max_len=256)


def test_after_a_step_that_deleted_the_pool_reset_leaves_a_batcher_that_serves(runner):
    import jax

    engine = runner.engine
    batcher = OffloadBatcher(engine, max_batch=1, chunk=8)
    prompt = np.arange(1, 6)
    batcher.admit(prompt, SamplingParams(), 4)
    batcher.step()
    for a in jax.tree.leaves(engine.pool.banks):  # as a failed program that was given them leaves them
        a.delete()
    batcher.reset()  # what the serving worker does after a failed step
    assert not any(a.is_deleted() for a in jax.tree.leaves(engine.pool.banks)) and batcher.free_slots == 1
    batcher.admit(prompt, SamplingParams(), 3)
    tokens = [e.token for _ in range(4) for e in batcher.step()]
    assert tokens == runner.generate([prompt], max_new_tokens=3).tokens[0].tolist()
