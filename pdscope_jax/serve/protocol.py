"""OpenAI's request and response shapes for /v1/chat/completions and /v1/completions.

Contract: `ChatRequest` / `CompletionRequest` (pydantic; unknown fields are ignored as OpenAI's server ignores
what it does not use) hold the fields this server honours; `sampling(defaults)` -> `SamplingParams` (request
values over the checkpoint's generation_config defaults), `stop_list()`, `top_n()` (alternatives per token,
0: none, None: no logprobs). `ApiError(status, message, param)` is an error answered in OpenAI's shape,
`error_body(...)`. The builders turn a finished generation (`Result`) or one event into response JSON.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from typing import Any

from pydantic import BaseModel, ConfigDict

from pdscope_jax.generation.sampling import SamplingParams

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               413: "invalid_request_error", 429: "rate_limit_error", 503: "service_unavailable",
               500: "internal_error"}


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": code}}


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: dict | None = None
    n: int = 1

    def sampling(self, defaults: dict) -> SamplingParams:
        fields = {f.name for f in dataclasses.fields(SamplingParams)}
        given = {k: v for k, v in self.model_dump().items() if k in fields and v is not None}
        top_k = given.get("top_k", defaults.get("top_k"))
        merged = {**defaults, **given, "top_k": None if top_k in (0, -1) else top_k}  # 0 / -1: off (vLLM)
        return SamplingParams(**merged)

    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))


class ChatRequest(_Common):
    messages: list[dict[str, Any]]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None

    def top_n(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int]
    logprobs: int | None = None
    echo: bool = False

    def top_n(self) -> int | None:
        return self.logprobs


@dataclasses.dataclass
class Result:
    text: str
    tokens: list[int]
    logprobs: list[float]
    tops: list[list[tuple[int, float]]]
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int  # every token generated, an EOS that ended it included


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def chat_logprobs(tokens, logprobs, tops, top_n: int, piece) -> dict:
    def entry(token, logprob):
        text = piece(token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {"content": [{**entry(t, lp), "top_logprobs": [entry(i, v) for i, v in top[:top_n]]}
                        for t, lp, top in zip(tokens, logprobs, tops)]}


def completion_logprobs(tokens, logprobs, tops, top_n: int, piece, offset: int = 0) -> dict:
    pieces = [piece(t) for t in tokens]
    offsets, at = [], offset
    for p in pieces:
        offsets.append(at)
        at += len(p)
    return {"tokens": pieces, "token_logprobs": logprobs, "text_offset": offsets,
            "top_logprobs": [{piece(i): v for i, v in top[:top_n]} for top in tops]}


def chat_response(rid: str, model: str, r: Result, top_n: int | None, piece) -> dict:
    return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": r.text},
                         "logprobs": None if top_n is None else chat_logprobs(r.tokens, r.logprobs, r.tops, top_n,
                                                                              piece),
                         "finish_reason": r.finish_reason}],
            "usage": usage(r.prompt_tokens, r.completion_tokens)}


def completion_response(rid: str, model: str, r: Result, top_n: int | None, piece) -> dict:
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "text": r.text, "finish_reason": r.finish_reason,
                         "logprobs": None if top_n is None else completion_logprobs(r.tokens, r.logprobs, r.tops,
                                                                                    top_n, piece)}],
            "usage": usage(r.prompt_tokens, r.completion_tokens)}


def chat_chunk(rid: str, model: str, delta: dict, finish_reason=None, logprobs=None) -> dict:
    return {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}]}


def completion_chunk(rid: str, model: str, text: str, finish_reason=None, logprobs=None) -> dict:
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}]}


def usage_chunk(rid: str, model: str, obj: str, prompt_tokens: int, completion_tokens: int) -> dict:
    return {"id": rid, "object": obj, "created": int(time.time()), "model": model, "choices": [],
            "usage": usage(prompt_tokens, completion_tokens)}
