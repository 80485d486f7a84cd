"""store.page_locked: the dlpack export and the page faulting on any machine; the driver's buffers on a CUDA GPU."""

import ctypes
import gc
import mmap
import weakref

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from pdscope_jax.store import page_locked

gpu_only = pytest.mark.skipif(not (page_locked.driver_ready() and jax.default_backend() == "gpu"),
                              reason="needs the CUDA driver and a jax GPU")


class Owner:
    """Anonymous memory, 2 MiB; weakly referenceable, to see when it is let go."""

    def __init__(self):
        self.map = mmap.mmap(-1, 2 << 20)
        self.bytes = np.frombuffer(self.map, np.uint8)


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16, np.int8, np.uint8])
def test_a_cpu_export_aliases_the_bytes_and_keeps_their_owner_alive(dtype):
    owner = Owner()
    values = owner.bytes[:24 * np.dtype(dtype).itemsize].view(dtype).reshape(2, 3, 4)
    values[...] = np.arange(24).reshape(2, 3, 4).astype(dtype)
    view = page_locked.DlpackView(values.ctypes.data, values.shape, dtype, (page_locked.DL_CPU, 0), owner)
    array = jax.dlpack.from_dlpack(view)
    assert array.dtype == np.dtype(dtype) and array.shape == (2, 3, 4)
    assert array.unsafe_buffer_pointer() == values.ctypes.data  # no copy
    np.testing.assert_array_equal(np.asarray(array), values)
    alive = weakref.ref(owner)
    del owner, view, values
    gc.collect()
    assert alive() is not None  # the imported array holds its bytes' owner
    del array
    gc.collect()
    assert alive() is None  # and lets go once freed


def test_populating_from_threads_faults_every_page_and_keeps_the_zeros():
    owner = Owner()
    address = ctypes.addressof(ctypes.c_char.from_buffer(owner.map))
    page_locked._populate(address, owner.bytes, threads=3)
    assert not owner.bytes.any()


@gpu_only
@pytest.mark.parametrize("on_gpu", [True, False])
def test_a_stack_is_page_locked_at_its_size_and_its_experts_alias_it(on_gpu):
    gpu = jax.devices("gpu")[0]
    src = jax.random.normal(jax.random.key(0), (4, 64, 96), jnp.bfloat16)
    pinned = page_locked.pin_stack(src if on_gpu else np.asarray(src), gpu)
    assert pinned.buffer.registered and pinned.buffer.nbytes == src.nbytes
    assert pinned.whole.sharding.memory_kind == "pinned_host" and pinned.whole.devices() == {gpu}
    np.testing.assert_array_equal(np.asarray(pinned.whole), np.asarray(src))
    for e, expert in enumerate(pinned.experts):
        assert expert.unsafe_buffer_pointer() == pinned.view[e].ctypes.data
    moved = jax.device_put(pinned.experts[2], jax.sharding.SingleDeviceSharding(gpu, memory_kind="device"))
    np.testing.assert_array_equal(np.asarray(moved), np.asarray(src[2]))
    pinned.release()
    assert not pinned.buffer.registered


@gpu_only
def test_a_buffer_maker_hands_out_expected_buffers_in_order_and_makes_unexpected_ones():
    maker = page_locked.BufferMaker(jax.devices("gpu")[0].local_hardware_id, threads=2, populate_threads=2)
    maker.expect([4096, 8192, 4096])
    first, second = maker.take(4096), maker.take(4096)
    other, unexpected = maker.take(8192), maker.take(12288)
    assert [b.nbytes for b in (first, second, other, unexpected)] == [4096, 4096, 8192, 12288]
    assert all(b.registered for b in (first, second, other, unexpected)) and first is not second
    maker.close()


def test_page_lock_threads_come_from_the_environment_or_the_default(monkeypatch):
    monkeypatch.delenv(page_locked.PAGE_LOCK_THREADS_ENV, raising=False)
    assert page_locked.page_lock_threads() == page_locked.PAGE_LOCK_THREADS
    monkeypatch.setenv(page_locked.PAGE_LOCK_THREADS_ENV, "6")
    assert page_locked.page_lock_threads() == 6
    for bad in ("0", "-2", "four", "1.5"):
        monkeypatch.setenv(page_locked.PAGE_LOCK_THREADS_ENV, bad)
        with pytest.raises(ValueError, match=page_locked.PAGE_LOCK_THREADS_ENV):
            page_locked.page_lock_threads()
