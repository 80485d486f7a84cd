"""Continuous batching of the whole (all-resident) model: sequence slots over one KV cache, joined and left at
step boundaries.

Contract: `Batcher(model, max_batch, max_len, chunk)` owns a cache of max_batch rows of S >= max_len positions
and a `SamplingState` of max_batch rows.
- `admit(prompt_ids, params, max_new_tokens) -> slot`: takes the lowest free slot (`free_slots` > 0 needed);
  raises InputError when prompt + max_new_tokens exceed max_len. The prompt is prefilled later, by `step`.
- `step() -> [Emitted]`: one decode step of every row that has its first token (one program for all of them),
  then one prefill chunk of `chunk` prompt tokens of the oldest admitted row still prefilling (so prompts are
  prefilled in chunks interleaved with decode steps); the chunk that ends a prompt also samples its first token.
  At most one token per row per step; a row leaves by itself after max_new_tokens (`Emitted.last`).
- `release(slot)`: the row leaves now (EOS, stop string, cancelled); nothing is computed for it again.
Ragged rows: each row has its own positions (cache index = position) and sampling step; the causal mask hides
cache entries past a row's position, so a reused slot needs no clearing. Rows not decoding in a step (free or
prefilling) are masked: their cache rows and sampling state come back unchanged. Shapes are bucketed so joining and
leaving compile nothing: decode runs on the first `rows` slots (a power of two >= the highest decoding slot + 1)
over the first `length` cache positions (a power of two >= 64 covering every decoding row's position, at most S); a
prefill chunk runs on one slot over `length` positions covering the chunk. `compiles` counts the programs this
batcher built (batchers of one model and size share them). A row's tokens depend on its prompt, settings, seed and
step only (float32: the same tokens as `Generator` gives the request alone).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pdscope_jax.errors import InputError
from pdscope_jax.generation.generator import CACHE_BUCKET
from pdscope_jax.generation.sampling import SamplingParams, SamplingState, sample
from pdscope_jax.models.layers import CausalLM

CHUNK = 32  # prompt tokens prefilled per step


@dataclasses.dataclass
class Emitted:
    """One row's token of one step (host values)."""
    slot: int
    token: int
    logprob: float
    top_ids: np.ndarray  # [N] int32
    top_logprobs: np.ndarray  # [N] float32
    last: bool  # the row reached its max_new_tokens and left


@dataclasses.dataclass
class Row:
    prompt: np.ndarray  # int32 [T]
    max_new: int
    state: SamplingState  # one row, fresh: written into the batch state by the chunk that ends the prompt
    order: int  # admission order: prompts are prefilled first come, first served
    offset: int = 0  # prompt tokens prefilled so far
    generated: int = 0
    token: int = 0  # the last generated token: the next decode input

    @property
    def decoding(self) -> bool:
        return self.generated > 0


def _pow2_bucket(n: int, floor: int, cap: int) -> int:
    return min(cap, max(floor, 1 << (max(n, 1) - 1).bit_length()))


def _rows(tree, rows: int, length: int):
    """The first `rows` rows and `length` positions of every [B, S, ...] cache leaf."""
    return jax.tree.map(lambda x: x[:rows, :length], tree)


def _put(full, part, start):
    """`part` written into `full` at row `start`, position 0, leaf by leaf."""
    return jax.tree.map(lambda f, p: jax.lax.dynamic_update_slice(f, p.astype(f.dtype), (start,) + (0,) *
                                                                  (f.ndim - 1)), full, part)


def _decode(graphdef, state, cache, sampling, tokens, positions, steps, active, rows: int, length: int):
    model = nnx.merge(graphdef, state)
    old = _rows(cache, rows, length)
    logits, new = model(tokens[:rows, None], positions[:rows, None], old)
    live = active[:rows]
    keep = lambda n, o: jnp.where(live.reshape((rows,) + (1,) * (n.ndim - 1)), n, o)  # noqa: E731
    row_sampling = jax.tree.map(lambda x: x[:rows], sampling)
    picked, moved = sample(logits[:, 0], row_sampling, steps[:rows])
    cache = _put(cache, jax.tree.map(keep, new, old), 0)
    sampling = _put(sampling, jax.tree.map(keep, moved, row_sampling), 0)
    return picked, sampling, cache


def _prefill_chunk(graphdef, state, cache, sampling, slot, ids, offset, last, fresh, length: int):
    model = nnx.merge(graphdef, state)
    row = jax.tree.map(lambda x: jax.lax.dynamic_slice_in_dim(x, slot, 1, axis=0)[:, :length], cache)
    positions = offset + jnp.arange(ids.shape[1], dtype=jnp.int32)[None]
    x, row = model.hidden(ids, positions, row)
    logits = model.logits(jax.lax.dynamic_slice_in_dim(x, last, 1, axis=1))[:, 0]  # the last prompt token's
    picked, fresh = sample(logits, fresh, 0)
    return picked, _put(sampling, fresh, slot), _put(cache, row, slot)


# Module-level so that batchers of one architecture and size (equal graphdefs, shapes) share compiled programs.
decode_jit = jax.jit(_decode, static_argnums=(0, 8, 9), donate_argnums=(2, 3))
prefill_chunk_jit = jax.jit(_prefill_chunk, static_argnums=(0, 9), donate_argnums=(2, 3))
_compiled: dict[tuple, jax.stages.Compiled] = {}


class Batcher:
    def __init__(self, model: CausalLM, max_batch: int = 8, max_len: int | None = None, chunk: int = CHUNK):
        if max_batch < 1 or chunk < 1 or chunk & (chunk - 1):
            raise InputError(f"max_batch must be >= 1 and chunk a power of two, got {max_batch}, {chunk}")
        self.config = model.config
        self.max_batch, self.chunk = max_batch, chunk
        self.max_len = max_len or self.config.max_position_embeddings
        unit = max(CACHE_BUCKET, chunk)
        self.cache_len = -(-self.max_len // unit) * unit  # a multiple of chunk: no chunk runs past the end
        self.cache_dtype = model.embed.embedding.dtype
        self._init_cache = model.init_cache
        self.graphdef, self.state = nnx.split(model)
        full_f32 = jnp.dtype(self.cache_dtype) == jnp.float32
        self._precision = functools.partial(jax.default_matmul_precision, "highest" if full_f32 else None)
        self.compiles = 0
        self.reset()

    def reset(self) -> None:
        """Every slot free and a fresh cache (after an error, whose donated buffers may be gone)."""
        self.cache = self._init_cache(self.max_batch, self.cache_len, self.cache_dtype)
        self.sampling = SamplingState.create(SamplingParams(), np.zeros((self.max_batch, 1), np.int32),
                                             self.config.vocab_size)
        self.rows: list[Row | None] = [None] * self.max_batch
        self._admitted = 0

    @property
    def free_slots(self) -> int:
        return self.rows.count(None)

    @property
    def active(self) -> int:
        return self.max_batch - self.free_slots

    def admit(self, prompt_ids, params: SamplingParams, max_new_tokens: int) -> int:
        prompt = np.asarray(prompt_ids, np.int32).reshape(-1)
        if not 1 <= len(prompt) or len(prompt) + max_new_tokens > self.max_len or max_new_tokens < 1:
            raise InputError(f"{len(prompt)} prompt + {max_new_tokens} new tokens do not fit the batch cache of "
                             f"{self.max_len} positions (need a non-empty prompt and max_new_tokens >= 1); ask for "
                             "fewer tokens or serve with a larger --max-seq-len")
        if None not in self.rows:
            raise InputError(f"all {self.max_batch} slots are taken; admit when free_slots > 0")
        slot = self.rows.index(None)
        fresh = SamplingState.create(params, prompt[None], self.config.vocab_size)
        self.rows[slot] = Row(prompt, max_new_tokens, fresh, self._admitted)
        self._admitted += 1
        return slot

    def release(self, slot: int) -> None:
        self.rows[slot] = None

    def _program(self, name: str, jitted, args: tuple, static: tuple):
        shapes = tuple((a.shape, str(a.dtype)) for a in jax.tree.leaves(args[1:-len(static)]))
        key = (name, args[0], static, shapes)
        if key not in _compiled:
            with self._precision():
                _compiled[key] = jitted.lower(*args).compile()
            self.compiles += 1
        return _compiled[key]

    def step(self) -> list[Emitted]:
        out = self._decode_step()
        prefilling = [(r.order, slot) for slot, r in enumerate(self.rows) if r is not None and not r.decoding]
        if prefilling:
            out += self._prefill_step(min(prefilling)[1])
        return out

    def _decode_step(self) -> list[Emitted]:
        live = [slot for slot, r in enumerate(self.rows) if r is not None and r.decoding]
        if not live:
            return []
        b = self.max_batch
        tokens, positions, steps = (np.zeros(b, np.int32) for _ in range(3))
        active = np.zeros(b, bool)
        for slot in live:
            r = self.rows[slot]
            tokens[slot], positions[slot], steps[slot] = r.token, len(r.prompt) + r.generated - 1, r.generated
            active[slot] = True
        rows = _pow2_bucket(live[-1] + 1, 1, b)
        length = _pow2_bucket(int(positions.max()) + 1, CACHE_BUCKET, self.cache_len)
        args = (self.graphdef, self.state, self.cache, self.sampling, *map(jnp.asarray, (tokens, positions, steps,
                                                                                          active)), rows, length)
        program = self._program("decode", decode_jit, args, (rows, length))
        picked, self.sampling, self.cache = program(*args[1:8])
        return self._emit(jax.device_get(picked), {slot: slot for slot in live})

    def _prefill_step(self, slot: int) -> list[Emitted]:
        r = self.rows[slot]
        c, t = self.chunk, len(r.prompt)
        ids = np.zeros((1, c), np.int32)
        part = r.prompt[r.offset: r.offset + c]
        ids[0, : len(part)] = part
        length = _pow2_bucket(r.offset + c, CACHE_BUCKET, self.cache_len)
        args = (self.graphdef, self.state, self.cache, self.sampling, jnp.int32(slot), jnp.asarray(ids),
                jnp.int32(r.offset), jnp.int32(len(part) - 1), r.state, length)
        program = self._program("prefill", prefill_chunk_jit, args, (length,))
        picked, self.sampling, self.cache = program(*args[1:9])
        r.offset += len(part)
        if r.offset < t:
            return []
        return self._emit(jax.device_get(picked), {0: slot})

    def _emit(self, picked, at: dict[int, int]) -> list[Emitted]:
        """Emitted tokens of the rows `at` maps (index in `picked` -> slot); rows at max_new_tokens leave."""
        out = []
        for i, slot in at.items():
            r = self.rows[slot]
            r.token = int(picked.token[i])
            r.generated += 1
            last = r.generated >= r.max_new
            out.append(Emitted(slot, r.token, float(picked.logprob[i]), picked.top_ids[i], picked.top_logprobs[i],
                               last))
            if last:
                self.release(slot)
        return out
