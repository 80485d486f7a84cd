"""The engine put back in order after a call that failed part-way, so that the next call runs as on a fresh engine.

Contract: `after_failure(engine)` closes every shard's decode bank, allocates again (zeroed) the slot-pool arrays a
failed program deleted (the programs that write the pool are given its arrays donated, and a program that fails,
out of memory for one, may leave them deleted), then re-applies the policy (`OffloadRunner.set_policy`): the slot
table is forgotten, since a slot reserved for a copy that never landed would read as resident, the policy's resident
experts are written again and the statistics start afresh. The experts' host copies are never touched, so only the
pool's contents are lost. -> whether any pool array had been deleted. It never raises for what it finds; what it
cannot allocate again raises as the failure itself did. `recovers` wraps an engine method so that it calls
`after_failure` when the method raises anything but an `InputError` (a call refused before it ran); generators
handle it themselves (`OffloadRunner._steps`).
"""

from __future__ import annotations

import functools

from pdscope_jax.errors import InputError


def after_failure(engine) -> bool:
    lost = False
    for shard in engine.shards:
        shard.pool.close_decode_bank()
        lost = shard.pool.reallocate_if_lost() or lost
    engine.set_policy(engine.runtime.policy, engine.runtime.policy_options)
    return lost


def recovers(method):
    @functools.wraps(method)
    def wrapped(engine, *args, **kwargs):
        try:
            return method(engine, *args, **kwargs)
        except InputError:  # refused before anything ran
            raise
        except Exception:
            after_failure(engine)
            raise
    return wrapped
