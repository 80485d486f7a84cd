"""The decode bank's fill, with its staged copies bounded by what the budget reserves for them.

Contract: `fill(store, pieces, writes, group, in_flight=FILL_GROUPS_IN_FLIGHT)` -> the bank's pieces after `writes`
[(layer, experts [n], rows [n])], rows numbered over the pieces ((gate_up, down) each, `SlotPool.banks` after the
pool) one after the other: each layer's experts cut into groups of at most `group` within one piece, each group's
own arrays staged (`ExpertStore.stage`, never a whole stack) and written into its rows of its piece
(`ExpertStore.commit_bank`), the bytes counted as moved. At most `in_flight` groups' staged copies are alive at
once: a group is staged only once the write of the group `in_flight` before it is done, so the device memory the
fill needs beside the bank is the budget's `decode_fill_staging` (`store.budget`), while the next group's copy
crosses the link as one is written, which keeps the link busy.
"""

from __future__ import annotations

import collections

import jax
import numpy as np

from pdscope_jax.store.budget import FILL_GROUPS_IN_FLIGHT
from pdscope_jax.store.slot_pool import slot_count


def fill(store, pieces: tuple, writes, group: int, in_flight: int = FILL_GROUPS_IN_FLIGHT) -> tuple:
    pieces = list(pieces)
    starts = np.cumsum([0] + [slot_count(piece) for piece in pieces])
    groups = iter(_groups(writes, starts, max(group, 1)))
    staged = collections.deque()

    def stage_next() -> None:
        layer, piece, experts, rows = next(groups, (None, None, None, None))
        if layer is not None:
            store.count_moved(layer, experts)
            staged.append((piece, store.stage(layer, experts, whole=False), rows))

    for _ in range(in_flight):
        stage_next()
    while staged:
        piece, copies, rows = staged.popleft()
        pieces[piece] = store.commit_bank(pieces[piece], copies, rows)
        jax.block_until_ready(pieces[piece])  # its staged copies are freed: the next group may take their place
        stage_next()
    return tuple(pieces)


def _groups(writes, starts: np.ndarray, size: int) -> list[tuple]:
    """(layer, piece, experts, rows in the piece) of at most `size` experts each, a layer's in the order given."""
    out = []
    for layer, experts, rows in writes:
        experts, rows = np.asarray(experts, np.int64), np.asarray(rows, np.int64)
        piece_of = np.searchsorted(starts, rows, side="right") - 1
        for piece in dict.fromkeys(piece_of.tolist()):  # the pieces in the order the layer's rows reach them
            mine = piece_of == piece
            kept, local = experts[mine], rows[mine] - starts[piece]
            out += [(layer, piece, kept[i:i + size], local[i:i + size]) for i in range(0, kept.size, size)]
    return out
