"""The batching worker without HTTP: a cancelled request frees its slot for the one waiting, whose tokens are
still those it gets alone; the whole model and an offloaded one budgeted for a batch get the batching worker
(concurrent offloaded requests get their tokens alone), an offloaded one budgeted for one sequence the
one-at-a-time worker."""

import asyncio

import pdscope_jax
from pdscope_jax.engine.batching import OffloadBatcher
from pdscope_jax.generation.sampling import SamplingParams
from pdscope_jax.serve.batching import BatchingWorker
from pdscope_jax.serve.service import Limits, Service
from pdscope_jax.serve.worker import Job, Worker


async def events_of(job: Job) -> list:
    out = []
    while (event := await job.events.get()).kind == "token":
        out.append(event)
    return out + [event]


def test_cancelled_request_frees_its_slot_for_the_waiting_one(runner):
    prompt = runner.tokenizer.encode("import os\nimport sys\n\n\ndef main(argv):\n")[:8]

    async def scenario():
        loop = asyncio.get_running_loop()
        worker = BatchingWorker(runner, set(), max_queue=4, max_batch=1, chunk=8)  # no EOS: lengths are exact
        worker.start()
        long = Job(prompt, 400, SamplingParams(), [], loop)
        short = Job(prompt[:5], 6, SamplingParams(), [], loop)
        worker.submit(long)
        worker.submit(short)
        first = await long.events.get()  # long runs, short waits for the one slot
        assert first.kind == "token" and worker.queued == 1 and worker.active == 1
        long.cancel()
        rest = await events_of(long)
        got = await events_of(short)
        worker.stop()
        return first, rest, got

    first, rest, got = asyncio.run(scenario())
    assert rest[-1].finish_reason == "cancelled" and len(rest) < 50  # stopped long before its 400 tokens
    assert got[-1].finish_reason == "length"
    alone = runner.generate([prompt[:5]], max_new_tokens=6).tokens[0].tolist()
    assert [e.token_id for e in got[:-1] if e.token_id is not None] == alone


def offloaded(max_batch: int):
    return pdscope_jax.load("tiny-deepseek-v2-lite", dtype="float32", policy="ondemand", gpu_memory="1GB",
                            max_seq_len=64, max_batch=max_batch)


def test_the_whole_model_and_a_budgeted_offloaded_batch_get_the_batching_worker(runner):
    whole = Service("whole", Limits(max_batch=3, max_seq_len=128))
    whole.attach(runner)
    single = Service("single", Limits(max_batch=3))
    single.attach(offloaded(1))
    batched = Service("batched", Limits(max_batch=4))
    batched.attach(offloaded(2))
    try:
        assert isinstance(whole.worker, BatchingWorker) and whole.worker.batcher.max_batch == 3
        assert whole.context == 128 and whole.worker.batcher.max_len == 128
        assert type(single.worker) is Worker and single.context == 64
        assert isinstance(batched.worker.batcher, OffloadBatcher)
        assert batched.worker.batcher.max_batch == 2 and batched.context == 64  # what the engine budgeted
    finally:
        for service in (whole, single, batched):
            service.close()


def test_concurrent_offloaded_requests_get_their_tokens_alone():
    engine_runner = offloaded(2)
    prompts = [[5, 9, 2], list(range(3, 14)), [7] * 6]
    lengths = [6, 3, 5]

    async def scenario():
        loop = asyncio.get_running_loop()
        worker = BatchingWorker(engine_runner, set(), max_queue=4, max_batch=2, max_len=64, chunk=8)
        worker.start()
        jobs = [Job(p, n, SamplingParams(), [], loop) for p, n in zip(prompts, lengths)]
        for job in jobs:  # two run together, the third joins when one leaves
            worker.submit(job)
        got = [await events_of(job) for job in jobs]
        worker.stop()
        return got

    got = asyncio.run(scenario())
    for events, prompt, n in zip(got, prompts, lengths):
        assert events[-1].finish_reason == "length"
        tokens = [e.token_id for e in events[:-1] if e.token_id is not None]
        assert tokens == engine_runner.generate([prompt], max_new_tokens=n).tokens[0].tolist()


def test_stop_returns_when_the_clients_event_loop_has_closed(runner):
    """A server that stops while a request runs and another waits (its queue full) closes the clients' event loop
    before the worker is stopped: the worker cancels the orphaned jobs instead of dying, and `stop` returns."""
    prompt = runner.tokenizer.encode("import os\n")[:4]
    loop = asyncio.new_event_loop()
    worker = BatchingWorker(runner, set(), max_queue=1, max_batch=1, chunk=8)
    running, waiting = Job(prompt, 400, SamplingParams(), [], loop), Job(prompt, 400, SamplingParams(), [], loop)
    worker.start()
    worker.submit(running)
    loop.run_until_complete(running.events.get())  # its first token: it holds the one slot
    worker.submit(waiting)  # the queue is full now
    loop.close()  # the server's loop ends; the worker's next token for `running` has nowhere to go
    worker.stop()
    assert not worker._thread.is_alive()
    assert running.cancelled.is_set()
