"""Full-sequence logits, prefill and KV-cached decode of a plain (all-resident) model, with timings.

Contract: `Generator(model)` splits the NNX model once into (graphdef, state) and runs plain `jax.jit` functions on
them:
- `logits(input_ids [B,T]) -> np.float32 [B,T,V]`, a causal forward without cache;
- `generate(input_ids [B,T], max_new_tokens, temperature, top_k, seed, **sampling) -> GenerationResult`: one prefill
  that fills a preallocated cache and picks the first new token, then one jitted decode step per further token with the
  cache donated (position and step counter advance on the device). Sampling is `sampling.sample` (settings as arrays:
  temperature 0 is greedy; a new setting compiles nothing; `sampling` takes the other `SamplingParams` fields: top_p,
  min_p, penalties). Every step runs for all max_new_tokens (eos does not stop it). Programs compile before the clock
  starts and timings wait on the device (block_until_ready): execution only.
- `steps(...)` (same arguments) -> `Steps`, an iterator that runs one step per `next` and gives its `sampling.Sampled`
  on the device (for streaming and stopping at EOS); `host_steps(steps)` gives their host copies.
- `Generator(model, decode_chunk=K)`: `generate` runs K decode steps per program (a `lax.scan` of the same step, the
  same tokens), the last program the rest; `steps` stays one step per `next`. K = 1 is the step-per-program loop; the
  default (None) is `ACCELERATOR_DECODE_CHUNK` where the model lies on an accelerator, 1 on the CPU. On a GPU the chunk
  programs run as XLA command buffers (CUDA graphs, `CHUNK_COMPILER_OPTIONS`).
- `Generator(model, input_sharding)`: where the inputs go (None: the default device); a model whose weights lie on a
  mesh (`parallel.expert_parallel`) passes the mesh's replicated `NamedSharding`, and results spanning several processes
  come back from this process's replica.
A float32 model runs its matmuls at full float32 precision also on GPUs (not TF32), so float32 results match the CPU's
and the reference's. Inputs must be rectangular int32 [B, T] (`tokenizer.token_batch`). `check_request` checks one
call's arguments at once (ids, sampling settings, batch and length limits) before any compilation, raising one
`errors.InputError` that names every problem; `Generator` runs it on every call too.
"""

from __future__ import annotations

import dataclasses
import functools
import numbers
import time
from typing import Iterator

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pdscope_jax.errors import collect, raise_problems
from pdscope_jax.generation.sampling import SamplingParams, SamplingState, sample
from pdscope_jax.models.layers import CausalLM
from pdscope_jax.text.tokenizer import token_batch

CACHE_BUCKET = 64  # cache lengths are rounded up to a multiple of this so nearby lengths share programs
# Per-program launch and dispatch costs dominate a whole-model decode step on an accelerator: see
# docs/MEASUREMENTS.md ("Whole-model decode: steps per program").
ACCELERATOR_DECODE_CHUNK = 32
CHUNK_COMPILER_OPTIONS = {"xla_gpu_enable_command_buffer": "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,WHILE,CONDITIONAL"}
CHUNK_SAMPLER_BRANCHES = True  # chunk programs skip the drawing when every row is greedy (`sampling.sample`)


@dataclasses.dataclass
class GenerationResult:
    tokens: np.ndarray  # int32 [B, new]
    prefill_seconds: float
    decode_seconds: float
    prefill_tokens_per_s: float
    decode_tokens_per_s: float
    text: list[str] | None = None

    @classmethod
    def timed(cls, tokens: np.ndarray, prompt_len: int, prefill_seconds: float,
              decode_seconds: float) -> "GenerationResult":
        """Rates from the timings: prefill covers B * prompt_len tokens and yields the first new token of each
        sequence; decode yields the other B * (new - 1)."""
        b, new = tokens.shape
        decoded = b * (new - 1)
        return cls(tokens, prefill_seconds, decode_seconds, b * prompt_len / prefill_seconds,
                   decoded / decode_seconds if decoded else 0.0)


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


SAMPLING_FIELDS = tuple(f.name for f in dataclasses.fields(SamplingParams))


def sampling_params(temperature=0.0, top_k=None, seed=0, **sampling) -> tuple[SamplingParams | None, list[str]]:
    """(SamplingParams, []) of a call's sampling keyword arguments, or (None, problems) when a name is unknown."""
    unknown = sorted(set(sampling) - set(SAMPLING_FIELDS))
    if unknown:
        return None, [f"unknown sampling settings {unknown}; known: {', '.join(SAMPLING_FIELDS)}"]
    return SamplingParams(temperature=temperature, top_k=top_k, seed=seed, **sampling), []


def sampling_problems(max_new_tokens, temperature, top_k, vocab_size: int, seed=0, **sampling) -> list[str]:
    """What is wrong with these generation settings (empty when nothing), each with its valid range."""
    problems = []
    if not _is_int(max_new_tokens) or max_new_tokens < 1:
        problems.append(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    params, unknown = sampling_params(temperature, top_k, seed, **sampling)
    return problems + unknown + (params.problems(vocab_size) if params is not None else [])


def seed_problems(seed) -> list[str]:
    """What is wrong with a random seed (empty when nothing): jax keys keep 32 bits, larger seeds would collide."""
    return [p for p in SamplingParams(seed=seed).problems(1) if p.startswith("seed")]


def check_request(inputs, tokenizer, vocab_size: int, max_new_tokens=None, temperature=0.0, top_k=None, seed=0,
                  max_batch: int | None = None, max_seq_len: int | None = None, what: str = "generate",
                  **sampling):
    """int32 ids [B, T] of one `logits` call (`what="logits"`: ids only) or `generate` call, after checking
    every argument: the ids (`token_batch`), for generate the sampling settings (max_new_tokens None included;
    `sampling`: the other `SamplingParams` fields), and B <= max_batch, T + max_new_tokens <= max_seq_len where
    given. One InputError names every problem."""
    problems: list[str] = []
    ids = collect(problems, token_batch, inputs, tokenizer, vocab_size)
    if what != "logits":
        problems += sampling_problems(max_new_tokens, temperature, top_k, vocab_size, seed, **sampling)
    if ids is not None:
        b, t = ids.shape
        new = max_new_tokens if _is_int(max_new_tokens) else 0
        if max_batch is not None and b > max_batch:
            problems.append(f"batch {b} exceeds max_batch={max_batch} the engine was sized for; load with a "
                            "larger max_batch")
        if max_seq_len is not None and t + new > max_seq_len:
            problems.append(f"{t} prompt + {new} new tokens exceed max_seq_len={max_seq_len} the engine was sized "
                            "for; load with a larger max_seq_len")
    raise_problems(problems, what)
    return ids


def host_steps(steps):
    """Host copies (numpy) of the `Sampled` a step iterator yields, one step at a time."""
    for picked in steps:
        yield jax.device_get(picked)


# The model's state travels as a list of its arrays with the structure static (`graph` = (graphdef, treedef)):
# flattening an nnx.State of a few hundred Variables costs a call far more host time than a list of arrays.
def _model(graph, leaves):
    graphdef, treedef = graph
    return nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))


def _forward(graph, leaves, input_ids, positions):
    return _model(graph, leaves)(input_ids, positions)[0]


def _prefill(graph, leaves, input_ids, positions, cache, sampling):
    model = _model(graph, leaves)
    x, cache = model.hidden(input_ids, positions, cache)
    logits = model.logits(x[:, -1:])[:, 0]  # [B, V]: only the last position picks the next token
    picked, sampling = sample(logits, sampling, 0)
    return picked, sampling, cache


def _decode(graph, leaves, token, position, cache, sampling, step, branch=False):
    """One step; the position and step counter come back advanced, so the host creates nothing per step.
    `branch`: `sampling.sample`'s (chunk programs, whose conditionals stay on the device)."""
    logits, cache = _model(graph, leaves)(token[:, None], position[:, None], cache)
    picked, sampling = sample(logits[:, 0], sampling, step, branch)
    return picked, sampling, cache, position + 1, step + 1


def _decode_chunk(graph, leaves, token, position, cache, sampling, step, n):
    """n steps of `_decode` in one program: -> (Sampled with every field stacked [n, ...], sampling, cache,
    position, step)."""
    def body(carry, _):
        token, position, cache, sampling, step = carry
        picked, sampling, cache, position, step = _decode(graph, leaves, token, position, cache, sampling, step,
                                                          CHUNK_SAMPLER_BRANCHES)
        return (picked.token, position, cache, sampling, step), picked

    (_, position, cache, sampling, step), picked = jax.lax.scan(body, (token, position, cache, sampling, step),
                                                                length=n)
    return picked, sampling, cache, position, step


# Module-level so that models of one architecture (equal graphdefs) share compiled programs.
forward_jit = jax.jit(_forward, static_argnums=0)
prefill_jit = jax.jit(_prefill, static_argnums=0, donate_argnums=(4, 5))
decode_jit = jax.jit(_decode, static_argnums=0, donate_argnums=(3, 4, 5, 6))
decode_chunk_jit = jax.jit(_decode_chunk, static_argnums=(0, 7), donate_argnums=(3, 4, 5, 6))
_compiled: dict[tuple, jax.stages.Compiled] = {}


def host_copy(x: jax.Array) -> np.ndarray:
    """x on the host; a replicated array over several processes' devices from this process's first replica."""
    return np.asarray(x if x.is_fully_addressable else x.addressable_data(0))


class Generator:
    def __init__(self, model: CausalLM, input_sharding: jax.sharding.Sharding | None = None,
                 decode_chunk: int | None = None):
        if decode_chunk is not None and (not _is_int(decode_chunk) or decode_chunk < 1):
            raise ValueError(f"decode_chunk must be an integer >= 1 (or None: by platform), got {decode_chunk!r}")
        self.config = model.config
        self.input_sharding = input_sharding
        self.cache_dtype = model.embed.embedding.dtype
        self._init_cache = model.init_cache
        self.graphdef, self.state = nnx.split(model)
        leaves, treedef = jax.tree.flatten(self.state)
        self._graph, self._leaves = (self.graphdef, treedef), leaves
        self.platform = next(iter(leaves[0].devices())).platform
        on_accelerator = self.platform != "cpu"
        self.decode_chunk = decode_chunk or (ACCELERATOR_DECODE_CHUNK if on_accelerator else 1)
        self._chunk_options = CHUNK_COMPILER_OPTIONS if self.platform == "gpu" else {}
        full_f32 = jnp.dtype(self.cache_dtype) == jnp.float32
        self._precision = functools.partial(jax.default_matmul_precision, "highest" if full_f32 else None)

    def logits(self, input_ids: np.ndarray) -> np.ndarray:
        input_ids = check_request(input_ids, None, self.config.vocab_size, what="logits")
        ids, positions = self._inputs(input_ids)
        with self._precision():
            out = forward_jit(self._graph, self._leaves, ids, positions)
        return np.asarray(host_copy(out), dtype=np.float32)

    def _inputs(self, input_ids: np.ndarray) -> tuple[jax.Array, jax.Array]:
        """ids and their positions [B, T] int32, where `input_sharding` says."""
        b, t = input_ids.shape
        positions = np.broadcast_to(np.arange(t, dtype=np.int32), (b, t))
        return jax.device_put((np.asarray(input_ids, np.int32), positions), self.input_sharding)

    def _program(self, name: str, jitted, args: tuple, static: tuple = (), options: dict | None = None):
        """AOT-compile once per shape so that timings exclude compilation (sampling settings are arrays: a new
        setting compiles nothing)."""
        # shardings too: the same shapes on another device need their own executable
        shapes = tuple((a.shape, str(a.dtype), getattr(a, "sharding", None)) for a in jax.tree.leaves(args[1:]))
        key = (name, args[0], shapes, *static)
        if key not in _compiled:
            with self._precision():
                _compiled[key] = jitted.lower(*args, *static).compile(compiler_options=options or None)
        return _compiled[key]

    def generate(self, input_ids: np.ndarray, max_new_tokens: int = 64, temperature: float = 0.0,
                 top_k: int | None = None, seed: int = 0, **sampling) -> GenerationResult:
        steps = self._steps(input_ids, max_new_tokens, temperature, top_k, seed, self.decode_chunk, **sampling)
        start = time.perf_counter()
        tokens = [next(steps).token]
        tokens[0].block_until_ready()
        prefill_seconds = time.perf_counter() - start
        start = time.perf_counter()
        tokens += [picked.token for picked in steps]  # [B] a step, or [n, B] a chunk
        tokens[-1].block_until_ready()
        decode_seconds = time.perf_counter() - start
        rows = [host_copy(x).reshape(-1, x.shape[-1]) for x in tokens]
        return GenerationResult.timed(np.concatenate(rows, axis=0).T, steps.prompt_len, prefill_seconds,
                                      decode_seconds)

    def steps(self, input_ids, max_new_tokens: int = 64, temperature: float = 0.0, top_k: int | None = None,
              seed: int = 0, **sampling) -> "Steps":
        """Check the call, compile its programs, and return the iterator of its steps: each `next` runs one step
        (prefill first) and gives its `sampling.Sampled` on the device, without waiting for it. Stopping early
        (at EOS, a stop string, a client gone) leaves nothing behind."""
        return self._steps(input_ids, max_new_tokens, temperature, top_k, seed, 1, **sampling)

    def _steps(self, input_ids, max_new_tokens, temperature, top_k, seed, chunk: int, **sampling) -> "Steps":
        """`steps`, whose decode steps come `chunk` at a time (Sampled fields [n, ...], the last program the rest)
        when chunk > 1."""
        input_ids = check_request(input_ids, None, self.config.vocab_size, max_new_tokens, temperature, top_k, seed,
                                  **sampling)
        params, _ = sampling_params(temperature, top_k, seed, **sampling)
        b, t = input_ids.shape
        max_len = -(-(t + max_new_tokens) // CACHE_BUCKET) * CACHE_BUCKET
        ids, positions = self._inputs(input_ids)
        cache = self._init_cache(b, max_len, self.cache_dtype)
        state = SamplingState.create(params, input_ids, self.config.vocab_size, ids.sharding)

        prefill_args = (self._graph, self._leaves, ids, positions, cache, state)
        prefill = self._program("prefill", prefill_jit, prefill_args)
        step_args = (self._graph, self._leaves, jnp.zeros((b,), jnp.int32), jnp.zeros((b,), jnp.int32), cache,
                     state, jnp.int32(1))
        decoded = max_new_tokens - 1
        sizes = [chunk] * (decoded // chunk) + ([decoded % chunk] if decoded % chunk else [])
        programs = {n: self._program("decode", decode_jit, step_args) if chunk == 1 else
                    self._program("decode_chunk", decode_chunk_jit, step_args, (n,), self._chunk_options)
                    for n in set(sizes)}
        jax.block_until_ready((cache, state))
        return Steps(self._run(prefill, programs, prefill_args[1:], t, sizes, chunk > 1), t)

    def _run(self, prefill, programs, prefill_args, t: int, sizes: list[int], chunked: bool):
        """Prefill's Sampled, then each decode program's: one step's, or (`chunked`) n steps' with fields
        [n, ...]."""
        picked, sampling, cache = prefill(*prefill_args)
        yield picked
        b = picked.token.shape[0]
        token, position, step = picked.token, jnp.full((b,), t, jnp.int32), jnp.int32(1)  # advanced on the device
        for n in sizes:
            picked, sampling, cache, position, step = programs[n](self._leaves, token, position, cache, sampling,
                                                                  step)
            token = picked.token[-1] if chunked else picked.token
            yield picked


@dataclasses.dataclass
class Steps:
    """An iterator of one generation's `Sampled` steps on the device; `prompt_len` is T."""
    it: Iterator
    prompt_len: int

    def __iter__(self):
        return self

    def __next__(self):
        return next(self.it)

    def close(self) -> None:
        self.it.close()
