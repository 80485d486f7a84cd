"""engine.batching.OffloadBatcher: requests joining and leaving an offloaded batch at step boundaries, with ragged
lengths and chunked prompts, get the greedy float32 tokens each gets alone; a batch larger than the engine's
budgeted cache is refused."""

import numpy as np
import pytest

import pdscope_jax
from pdscope_jax.engine.batching import OffloadBatcher
from pdscope_jax.errors import InputError
from pdscope_jax.generation.sampling import SamplingParams


@pytest.fixture(scope="module", params=["pdscope", "static"])
def runner(request):
    return pdscope_jax.load("tiny-deepseek-v2-lite", dtype="float32", policy=request.param, gpu_memory="1GB",
                            expert_pool="40KB", max_seq_len=128, max_batch=3)


def test_ragged_requests_joining_midway_get_their_tokens_alone(runner):
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, runner.config.vocab_size, n) for n in (5, 19, 11, 3)]
    new = [7, 4, 9, 5]
    alone = [runner.generate([p], max_new_tokens=n).tokens[0].tolist() for p, n in zip(prompts, new)]
    batcher = OffloadBatcher(runner.engine, chunk=8)  # 19 prompt tokens: three chunks
    batcher.warmup()
    got, of_slot, waiting, step = {}, {}, list(range(4)), 0
    decode_tokens = runner.engine.phase_stats["decode"].tokens
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
    assert runner.engine.phase_stats["decode"].tokens - decode_tokens == sum(n - 1 for n in new)


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
