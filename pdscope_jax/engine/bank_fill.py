"""The decode bank's fill, with its staged copies bounded by what the budget reserves for them.

Contract: `fill(store, bank, writes, group, in_flight=FILL_GROUPS_IN_FLIGHT)` -> the bank (gate_up, down) after
`writes` [(layer, experts [n], rows [n])]: each layer's experts cut into groups of at most `group`, each group's own
arrays staged (`ExpertStore.stage`, never a whole stack) and written into its rows (`ExpertStore.commit_bank`), the
bytes counted as moved. At most `in_flight` groups' staged copies are alive at once: a group is staged only once
the write of the group `in_flight` before it is done, so the device memory the fill needs beside the bank is the
budget's `decode_fill_staging` (`store.budget`), while the next group's copy crosses the link as one is written,
which keeps the link busy.
"""

from __future__ import annotations

import collections

import jax
import numpy as np

from pdscope_jax.store.budget import FILL_GROUPS_IN_FLIGHT


def fill(store, bank: tuple, writes, group: int, in_flight: int = FILL_GROUPS_IN_FLIGHT) -> tuple:
    size = max(group, 1)
    groups = iter([(layer, np.asarray(experts, np.int64)[i:i + size], np.asarray(rows)[i:i + size])
                   for layer, experts, rows in writes for i in range(0, len(experts), size)])
    staged = collections.deque()

    def stage_next() -> None:
        layer, experts, rows = next(groups, (None, None, None))
        if layer is not None:
            store.count_moved(layer, experts)
            staged.append((store.stage(layer, experts, whole=False), rows))

    for _ in range(in_flight):
        stage_next()
    while staged:
        bank = store.commit_bank(bank, *staged.popleft())
        jax.block_until_ready(bank)  # its staged copies are freed: the next group may take their place
        stage_next()
    return bank
