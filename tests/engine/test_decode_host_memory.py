"""A long decode keeps no host memory per step. On the CPU backend `jax.device_get` returns numpy views that pin
the device buffers and their runtime records, and the decode executors used to keep every step they had
yielded, as such views, until the generation ended: host RSS grew 8-34 KB per host-planned decode step of a
tiny model. Checked here without reading RSS (too noisy for a fast test): every step yielded owns its memory,
and nothing keeps the steps the caller has dropped."""

import gc
import weakref

import jax.numpy as jnp
import numpy as np
from flax import nnx

from pdscope_jax import models
from pdscope_jax.engine import decode
from pdscope_jax.engine.runner import OffloadRunner
from pdscope_jax.presets import preset
from pdscope_jax.runtime import RuntimeConfig

STEPS = 16


def test_host_decode_steps_own_their_memory_and_are_not_kept():
    cfg = preset("tiny-deepseek-v2-lite")
    runner = OffloadRunner(models.build(cfg, nnx.Rngs(0), jnp.float32),
                           RuntimeConfig(gpu_memory="1GB", expert_pool=5 * cfg.expert_bytes(4), policy="ondemand",
                                         max_seq_len=64, device_decode=False))
    assert decode.choose(runner, 1, STEPS - 1) is decode.HostDecode
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (1, 20)).astype(np.int32)
    steps = runner.steps(ids, STEPS, temperature=0.8, top_p=0.95, seed=1)
    dropped = []
    for picked in steps:
        arrays = (picked.token, picked.logprob, picked.top_ids, picked.top_logprobs)
        assert all(a.base is None and a.flags.owndata for a in arrays)  # no views of device buffers
        dropped += [weakref.ref(a) for a in arrays]
        del picked, arrays
        # none of the decode steps yielded before stays (prefill's first token, step 0, may: one a generation)
        assert not any(ref() is not None for ref in dropped[4:-4])
    del steps
    gc.collect()
    assert len(dropped) == 4 * STEPS and all(ref() is None for ref in dropped)
    assert runner.stats["decode"]["steps"] == STEPS - 1
