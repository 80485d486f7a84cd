"""store.torch_pinned on a CUDA GPU with torch (skipped elsewhere: CI has neither)."""

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from pdscope_jax.store.torch_pinned import pin_stack, torch_cuda

pytestmark = pytest.mark.skipif(not (torch_cuda() and jax.default_backend() == "gpu"),
                                reason="needs torch with CUDA and a jax GPU")


@pytest.mark.parametrize("on_gpu", [True, False])
def test_a_stack_is_pinned_at_its_exact_size_and_its_experts_alias_it(on_gpu):
    gpu = jax.devices("gpu")[0]
    src = jax.random.normal(jax.random.key(0), (4, 64, 96), jnp.bfloat16)
    pinned = pin_stack(src if on_gpu else np.asarray(src), gpu)
    assert pinned.registered and pinned.buffer.numel() == src.nbytes  # no power-of-two rounding
    assert pinned.whole.sharding.memory_kind == "pinned_host" and pinned.whole.devices() == {gpu}
    np.testing.assert_array_equal(np.asarray(pinned.whole), np.asarray(src))
    for e, expert in enumerate(pinned.experts):
        assert expert.unsafe_buffer_pointer() == pinned.view[e].ctypes.data
    pinned.view[2, 0, 0] = 7  # one memory: a write through the view shows in the imported expert
    assert float(np.asarray(pinned.experts[2])[0, 0]) == 7.0
    pinned.release()
    assert not pinned.registered
