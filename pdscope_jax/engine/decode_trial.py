"""Which decode executor a planner that chooses its decode mode runs, decided by timing both at warm-up.

Contract: `trial(engine, batch, prompt_len, cache_tokens, steps) -> DecodeTrial` times the decode of each executor
`decode.choose` could take for `batch` rows (the one-program `DeviceDecode` and the host-planned `HostDecode`): for
each, two greedy generations on a prompt of seeded random tokens [batch, prompt_len] in a KV cache sized for
`cache_tokens` new tokens (`steps` + 2 at most), one of 2 tokens and one of `steps` + 2, each from the pool
`set_policy` leaves; the difference of their decode seconds over `steps` is the executor's figure, so what an
executor does once per decode (the device step's fill of the pool or of its decode bank, its table's upload and
download) counts in neither (where noise on a loaded host makes the long run no slower, the long run's mean per
decoded token stands in). The device executor is timed a program a step (`StepwiseDevice`) even where real runs
chunk its steps (`decode.chunk_steps`), which only makes it faster: a chunk of each trial length would compile
programs of their own. Every program must be compiled before: the device step's by the warm-up that calls this
where it runs a program a step, else with the host loop's by `compile_loops`, and what routing decides either
needs by `precompile_routed` (the warm-up calls them in that order, then this). `DecodeTrial.executor` is the
faster executor; `to_dict()` -> {"chosen": "device" | "host", "ms_per_step": {name: ms}, "steps",
"compiled_while_timed"}. The caller restarts the pool and statistics afterwards.
Why a trial and not the cost table: the two differ in the host's dispatch per layer and the accelerator's cost per
step, which the table does not hold, and on the benchmark node either may win (docs/MEASUREMENTS.md). Random tokens
rather than warm-up's zeros: one token repeated routes to few experts, which would hide the misses that decide.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from pdscope_jax.engine.decode import DeviceDecode, HostDecode
from pdscope_jax.generation.generator import sampling_params

COMPILE_TOKENS = 2  # a generation that runs one decode step: compiles an executor's programs


class StepwiseDevice(DeviceDecode):
    """The one-program step, a program a step: the run's count of steps is withheld, so it never chunks."""

    def __init__(self, *args, count=None, **kwargs):
        super().__init__(*args, **kwargs)


EXECUTORS = {"device": DeviceDecode, "host": HostDecode}  # what a trial's winner runs
TIMED = {"device": StepwiseDevice, "host": HostDecode}  # what the trial times for each


@dataclasses.dataclass(frozen=True)
class DecodeTrial:
    seconds_per_step: dict[str, float]  # executor name -> decode seconds per step in the trial
    steps: int
    compiled_while_timed: int = 0  # programs compiled during the timed runs (their time is in the figures)

    @property
    def chosen(self) -> str:
        return min(self.seconds_per_step, key=self.seconds_per_step.get)

    @property
    def executor(self) -> type:
        return EXECUTORS[self.chosen]

    def to_dict(self) -> dict:
        return {"chosen": self.chosen, "steps": self.steps, "compiled_while_timed": self.compiled_while_timed,
                "ms_per_step": {name: round(1e3 * s, 3) for name, s in self.seconds_per_step.items()}}


def trial_prompt(engine, batch: int, prompt_len: int) -> np.ndarray:
    """The trial's prompt: seeded random tokens [batch, prompt_len] (int32)."""
    return np.random.default_rng(0).integers(0, engine.config.vocab_size, (batch, prompt_len)).astype(np.int32)


def compile_loops(engine, batch: int, prompt_len: int, cache_tokens: int, device_too: bool) -> None:
    """Compile the host-planned loop's programs for this shape, and with `device_too` the device step's a program
    a step, each by a generation of two tokens (the caller then compiles what routing decides a run needs,
    `precompile_routed`, for every shape run so far)."""
    for executor in (HostDecode, StepwiseDevice) if device_too else (HostDecode,):
        decode_seconds(engine, trial_prompt(engine, batch, prompt_len), COMPILE_TOKENS, cache_tokens, executor)


def trial(engine, batch: int, prompt_len: int, cache_tokens: int, steps: int) -> DecodeTrial:
    ids = trial_prompt(engine, batch, prompt_len)
    seconds, compiled = {}, engine.compiled_programs["total"]
    for name, executor in TIMED.items():
        runs = []
        for tokens in (COMPILE_TOKENS, COMPILE_TOKENS + steps):
            engine.set_policy(engine.runtime.policy, engine.runtime.policy_options)  # the same pool for every run
            runs.append(decode_seconds(engine, ids, tokens, cache_tokens, executor))
        # the steps' own time: the long run less the short one's fixed costs; where noise hides that difference
        # (a loaded host), the long run's mean per decoded token, which includes them
        seconds[name] = (runs[1] - runs[0]) / steps if runs[1] > runs[0] else runs[1] / (COMPILE_TOKENS + steps - 1)
    return DecodeTrial(seconds, steps, engine.compiled_programs["total"] - compiled)


def decode_seconds(engine, ids: np.ndarray, tokens: int, cache_tokens: int, executor: type) -> float:
    """Wall seconds of a greedy generation's decode (after its first token) of `tokens` tokens with `executor`."""
    params, _ = sampling_params(0.0, None, 0)
    run = engine._steps(ids, tokens, params, cache_tokens, executor=executor)
    next(run)  # prefill's token
    start = time.perf_counter()
    for _ in run:
        pass
    return time.perf_counter() - start
