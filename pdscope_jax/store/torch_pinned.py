"""Page-locked host buffers through torch, for the expert store's `host_alloc="torch"`: one exact-size buffer per
layer stack, imported zero-copy into JAX as `pinned_host` arrays of the accelerator.

Contract:
- `torch_cuda()`: torch is importable and sees a CUDA device.
- `pin_stack(src, accel) -> PinnedStack`: a buffer of src's bytes ([E, ...], a jax array anywhere or numpy), with
  `whole` (the stack) and `experts` (its E slices), both `pinned_host` arrays of `accel` aliasing the buffer, and
  `view`, a numpy view of the same bytes. A source on a GPU fills the buffer by one device-to-host copy straight
  into it (no pageable bounce); any other source by a host copy.
- The buffer is `torch.empty` (the CPU allocator: exact size, 64-byte aligned) page-locked with `cudaHostRegister`;
  where registering fails, torch's pinned allocator instead. Why not that allocator first: it rounds every
  block up to a power of two (a 704 MiB DeepSeek-V2-Lite gate_up stack takes 1 GiB), and it page-locked more
  slowly than registering (docs/MEASUREMENTS.md). `PinnedStack.release()` (or its collection) unregisters.
- RuntimeError where the import does not give `pinned_host` memory of `accel` (a torch whose dlpack export does
  not mark pinned memory): use `host_alloc="jax"`.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np


def torch_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


@dataclasses.dataclass
class PinnedStack:
    whole: jax.Array
    experts: list[jax.Array]
    view: np.ndarray
    buffer: object  # the torch tensor that owns the bytes
    registered: bool  # page-locked by cudaHostRegister (else by torch's pinned allocator)

    def release(self) -> None:
        """Unregister the page lock (the bytes stay valid while any array still holds them)."""
        if self.registered:
            import torch

            torch.cuda.cudart().cudaHostUnregister(self.buffer.data_ptr())
            self.registered = False

    def __del__(self):
        try:
            self.release()
        except Exception:  # noqa: BLE001 (at interpreter exit torch or CUDA may be gone; the OS unlocks the pages)
            pass


def pin_stack(src, accel: jax.Device) -> PinnedStack:
    import torch

    dtype = np.dtype(src.dtype)
    buffer, registered = _page_locked(src.nbytes)
    view = buffer.numpy().view(dtype).reshape(src.shape)
    typed = buffer.view(getattr(torch, dtype.name)).reshape(src.shape)
    if isinstance(src, jax.Array) and all(d.platform == "gpu" for d in src.devices()):
        typed.copy_(torch.from_dlpack(src))  # DMA into the page-locked bytes; returns when done
    else:
        view[...] = np.asarray(src)
    whole = jax.dlpack.from_dlpack(typed)
    experts = [jax.dlpack.from_dlpack(typed[e]) for e in range(src.shape[0])]
    for array in (whole, *experts):
        if array.sharding.memory_kind != "pinned_host" or array.devices() != {accel}:
            raise RuntimeError(f"dlpack import of pinned torch memory gave {array.sharding}, not pinned_host memory "
                               f"of {accel}; use host_alloc='jax'")
    return PinnedStack(whole, experts, view, buffer, registered)


def _page_locked(nbytes: int):
    """(a uint8 torch tensor of nbytes, page-locked; whether by cudaHostRegister)."""
    import torch

    buffer = torch.empty(nbytes, dtype=torch.uint8)
    if nbytes and int(torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), nbytes, 0)) == 0:
        return buffer, True
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True), False
