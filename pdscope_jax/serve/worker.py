"""The scheduler seam: a worker thread owns the model and feeds each request's asyncio queue step by step.

Contract:
- `Job(prompt_ids, max_tokens, sampling: SamplingParams, stop, loop)`: one request. The worker puts `Event`s on
  `job.events` (an asyncio.Queue of `loop`, through call_soon_threadsafe): kind "token" (text delta, token id,
  logprob, top ids/logprobs) once per generated token, then one "done" (finish_reason "stop" | "length" |
  "cancelled") or "error" (message). `job.cancel()` (from any thread) stops it before its next step;
  an event for a client whose event loop has closed (the server stopped) cancels the job instead.
- `Worker(runner, eos, max_queue)`: `submit(job)` queues it or raises `QueueFull` (the caller answers 429);
  `start()` / `stop()` the thread (`stop` returns once the thread has ended, also when it died); `queued` and
  `running` for the metrics. It serves one job at a time, in order; a job cancelled while queued never runs.
  Generation stops at an EOS id (not sent as text), at a stop string (`text.TextStream`), at max_tokens, or when
  cancelled: the step iterator is closed, so the model is free for the next job at once.
`active` is 0 or 1 (the job running). `serve.batching.BatchingWorker` (continuous batching of the whole model)
has the same `submit` / events interface; offloaded models keep this one.
"""

from __future__ import annotations

import asyncio
import dataclasses
import queue
import threading
import time
from typing import Any

from pdscope_jax.generation.sampling import SamplingParams
from pdscope_jax.serve.text import TextStream


class QueueFull(Exception):
    pass


@dataclasses.dataclass
class Event:
    kind: str  # "token" | "done" | "error"
    text: str = ""
    token_id: int | None = None
    logprob: float | None = None
    top: list[tuple[int, float]] | None = None
    finish_reason: str | None = None


@dataclasses.dataclass
class Job:
    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingParams
    stop: list[str]
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = dataclasses.field(default_factory=asyncio.Queue)
    cancelled: threading.Event = dataclasses.field(default_factory=threading.Event)
    generated: int = 0

    def cancel(self) -> None:
        self.cancelled.set()

    def emit(self, event: Event) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the client's event loop is closed (the server has stopped): nobody reads this job
            self.cancelled.set()


class QueueWorker:
    """A worker thread fed by a bounded job queue: `submit`, `queued`, `start`, `stop` (a None sentinel after
    the submitted jobs); subclasses define `_serve` (the thread) and `active`."""

    def __init__(self, runner, eos: set[int], max_queue: int, metrics=None):
        self.runner, self.eos, self.metrics = runner, set(eos), metrics
        self._queue: queue.Queue = queue.Queue(maxsize=max_queue)
        self._thread: threading.Thread | None = None

    @property
    def queued(self) -> int:
        return self._queue.qsize()

    def submit(self, job: Job) -> None:
        try:
            self._queue.put_nowait(job)
        except queue.Full:
            raise QueueFull(f"{self._queue.maxsize} requests are already waiting") from None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._serve, name=f"pdscope-{type(self).__name__}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        if self._thread is None:
            return
        while self._thread.is_alive():  # a full queue drains while the thread serves; a dead thread drains nothing
            try:
                self._queue.put(None, timeout=0.1)
                break
            except queue.Full:
                continue
        self._thread.join()

    def _serve(self) -> None:
        raise NotImplementedError


class Worker(QueueWorker):
    def __init__(self, runner, eos: set[int], max_queue: int, metrics=None):
        super().__init__(runner, eos, max_queue, metrics)
        self.running: Job | None = None

    @property
    def active(self) -> int:
        return int(self.running is not None)

    def _serve(self) -> None:
        while (job := self._queue.get()) is not None:
            if job.cancelled.is_set():
                job.emit(Event("done", finish_reason="cancelled"))
                continue
            self.running = job
            try:
                job.emit(self._run(job))
            except Exception as err:  # noqa: BLE001 (reported to the client; the worker serves on)
                job.emit(Event("error", text=f"{type(err).__name__}: {err}"))
            finally:
                self.running = None

    def _run(self, job: Job) -> Event:
        tokenizer = self.runner.tokenizer
        stream = TextStream(tokenizer.decode if tokenizer else ids_text, job.stop)
        p = job.sampling
        steps = self.runner.steps([job.prompt_ids], job.max_tokens, p.temperature, p.top_k, p.seed,
                                  **{k: v for k, v in dataclasses.asdict(p).items()
                                     if k not in ("temperature", "top_k", "seed")})
        finish, start, first, by_string = "length", time.perf_counter(), None, False
        try:
            for picked in steps:
                token = int(picked.token[0])
                job.generated += 1
                if first is None:
                    first = time.perf_counter()
                if token in self.eos:
                    finish = "stop"
                    break
                delta, stopped = stream.push(token)
                top = list(zip(picked.top_ids[0].tolist(), picked.top_logprobs[0].tolist()))
                job.emit(Event("token", delta, token, float(picked.logprob[0]), top))
                if stopped:
                    finish, by_string = "stop", True
                    break
                if job.cancelled.is_set():
                    finish = "cancelled"
                    break
        finally:
            steps.close()  # settles the engine's statistics and frees the model for the next job
        if not by_string:  # what was held back for a stop string that never came
            tail = stream.flush()
            if tail:
                job.emit(Event("token", tail))
        if self.metrics is not None:
            self.metrics.finished(len(job.prompt_ids), job.generated, start, first, time.perf_counter(),
                                  getattr(self.runner, "stats", None))
        return Event("done", finish_reason=finish)


def ids_text(ids: list[Any]) -> str:
    return "".join(f" {i}" for i in ids)
