"""The server's Prometheus metrics, in a registry of its own (two servers in one process do not mix).

Contract: `Metrics(worker_state)` where `worker_state()` -> (queued, running). `request(endpoint, status)`
counts an answered request; `finished(prompt_tokens, generated, start, first, end, engine_stats)` records one
generation: prompt and generated tokens, time to first token, the last generation's tokens/s per phase
(prefill: prompt tokens over time to first token; decode: the other tokens over the rest) and, where the engine
reports them (offloaded runs), its per-phase expert hit rate and bytes moved. `render() -> (bytes, content
type)` is the Prometheus text exposition.
"""

from __future__ import annotations

from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

PHASES = ("prefill", "decode")


class Metrics:
    def __init__(self, worker_state: Callable[[], tuple[int, int]]):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("pdscope_requests", "HTTP requests answered", ["endpoint", "status"], registry=r)
        queue = Gauge("pdscope_queue_length", "requests waiting for the model", registry=r)
        queue.set_function(lambda: worker_state()[0])
        running = Gauge("pdscope_requests_running", "requests being generated", registry=r)
        running.set_function(lambda: worker_state()[1])
        self.prompt_tokens = Counter("pdscope_prompt_tokens", "prompt tokens prefilled", registry=r)
        self.generated = Counter("pdscope_generated_tokens", "tokens generated", registry=r)
        self.ttft = Histogram("pdscope_time_to_first_token_seconds", "time to first token", registry=r)
        self.rate = Gauge("pdscope_tokens_per_second", "tokens/s of the last generation", ["phase"], registry=r)
        self.hit_rate = Gauge("pdscope_expert_hit_rate", "share of activated experts found resident (engine)",
                              ["phase"], registry=r)
        self.bytes_moved = Gauge("pdscope_expert_bytes_moved", "expert bytes copied host -> accelerator since the "
                                 "engine's statistics were reset", ["phase"], registry=r)

    def request(self, endpoint: str, status: int) -> None:
        self.requests.labels(endpoint, str(status)).inc()

    def finished(self, prompt_tokens: int, generated: int, start: float, first: float | None, end: float,
                 engine_stats: dict | None) -> None:
        self.prompt_tokens.inc(prompt_tokens)
        self.generated.inc(generated)
        if first is not None:
            self.ttft.observe(first - start)
            self.rate.labels("prefill").set(prompt_tokens / max(first - start, 1e-9))
            if generated > 1 and end > first:
                self.rate.labels("decode").set((generated - 1) / (end - first))
        for phase in PHASES:
            stats = (engine_stats or {}).get(phase)
            if stats:
                if stats.get("hit_rate") is not None:
                    self.hit_rate.labels(phase).set(stats["hit_rate"])
                self.bytes_moved.labels(phase).set(stats.get("bytes_moved", 0))

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
