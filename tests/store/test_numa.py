"""store.numa: which NUMA nodes hold memory and which one a PCI device hangs off (read from a sysfs tree), and a
memory range's placement asked of the kernel (`mbind`) and read back (`get_mempolicy`) on this machine."""

import ctypes
import mmap

from pdscope_jax.store import numa


def _sysfs(tmp_path, has_memory=None, devices=None):
    if has_memory is not None:
        nodes = tmp_path / "devices/system/node"
        nodes.mkdir(parents=True)
        (nodes / "has_memory").write_text(has_memory + "\n")
    for bus_id, node in (devices or {}).items():
        device = tmp_path / "bus/pci/devices" / bus_id
        device.mkdir(parents=True)
        (device / "numa_node").write_text(f"{node}\n")
    return tmp_path


def test_memory_nodes_read_as_listed_and_one_node_without_a_list(tmp_path):
    assert numa.memory_nodes(_sysfs(tmp_path / "a", "0-1,3")) == [0, 1, 3]
    assert numa.memory_nodes(_sysfs(tmp_path / "b")) == [0]


def test_a_gpus_node_comes_from_its_pci_device_and_unknown_is_none(tmp_path):
    sysfs = _sysfs(tmp_path, devices={"0000:3b:00.0": 1, "0000:5e:00.0": -1})
    assert numa.pci_node("0000:3B:00.0", sysfs) == 1  # the driver's bus ids are upper case, sysfs's lower
    assert numa.pci_node("0000:5e:00.0", sysfs) is None  # the kernel's "no node"
    assert numa.pci_node("0000:99:00.0", sysfs) is None


def test_prefer_places_a_range_on_a_node_for_the_kernel():
    region = mmap.mmap(-1, 4 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    address = ctypes.addressof(ctypes.c_char.from_buffer(region))
    assert numa.policy_at(address) == (numa.MPOL_DEFAULT, 0)
    assert numa.prefer(address, 4 << 20, 0)
    assert numa.policy_at(address) == (numa.MPOL_PREFERRED, 1)
    assert not numa.prefer(address, 4 << 20, 64)  # past the node mask: refused, nothing changed
    assert numa.policy_at(address) == (numa.MPOL_PREFERRED, 1)


def test_a_single_node_host_chooses_no_node(monkeypatch):
    monkeypatch.setattr(numa, "memory_nodes", lambda sysfs=numa.SYSFS: [0])
    numa.gpu_node.cache_clear()  # kept per process: ask afresh under the patch, and leave nothing of it behind
    try:
        assert numa.gpu_node(0) is None  # answered before the driver is asked anything
    finally:
        numa.gpu_node.cache_clear()
