"""Wall-clock timing of device work, shared by the profiler and the measurement scripts.

Contract: `median_seconds(fn, repeats, warmup)` calls `fn()` `warmup` times untimed (compilation, caches), then
`repeats` times, each waited for with `jax.block_until_ready` on what it returns (work is asynchronous), and
returns the median wall time in seconds.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable

import jax


def median_seconds(fn: Callable[[], Any], repeats: int = 5, warmup: int = 1) -> float:
    for _ in range(warmup):
        jax.block_until_ready(fn())
    times = []
    for _ in range(max(repeats, 1)):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return statistics.median(times)
