"""An OpenAI-compatible HTTP server over one loaded model (the `[serve]` extra: fastapi, uvicorn, jinja2).

Modules: `service` (the model, its chat template, limits, request checks), `worker` (the scheduler seam: a
thread that owns the model and streams each request's tokens to its asyncio queue), `text` (token deltas and
stop strings), `protocol` (OpenAI's shapes), `metrics` (Prometheus), `app` (the routes), `server` (uvicorn).
"""
