"""Host memory near a GPU: on hosts with several NUMA nodes, the page-locked expert buffers of a GPU's share are
placed on the node its PCIe link hangs off, so its copies do not cross the socket interconnect.

Contract (Linux; elsewhere every function answers "no node" and nothing is placed):
- `memory_nodes(sysfs)` -> the NUMA nodes that hold memory (`[0]` on a single-node host).
- `pci_node(bus_id, sysfs)` -> the node of a PCI device ("0000:3B:00.0", any case), or None where unknown.
- `gpu_node(ordinal)` -> the node of CUDA GPU `ordinal` (its PCI bus id from the driver) where the host has several
  memory nodes, else None (one node: nothing to choose); asked once per GPU and process.
- `prefer(address, nbytes, node)` -> whether the kernel accepted `mbind(MPOL_PREFERRED)` for the page-aligned range:
  pages faulted in afterwards come from that node while it has free memory, else from another (never a failure).
- `policy_at(address)` -> (mode, node mask) the kernel applies to the page at `address` (`get_mempolicy`).
"""

from __future__ import annotations

import ctypes
import functools
import platform
from pathlib import Path

SYSFS = Path("/sys")
MPOL_DEFAULT, MPOL_PREFERRED = 0, 1
_MPOL_F_ADDR = 2
# (mbind, get_mempolicy) system call numbers; no libc wrapper is needed (libnuma is not assumed)
_SYSCALLS = {"x86_64": (237, 239), "aarch64": (235, 236)}
_MASK_BITS = 64  # one unsigned long of node mask: nodes 0-63
_libc = ctypes.CDLL(None, use_errno=True)


def memory_nodes(sysfs: Path = SYSFS) -> list[int]:
    listed = sysfs / "devices/system/node/has_memory"
    if not listed.exists():
        return [0]
    nodes = []
    for part in listed.read_text().strip().split(","):
        if part:
            lo, _, hi = part.partition("-")
            nodes += range(int(lo), int(hi or lo) + 1)
    return nodes or [0]


def pci_node(bus_id: str, sysfs: Path = SYSFS) -> int | None:
    path = sysfs / "bus/pci/devices" / bus_id.lower() / "numa_node"
    try:
        node = int(path.read_text())
    except (OSError, ValueError):
        return None
    return node if node >= 0 else None


@functools.cache  # asked for every buffer a model's load page-locks; the answer never changes
def gpu_node(ordinal: int) -> int | None:
    if len(memory_nodes()) < 2:
        return None
    from pdscope_jax import cuda_driver

    lib = cuda_driver.driver()
    device, bus_id = ctypes.c_int(), ctypes.create_string_buffer(32)
    if lib.cuDeviceGet(ctypes.byref(device), ordinal) or lib.cuDeviceGetPCIBusId(bus_id, len(bus_id), device):
        return None
    return pci_node(bus_id.value.decode())


def prefer(address: int, nbytes: int, node: int) -> bool:
    calls = _SYSCALLS.get(platform.machine())
    if calls is None or not 0 <= node < _MASK_BITS or nbytes <= 0:
        return False
    mask = ctypes.c_ulong(1 << node)
    # every argument a full word: the kernel reads whole registers
    return _libc.syscall(ctypes.c_long(calls[0]), ctypes.c_void_p(address), ctypes.c_ulong(nbytes),
                         ctypes.c_ulong(MPOL_PREFERRED), ctypes.byref(mask), ctypes.c_ulong(_MASK_BITS + 1),
                         ctypes.c_ulong(0)) == 0


def policy_at(address: int) -> tuple[int, int] | None:
    calls = _SYSCALLS.get(platform.machine())
    if calls is None:
        return None
    mode, mask = ctypes.c_int(), ctypes.c_ulong()
    if _libc.syscall(ctypes.c_long(calls[1]), ctypes.byref(mode), ctypes.byref(mask), ctypes.c_ulong(_MASK_BITS + 1),
                     ctypes.c_void_p(address), ctypes.c_ulong(_MPOL_F_ADDR)) != 0:
        return None
    return mode.value, mask.value
