"""The HTTP routes (FastAPI): OpenAI's /v1/chat/completions, /v1/completions, /v1/models, plus /health and
/metrics.

Contract: `create_app(service) -> FastAPI`. With `service.api_key` set, every /v1 route needs
`Authorization: Bearer <key>` (else 401). Errors answer in OpenAI's shape {"error": {message, type, param,
code}} with their status (400, 401, 404, 413, 429, 503; a request body that does not parse is a 400).
`stream: true` answers server-sent events (`data: {chunk}` ... `data: [DONE]`), one chunk per token delta, a
last chunk with the finish_reason, and a usage chunk when stream_options.include_usage. A client that
disconnects (streaming or not) cancels its generation before the next step.
"""

from __future__ import annotations

import asyncio
import json

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from pdscope_jax.serve import protocol as P
from pdscope_jax.serve.worker import Job


def create_app(service) -> FastAPI:
    app = FastAPI(title="pdscope_jax", docs_url=None, redoc_url=None)

    def error(status: int, message: str, param=None, code=None) -> JSONResponse:
        return JSONResponse(P.error_body(status, message, param, code), status_code=status)

    @app.exception_handler(P.ApiError)
    async def api_error(request: Request, err: P.ApiError):
        service.metrics.request(request.url.path, err.status)
        return error(err.status, err.message, err.param, err.code)

    @app.exception_handler(RequestValidationError)
    async def bad_body(request: Request, err: RequestValidationError):
        service.metrics.request(request.url.path, 400)
        where = ", ".join(f"{'.'.join(str(x) for x in e['loc'][1:])}: {e['msg']}" for e in err.errors())
        return error(400, f"bad request body ({where})")

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, err: HTTPException):
        return error(err.status_code, str(err.detail))

    @app.middleware("http")
    async def authorize(request: Request, call_next):
        if service.api_key and request.url.path.startswith("/v1"):
            if request.headers.get("authorization", "") != f"Bearer {service.api_key}":
                service.metrics.request(request.url.path, 401)
                return error(401, "invalid or missing API key: send 'Authorization: Bearer <key>'", None,
                             "invalid_api_key")
        return await call_next(request)

    @app.get("/health")
    async def health():
        if not service.ready:
            return error(503, "loading the model")
        return {"status": "ok", "model": service.model_name}

    @app.get("/metrics")
    async def metrics():
        body, content_type = service.metrics.render()
        return Response(body, media_type=content_type)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": service.model_name, "object": "model", "created": 0,
                                            "owned_by": "pdscope_jax"}]}

    @app.post("/v1/chat/completions")
    async def chat(body: P.ChatRequest, request: Request):
        return await _generate(service, body, request, chat=True)

    @app.post("/v1/completions")
    async def completions(body: P.CompletionRequest, request: Request):
        return await _generate(service, body, request, chat=False)

    return app


async def _watch_disconnect(request: Request, job: Job) -> None:
    """Cancel the job when the client goes away (the body is read, so the next message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    job.cancel()


async def _generate(service, body, request: Request, chat: bool):
    job = service.prepare(body, chat)
    service.submit(job)
    service.metrics.request(request.url.path, 200)
    rid = P.new_id("chatcmpl" if chat else "cmpl")
    watcher = asyncio.create_task(_watch_disconnect(request, job))
    if body.stream:
        return StreamingResponse(_sse(service, body, job, rid, chat, watcher), media_type="text/event-stream")
    try:
        result = await _collect(job)
    finally:
        watcher.cancel()
        job.cancel()
    build = P.chat_response if chat else P.completion_response
    return build(rid, service.model_name, result, body.top_n(), service.piece)


async def _collect(job: Job) -> P.Result:
    text, tokens, logprobs, tops = [], [], [], []
    while (event := await job.events.get()).kind == "token":
        text.append(event.text)
        if event.token_id is not None:
            tokens.append(event.token_id)
            logprobs.append(event.logprob)
            tops.append(event.top)
    if event.kind == "error":
        raise P.ApiError(500, f"generation failed: {event.text}")
    return P.Result("".join(text), tokens, logprobs, tops, event.finish_reason, len(job.prompt_ids), job.generated)


def _data(obj) -> str:
    return f"data: {json.dumps(obj)}\n\n"


async def _sse(service, body, job: Job, rid: str, chat: bool, watcher: asyncio.Task):
    model, top_n = service.model_name, body.top_n()
    try:
        if chat:
            yield _data(P.chat_chunk(rid, model, {"role": "assistant", "content": ""}))
        while (event := await job.events.get()).kind == "token":
            logprobs = None
            if top_n is not None and event.token_id is not None:
                args = ([event.token_id], [event.logprob], [event.top], top_n, service.piece)
                logprobs = P.chat_logprobs(*args) if chat else P.completion_logprobs(*args)
            if not event.text and logprobs is None:
                continue
            yield _data(P.chat_chunk(rid, model, {"content": event.text}, logprobs=logprobs) if chat
                        else P.completion_chunk(rid, model, event.text, logprobs=logprobs))
        if event.kind == "error":
            yield _data(P.error_body(500, f"generation failed: {event.text}"))
        else:
            yield _data(P.chat_chunk(rid, model, {}, event.finish_reason) if chat
                        else P.completion_chunk(rid, model, "", event.finish_reason))
            if body.include_usage():
                yield _data(P.usage_chunk(rid, model, "chat.completion.chunk" if chat else "text_completion",
                                          len(job.prompt_ids), job.generated))
        yield "data: [DONE]\n\n"
    finally:
        watcher.cancel()
        job.cancel()  # a client gone mid-stream: stop before the next step
