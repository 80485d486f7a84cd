"""What the HTTP layer serves: one loaded model, its tokenizer, chat template, defaults, limits and worker.

Contract: `Limits(max_prompt_tokens, max_tokens, max_queue, max_batch, max_seq_len)`; `Service(model_name,
limits, api_key, chat_template=None)` is not ready until `attach(runner)` starts the worker: a whole model gets
`batching.BatchingWorker` (max_batch slots over a cache of `context` positions: max_seq_len, else the model's
context up to BATCH_CONTEXT), an offloaded one the one-at-a-time `worker.Worker`; `ready`, `require_ready()`
(ApiError 503 before).
`prepare(body, chat)` turns a parsed request into a `worker.Job` after every check, each failure an ApiError:
400 (bad field, sampling setting out of range, n != 1, echo, max_tokens over the limit or past the context),
413 (prompt longer than max_prompt_tokens), and `submit(job)` 429 when the queue is full. `piece(id)` is one
token's text (for logprobs). `close()` stops the worker.
"""

from __future__ import annotations

import asyncio
import dataclasses

from pdscope_jax.generation.chat import ChatTemplate, eos_ids, generation_defaults
from pdscope_jax.generation.sampling import TOP_LOGPROBS
from pdscope_jax.errors import InputError
from pdscope_jax.serve.batching import BatchingWorker
from pdscope_jax.serve.metrics import Metrics
from pdscope_jax.serve.protocol import ApiError, ChatRequest, CompletionRequest
from pdscope_jax.serve.worker import Job, QueueFull, Worker


BATCH_CONTEXT = 4096  # default batch cache length: max_batch rows of the whole context would not fit real models


@dataclasses.dataclass(frozen=True)
class Limits:
    max_prompt_tokens: int | None = None  # None: the model's context less one new token
    max_tokens: int = 1024  # the most new tokens one request may ask for
    max_queue: int = 64  # requests waiting beyond the running ones
    max_batch: int = 8  # sequences decoded together (whole model: continuous batching)
    max_seq_len: int | None = None  # the whole model's batch cache (None: its context, at most BATCH_CONTEXT)


class Service:
    def __init__(self, model_name: str, limits: Limits = Limits(), api_key: str | None = None,
                 chat_template: ChatTemplate | None = None):
        self.model_name, self.limits, self.api_key = model_name, limits, api_key
        self.chat_template = chat_template  # None: the checkpoint's (or the fallback)
        self.runner = self.worker = None
        self.metrics = Metrics(lambda: (self.worker.queued if self.worker else 0,
                                        self.worker.active if self.worker else 0))

    @property
    def ready(self) -> bool:
        return self.worker is not None

    def require_ready(self) -> None:
        if not self.ready:
            raise ApiError(503, "the model is still loading; retry in a moment (GET /health answers 200 when ready)")

    def attach(self, runner) -> None:
        self.runner = runner
        checkpoint = getattr(runner, "checkpoint", None)
        self.template = self.chat_template or ChatTemplate.from_dir(checkpoint)
        self.defaults = generation_defaults(checkpoint)
        limits = getattr(runner, "_limits", {}) or {}
        eos = eos_ids(runner.config, checkpoint)
        if getattr(runner, "model", None) is not None:  # the whole model: continuous batching
            self.context = self.limits.max_seq_len or min(runner.config.max_position_embeddings, BATCH_CONTEXT)
            worker = BatchingWorker(runner, eos, self.limits.max_queue, self.metrics, self.limits.max_batch,
                                    self.context)
        elif limits.get("max_batch", 1) > 1:  # offloaded: continuous batching in the engine's budgeted cache
            self.context = limits["max_seq_len"]
            worker = BatchingWorker(runner, eos, self.limits.max_queue, self.metrics,
                                    min(self.limits.max_batch, limits["max_batch"]), self.context)
        else:  # offloaded with a cache for one sequence: one request at a time
            self.context = limits.get("max_seq_len") or runner.config.max_position_embeddings
            worker = Worker(runner, eos, self.limits.max_queue, self.metrics)
        worker.start()
        self.worker = worker

    def close(self) -> None:
        if self.worker is not None:
            self.worker.stop()

    def piece(self, token_id: int) -> str:
        tok = self.runner.tokenizer
        return tok.decode([token_id]) if tok is not None else f" {token_id}"

    def _prompt_ids(self, body, chat: bool) -> list[int]:
        tok = self.runner.tokenizer
        if chat:
            if tok is None:
                raise ApiError(400, "this model has no tokenizer.json, so it cannot chat; use /v1/completions with "
                                    "token ids", "messages")
            try:
                text = self.template.render(body.messages, add_generation_prompt=True)
            except InputError as err:
                raise ApiError(400, str(err), "messages") from None
            return tok.encode(text)
        prompt = body.prompt
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, str):
            if tok is None:
                raise ApiError(400, "this model has no tokenizer.json: send the prompt as a list of token ids",
                               "prompt")
            return tok.encode(prompt)
        if prompt and all(isinstance(x, int) for x in prompt):
            vocab = self.runner.config.vocab_size
            if not all(0 <= x < vocab for x in prompt):
                raise ApiError(400, f"prompt token ids must lie in [0, {vocab})", "prompt")
            return list(prompt)
        raise ApiError(400, "prompt must be a non-empty string, a list of one string, or a list of token ids "
                            "(one prompt per request)", "prompt")

    def prepare(self, body: ChatRequest | CompletionRequest, chat: bool) -> Job:
        self.require_ready()
        if body.n != 1:
            raise ApiError(400, f"n={body.n} is not supported: one choice per request (send n requests)", "n")
        if not chat and body.echo:
            raise ApiError(400, "echo is not supported", "echo")
        top_n = body.top_n()
        if top_n is not None and not 0 <= top_n <= TOP_LOGPROBS:
            raise ApiError(400, f"logprobs alternatives must lie in [0, {TOP_LOGPROBS}], got {top_n}",
                           "top_logprobs" if chat else "logprobs")
        ids = self._prompt_ids(body, chat)
        limit = self.limits.max_prompt_tokens or self.context - 1
        if not ids:
            raise ApiError(400, "the prompt is empty", "prompt")
        if len(ids) > limit:
            raise ApiError(413, f"the prompt has {len(ids)} tokens, more than the {limit} this server accepts; "
                                "shorten it", "messages" if chat else "prompt", "context_length_exceeded")
        room = self.context - len(ids)
        asked = (body.max_completion_tokens if chat else None) or body.max_tokens
        if asked is not None and not 1 <= asked <= self.limits.max_tokens:
            raise ApiError(400, f"max_tokens must lie in [1, {self.limits.max_tokens}] (this server's limit), got "
                                f"{asked}", "max_tokens")
        if asked is not None and asked > room:
            raise ApiError(400, f"{len(ids)} prompt tokens + max_tokens {asked} exceed the model's context of "
                                f"{self.context}; ask for at most {room}", "max_tokens", "context_length_exceeded")
        try:
            sampling = body.sampling(self.defaults)
        except TypeError as err:
            raise ApiError(400, str(err)) from None
        problems = sampling.problems(self.runner.config.vocab_size)
        if problems:
            raise ApiError(400, "; ".join(problems))
        return Job(ids, asked or min(self.limits.max_tokens, room), sampling, body.stop_list(),
                   asyncio.get_running_loop())

    def submit(self, job: Job) -> None:
        try:
            self.worker.submit(job)
        except QueueFull as err:
            raise ApiError(429, f"the server is busy: {err}; retry later") from None
