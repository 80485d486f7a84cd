"""The continuous-batching scheduler, behind the same `submit` / events interface as `Worker`.

Contract: `BatchingWorker(runner, eos, max_queue, metrics=None, max_batch=8, max_len=None, chunk=None)` batches
a whole-model runner (`runner.model`: `generation.batcher.Batcher`) or an offloaded one (`runner.engine`:
`engine.batching.OffloadBatcher`, warmed up at construction). Its thread runs the batcher step by step: at every
step boundary it admits waiting jobs into free slots
(first come, first served; a job cancelled while waiting never runs), runs one step (a decode of every row
that has its first token plus one prefill chunk) and puts each row's token on its job's queue, as `Worker` does
(token events, then one "done" with finish_reason "stop" | "length" | "cancelled", or "error"). A job leaves
its slot at EOS, a stop string, max_tokens or cancellation, and a waiting job takes it at the next step.
`queued` counts jobs waiting for a slot, `active` the jobs holding one. An exception in a step (or in handing
out its tokens) ends every running job with an "error" event and starts the batcher afresh; the worker serves
on. `stop()` admits nothing after the jobs already submitted and returns when the running ones are done.
"""

from __future__ import annotations

import dataclasses
import queue
import time

from pdscope_jax.generation.batcher import Batcher, Emitted
from pdscope_jax.serve.text import TextStream
from pdscope_jax.serve.worker import Event, Job, QueueWorker, ids_text


@dataclasses.dataclass
class _Running:
    job: Job
    stream: TextStream
    start: float
    first: float | None = None


class BatchingWorker(QueueWorker):
    def __init__(self, runner, eos: set[int], max_queue: int, metrics=None, max_batch: int = 8,
                 max_len: int | None = None, chunk: int | None = None):
        super().__init__(runner, eos, max_queue, metrics)
        extra = {} if chunk is None else {"chunk": chunk}
        if getattr(runner, "model", None) is not None:
            self.batcher = Batcher(runner.model, max_batch, max_len, **extra)
        else:
            from pdscope_jax.engine.batching import OffloadBatcher

            self.batcher = OffloadBatcher(runner.engine, max_batch, max_len, **extra)
            self.batcher.warmup()  # before serving: the first requests would wait for its compiles
        self._running: dict[int, _Running] = {}  # slot -> its job

    @property
    def active(self) -> int:
        return len(self._running)

    def _serve(self) -> None:
        stopping = False
        while not stopping or self._running:
            while not stopping and self.batcher.free_slots:
                try:  # block for work only when nothing runs
                    job = self._queue.get(block=not self._running)
                except queue.Empty:
                    break
                if job is None:
                    stopping = True
                else:
                    self._admit(job)
            self._drop_cancelled()
            if not self._running:
                continue
            try:
                for e in self.batcher.step():
                    self._deliver(e)
            except Exception as err:  # noqa: BLE001 (reported to the clients; the worker serves on)
                for slot in list(self._running):
                    self._running.pop(slot).job.emit(Event("error", text=f"{type(err).__name__}: {err}"))
                self.batcher.reset()

    def _admit(self, job: Job) -> None:
        if job.cancelled.is_set():
            job.emit(Event("done", finish_reason="cancelled"))
            return
        try:
            slot = self.batcher.admit(job.prompt_ids, job.sampling, job.max_tokens)
        except Exception as err:  # noqa: BLE001 (a request the batch cannot hold: told to its client)
            job.emit(Event("error", text=f"{type(err).__name__}: {err}"))
            return
        tokenizer = self.runner.tokenizer
        self._running[slot] = _Running(job, TextStream(tokenizer.decode if tokenizer else ids_text, job.stop),
                                       time.perf_counter())

    def _drop_cancelled(self) -> None:
        """Cancelled jobs leave before the next step (also while their prompt is still being prefilled)."""
        for slot, run in list(self._running.items()):
            if run.job.cancelled.is_set():
                self._finish(slot, "cancelled", by_string=False)

    def _deliver(self, e: Emitted) -> None:
        run = self._running[e.slot]
        job = run.job
        job.generated += 1
        if run.first is None:
            run.first = time.perf_counter()
        if e.token in self.eos:
            return self._finish(e.slot, "stop", by_string=False)
        delta, stopped = run.stream.push(e.token)
        job.emit(Event("token", delta, e.token, e.logprob, list(zip(e.top_ids.tolist(), e.top_logprobs.tolist()))))
        if stopped:
            return self._finish(e.slot, "stop", by_string=True)
        if e.last:
            return self._finish(e.slot, "length", by_string=False)
        if job.cancelled.is_set():
            return self._finish(e.slot, "cancelled", by_string=False)

    def _finish(self, slot: int, reason: str, by_string: bool) -> None:
        run = self._running.pop(slot)
        if self.batcher.rows[slot] is not None:  # a row at max_new_tokens has left by itself
            self.batcher.release(slot)
        if not by_string:  # what was held back for a stop string that never came
            tail = run.stream.flush()
            if tail:
                run.job.emit(Event("token", tail))
        if self.metrics is not None:
            self.metrics.finished(len(run.job.prompt_ids), run.job.generated, run.start, run.first,
                                  time.perf_counter(), None)
        run.job.emit(Event("done", finish_reason=reason))
