"""The batching worker without HTTP: a cancelled request frees its slot for the one waiting, whose tokens are
still those it gets alone; the whole model gets the batching worker, an offloaded one the one-at-a-time worker."""

import asyncio

import pdscope_jax
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


def test_whole_model_batches_and_offloaded_serves_one_at_a_time(runner):
    whole = Service("whole", Limits(max_batch=3, max_seq_len=128))
    whole.attach(runner)
    offloaded = Service("offloaded", Limits(max_batch=3))
    offloaded.attach(pdscope_jax.load("tiny-deepseek-v2-lite", dtype="float32", policy="ondemand",
                                      gpu_memory="1GB", max_seq_len=64))
    try:
        assert isinstance(whole.worker, BatchingWorker) and whole.worker.batcher.max_batch == 3
        assert whole.context == 128 and whole.worker.batcher.max_len == 128
        assert type(offloaded.worker) is Worker and offloaded.context == 64
    finally:
        whole.close()
        offloaded.close()


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
