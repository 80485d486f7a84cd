"""Continuous batching of the whole model: requests of mixed lengths that join and leave a running batch get
exactly the tokens each gets alone (float32; greedy and seeded sampling), and after warm-up no composition
compiles anything new."""

import jax
import numpy as np
import pytest

import pdscope_jax
from pdscope_jax.errors import InputError
from pdscope_jax.generation.batcher import Batcher
from pdscope_jax.generation.sampling import SamplingParams

RNG = np.random.default_rng(0)
# (prompt length, max new tokens, sampling): prompts of 1 to 3 chunks, greedy and sampled rows mixed
CASES = [(5, 9, {}), (13, 5, {}), (20, 11, dict(temperature=0.8, seed=3)), (3, 4, dict(temperature=1.0, seed=5)),
         (9, 14, {}), (17, 6, dict(temperature=0.7, top_k=20, seed=9, repetition_penalty=1.2)), (2, 12, {})]


def requests(vocab: int, cases=CASES):
    return [(RNG.integers(1, vocab, n).tolist(), m, SamplingParams(**s)) for n, m, s in cases]


def run_batched(batcher: Batcher, reqs, admit_order=None):
    """Every request through the batcher, admitted (in admit_order) as slots free up -> tokens per request."""
    waiting = list(admit_order if admit_order is not None else range(len(reqs)))
    slots, got = {}, {i: [] for i in range(len(reqs))}
    while waiting or slots:
        while waiting and batcher.free_slots:
            i = waiting.pop(0)
            slots[batcher.admit(reqs[i][0], reqs[i][2], reqs[i][1])] = i
        for e in batcher.step():
            got[slots[e.slot]].append(e.token)
            if e.last:
                del slots[e.slot]
    return got


def alone(runner, prompt, max_new, params: SamplingParams):
    return runner.generate([prompt], max_new_tokens=max_new, temperature=params.temperature, top_k=params.top_k,
                           seed=params.seed, repetition_penalty=params.repetition_penalty).tokens[0].tolist()


@pytest.fixture(scope="module", params=["tiny-deepseek-v2-lite", "tiny-qwen3-30b-a3b"])  # MLA and GQA caches
def runner(request):
    return pdscope_jax.load(request.param, dtype="float32", seed=1)


def test_joining_and_leaving_rows_get_the_tokens_they_get_alone(runner):
    reqs = requests(runner.config.vocab_size)
    batcher = Batcher(runner.model, max_batch=4, max_len=64, chunk=8)  # 7 requests through 4 slots
    got = run_batched(batcher, reqs)
    for i, (prompt, max_new, params) in enumerate(reqs):
        assert got[i] == alone(runner, prompt, max_new, params), (i, params)
    assert batcher.free_slots == 4


def test_new_compositions_compile_nothing_after_warm_up(runner):
    reqs = requests(runner.config.vocab_size)
    batcher = Batcher(runner.model, max_batch=3, max_len=64, chunk=8)  # a size no other test compiled
    first = run_batched(batcher, reqs)  # warm-up: every row bucket and length bucket these lengths use
    assert batcher.compiles >= 2  # the count counts (prefill and at least one decode bucket)
    compiles = []

    def listen(event, *_args, **_kwargs):
        if "backend_compile" in event:
            compiles.append(event)

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        order = [3, 6, 0, 5, 1, 4, 2]  # other neighbours, other slots, other join and leave steps
        again = run_batched(batcher, reqs, order)
        before = batcher.compiles
        twin = Batcher(runner.model, max_batch=3, max_len=64, chunk=8)  # of the same size: shares the programs
        assert run_batched(twin, reqs, order[::-1]) == first
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    assert compiles == [] and batcher.compiles == before
    assert again == first


def test_released_slot_takes_the_next_request_and_full_batch_refuses():
    runner = pdscope_jax.load("tiny-deepseek-v2-lite", dtype="float32", seed=1)
    reqs = requests(runner.config.vocab_size, [(6, 30, {}), (4, 5, {}), (7, 6, {})])
    batcher = Batcher(runner.model, max_batch=1, max_len=64, chunk=8)
    slot = batcher.admit(reqs[0][0], reqs[0][2], reqs[0][1])
    with pytest.raises(InputError, match="all 1 slots are taken"):
        batcher.admit(reqs[1][0], reqs[1][2], reqs[1][1])
    first = [e.token for e in batcher.step() + batcher.step()]  # prefill, then one decode step
    batcher.release(slot)  # cancelled after two tokens
    assert batcher.step() == [] and batcher.free_slots == 1
    got = run_batched(batcher, reqs[1:])
    assert first == alone(runner, *reqs[0])[:2]
    assert [got[0], got[1]] == [alone(runner, *r) for r in reqs[1:]]


def test_requests_that_do_not_fit_are_refused_with_the_fix():
    runner = pdscope_jax.load("tiny-deepseek-v2-lite", dtype="float32", seed=1)
    batcher = Batcher(runner.model, max_batch=2, max_len=16, chunk=8)
    with pytest.raises(InputError, match="larger --max-seq-len"):
        batcher.admit([1] * 10, SamplingParams(), 7)
    with pytest.raises(InputError, match="chunk a power of two"):
        Batcher(runner.model, max_batch=2, max_len=16, chunk=6)
