"""Continuous batching of an offloaded model: `generation.batcher.Batcher`'s slots and steps over the offload engine.

Contract: `OffloadBatcher(engine, max_batch=None, max_len=None, chunk=None)` over an `OffloadRunner`: max_batch
rows (at most the engine's budgeted `max_batch`) of one KV cache of S >= max_len positions (at most its
`max_seq_len`), prompts prefilled `chunk` tokens a step (default the engine's `prefill_chunk`; at most max_len).
The interface is the whole model's `Batcher`'s (`admit`, `step`, `release`, `reset`, `free_slots`, `active`,
`rows`), so `serve.batching.BatchingWorker` serves either. One `step()`:
  decode   every row that has its first token, in ONE host-planned step of all max_batch rows
           (`engine.loop.HostLoop`, phase "decode"): rows not decoding are invalid (routed to no expert, counted
           in no statistic) and point at the cache's last position, which every row writes before it reads;
  prefill  then one chunk of the oldest admitted row still prefilling, as a step of that row alone (phase
           "prefill"; its cache row taken out and put back); the chunk that ends a prompt samples its first token.
How the planner sees a mixed step: as its two phases in turn, each planned with that phase's rule over the
tokens it holds (AdaptSched's decode plan for the decoding rows, its prefill plan for the chunk); the slot pool
and the next-layer prefetch carry over between them, as between any two steps.
A row's tokens depend on its prompt, settings, seed and step only: greedy float32 tokens equal those of the
request run alone (`OffloadRunner.generate`). `warmup()` compiles the batch's step shapes and what routing may
need for them, then starts the pool afresh.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pdscope_jax.engine import decode, recovery
from pdscope_jax.errors import InputError
from pdscope_jax.generation.batcher import Batcher
from pdscope_jax.generation.generator import CACHE_BUCKET
from pdscope_jax.generation.sampling import SamplingParams, SamplingState, sample


def _take_row(cache, slot):
    return jax.tree.map(lambda x: jax.lax.dynamic_slice_in_dim(x, slot, 1, axis=0), cache)


def _put_row(cache, row, slot):
    return jax.tree.map(lambda x, r: jax.lax.dynamic_update_slice_in_dim(x, r, slot, axis=0), cache, row)


def _decode_pick(graph, state, x, sampling, steps, active):
    """Sample every row of x [B, 1, D]; rows not `active` keep their sampling state."""
    picked, moved = sample(nnx.merge(graph.graphdef, state).logits(x)[:, 0], sampling, steps)
    keep = lambda new, old: jnp.where(active.reshape((-1,) + (1,) * (new.ndim - 1)), new, old)  # noqa: E731
    return picked, jax.tree.map(keep, moved, sampling)


def _first_pick(graph, state, x, last, fresh, sampling, slot):
    """Sample the first token from position `last` of one row's x [1, C, D] with its fresh state, at step 0, and
    write that state into row `slot` of the batch's."""
    row = jax.lax.dynamic_slice_in_dim(x, last, 1, axis=1)
    picked, fresh = sample(nnx.merge(graph.graphdef, state).logits(row)[:, 0], fresh, 0)
    return picked, jax.tree.map(lambda b, f: jax.lax.dynamic_update_slice_in_dim(b, f.astype(b.dtype), slot, axis=0),
                                sampling, fresh)


_programs = {"take_row": jax.jit(_take_row), "put_row": jax.jit(_put_row, donate_argnums=0),
             "decode_pick": jax.jit(_decode_pick, static_argnums=0, donate_argnums=3),
             "first_pick": jax.jit(_first_pick, static_argnums=0, donate_argnums=5)}


@dataclasses.dataclass
class _Session:
    """Decode steps on the accelerator for a fixed set of rows."""
    slots: list[int]  # the rows decoding, ascending
    rows: list  # their Row objects: a slot left and taken again is not this session's
    decoder: decode.DeviceDecode
    left: int  # steps still to dispatch: the fewest tokens a row still needs


class OffloadBatcher(Batcher):
    def __init__(self, engine, max_batch: int | None = None, max_len: int | None = None, chunk: int | None = None):
        rc = engine.runtime
        max_batch = rc.max_batch if max_batch is None else max_batch
        max_len = rc.max_seq_len if max_len is None else max_len
        chunk = rc.prefill_chunk if chunk is None else chunk
        if not 1 <= max_batch <= rc.max_batch or not 1 <= max_len <= rc.max_seq_len:
            raise InputError(f"the engine's KV cache is budgeted for {rc.max_batch} sequences of {rc.max_seq_len} "
                             f"tokens; a batch of {max_batch} x {max_len} does not fit: load with larger "
                             "max_batch / max_seq_len (--max-batch, --max-seq-len) or batch fewer")
        if chunk < 1 or chunk & (chunk - 1):
            raise InputError(f"chunk must be a power of two, got {chunk}")
        chunk = min(chunk, 1 << (max_len.bit_length() - 1))  # no chunk longer than the cache
        self.engine, self.config = engine, engine.config
        self.max_batch, self.max_len, self.chunk = max_batch, max_len, chunk
        unit = max(CACHE_BUCKET, chunk)
        self.cache_len = -(-max_len // unit) * unit  # a multiple of chunk: no chunk runs past the end
        self.compiles = 0
        self._session = None
        self._fresh()

    def reset(self) -> None:
        """Every slot free and a fresh cache, after an error: its donated buffers may be gone and the pool's table
        may name copies that never landed, so the engine is put back in order too (`engine.recovery`)."""
        if self._session is not None:
            try:
                self._session.decoder.finish()  # its statistics back, its tokens dropped
            except Exception:  # noqa: BLE001 (the session's buffers may be gone: recovery starts afresh)
                pass
            self._session = None
        recovery.after_failure(self.engine)
        self._fresh()

    def _fresh(self) -> None:
        e = self.engine
        self.cache = list(e._init_cache(self.max_batch, self.cache_len, e.cache_dtype))
        self.sampling = SamplingState.create(SamplingParams(), np.zeros((self.max_batch, 1), np.int32),
                                             self.config.vocab_size, e.devices.accel)
        self.rows = [None] * self.max_batch
        self._admitted = 0

    def admit(self, prompt_ids, params: SamplingParams, max_new_tokens: int) -> int:
        slot = super().admit(prompt_ids, params, max_new_tokens)
        row = self.rows[slot]
        row.state = jax.device_put(row.state, self.engine.devices.accel)
        return slot

    def warmup(self) -> None:
        """Compile the decode step of all rows and a prefill chunk (a dummy prompt of one chunk and two tokens),
        and what routing may need for their shapes; then free every slot and start the pool afresh."""
        self.admit(np.zeros(max(min(self.chunk, self.max_len - 2), 1), np.int32), SamplingParams(),
                   min(2, self.max_len - 1))
        while self.active:
            self.step()
        if self._session is not None:
            self._close()  # no row is left to take its tokens
        self.engine.precompile_routed()  # then the pool afresh
        self._fresh()

    def _put(self, array):
        return jax.device_put(array, self.engine.devices.accel)

    def step(self) -> list:
        live = [slot for slot, r in enumerate(self.rows) if r is not None and r.decoding]
        prefilling = [(r.order, slot) for slot, r in enumerate(self.rows) if r is not None and not r.decoding]
        out = []
        session = self._session
        if session is not None and (prefilling or live != session.slots or session.left == 0):
            out += self._close()
            live = [slot for slot, r in enumerate(self.rows) if r is not None and r.decoding]
        if live and not prefilling and (self._session is not None or self._open(live)):
            return out + self._device_step()
        out += self._decode_step()
        if prefilling:
            out += self._prefill_step(min(prefilling)[1])
        return out

    def _open(self, live: list[int]) -> bool:
        """A device decode session over the rows `live`, if `decode.choose` takes the device path for it."""
        e = self.engine
        left = min(self.rows[slot].max_new - self.rows[slot].generated for slot in live)
        if decode.choose(e, self.max_batch, left) is not decode.DeviceDecode:
            return False
        tokens, positions, steps, active = self._decode_inputs(live)
        decoder = decode.DeviceDecode(e, self._put(tokens), self.cache, positions, self.sampling, steps, active)
        self._session = _Session(live, [self.rows[slot] for slot in live], decoder, left)
        return True

    def _device_step(self) -> list:
        session = self._session
        session.decoder.step(0)  # the step number lives on the accelerator, per row
        session.left -= 1
        out = []
        while session.decoder.tokens:
            out += self._emit_present(session.decoder.tokens.pop(0), session)
        return out

    def _close(self) -> list:
        """End the session: its tokens in flight emitted (for rows still here), its cache and sampling state back."""
        session, self._session = self._session, None
        out = [e for picked in session.decoder.finish() for e in self._emit_present(picked, session)]
        self.cache, self.sampling = list(session.decoder.caches), session.decoder.sampling
        return out

    def _emit_present(self, picked, session: _Session) -> list:
        """`picked`'s tokens for the session's rows still in their slots (a row that left drops its own)."""
        return self._emit(picked, {slot: slot for slot, row in zip(session.slots, session.rows)
                                   if self.rows[slot] is row})

    def _decode_inputs(self, live: list[int]):
        """(tokens, positions, sampling steps, active) [max_batch] of a decode step of the rows `live`; the other
        rows at the scratch position."""
        b = self.max_batch
        tokens, steps = np.zeros(b, np.int32), np.zeros(b, np.int32)
        positions, active = np.full(b, self.cache_len - 1, np.int32), np.zeros(b, bool)
        for slot in live:
            r = self.rows[slot]
            tokens[slot], positions[slot], steps[slot] = r.token, len(r.prompt) + r.generated - 1, r.generated
            active[slot] = True
        return tokens, positions, steps, active

    def _decode_step(self) -> list:
        live = [slot for slot, r in enumerate(self.rows) if r is not None and r.decoding]
        if not live:
            return []
        e = self.engine
        tokens, positions, steps, active = self._decode_inputs(live)
        x, cache = e._loop.step(self._put(tokens[:, None]), self._put(positions[:, None]), self.cache, "decode",
                                active)
        self.cache = list(cache)
        picked, self.sampling = _programs["decode_pick"](e._graph, e._state, x, self.sampling, self._put(steps),
                                                         self._put(active))
        return self._emit(jax.device_get(picked), {slot: slot for slot in live})

    def _prefill_step(self, slot: int) -> list:
        e, r, c = self.engine, self.rows[slot], self.chunk
        part = r.prompt[r.offset: r.offset + c]
        ids = np.zeros((1, c), np.int32)
        ids[0, : len(part)] = part
        positions = (r.offset + np.arange(c, dtype=np.int32))[None]
        index = self._put(np.int32(slot))
        row = _programs["take_row"](self.cache, index)
        x, row = e._loop.step(self._put(ids), self._put(positions), list(row), "prefill",
                              np.arange(c) < len(part))
        self.cache = list(_programs["put_row"](self.cache, list(row), index))
        r.offset += len(part)
        if r.offset < len(r.prompt):
            return []
        picked, self.sampling = _programs["first_pick"](e._graph, e._state, x, self._put(np.int32(len(part) - 1)),
                                                        r.state, self.sampling, index)
        return self._emit(jax.device_get(picked), {0: slot})

