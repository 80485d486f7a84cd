"""The device mesh of expert parallelism: one axis, "experts", over N devices (of one or several processes).

Contract:
- `expert_mesh(devices=None) -> Mesh` puts `devices` (default: every device of every process, `jax.devices()`)
  on the one axis `AXIS`; device i of the axis owns routed experts [i * E/N, (i + 1) * E/N) of every MoE layer.
- `check_split(num_experts, mesh) -> E/N` raises `ExpertParallelError` (an `errors.InputError`) naming E, N
  and the device counts that would work when N does not divide E: expert stacks split only in equal blocks;
  `split_size(num_experts, n)` is the same check for n devices without a mesh.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh

from pdscope_jax.errors import InputError

AXIS = "experts"


class ExpertParallelError(InputError):
    """The experts of a model cannot be split over the mesh as asked."""


def expert_mesh(devices=None) -> Mesh:
    devices = jax.devices() if devices is None else list(devices)
    return Mesh(np.array(devices), (AXIS,))


def check_split(num_experts: int, mesh: Mesh) -> int:
    if AXIS not in mesh.shape:
        raise ExpertParallelError(f"the mesh has axes {tuple(mesh.shape)}, expert parallelism needs one named "
                                  f"{AXIS!r}: build it with parallel.expert_mesh(devices)")
    return split_size(num_experts, mesh.shape[AXIS])


def split_size(num_experts: int, n: int) -> int:
    """E/n, each of n devices owning that many whole experts; `ExpertParallelError` when n does not divide E."""
    if num_experts % n:
        fits = [d for d in range(1, num_experts + 1) if num_experts % d == 0]
        raise ExpertParallelError(
            f"E={num_experts} routed experts per layer do not split evenly over N={n} devices of mesh axis "
            f"{AXIS!r}: each device must own E/N whole experts; use N in {fits}")
    return num_experts // n
