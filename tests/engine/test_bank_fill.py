"""The decode bank's fill (engine.bank_fill): every expert written into its row, in groups of at most a layer's
share, with no more than the budget's groups of staged copies alive at once."""

import jax.numpy as jnp
import numpy as np

from pdscope_jax.engine import bank_fill


class RecordingStore:
    """Stands in for `ExpertStore`: a bank row holds its expert's id (times 10, plus the layer); every stage and
    write is recorded in order, and the staged groups not yet written are counted."""

    def __init__(self):
        self.events, self.alive, self.most_alive, self.moved = [], 0, 0, 0

    def count_moved(self, layer, experts):
        self.moved += len(experts)

    def stage(self, layer, experts, whole=True):
        assert whole is False  # the fill stages what it writes, never a whole stack
        self.alive += 1
        self.most_alive = max(self.most_alive, self.alive)
        self.events.append(("stage", layer, [int(x) for x in experts]))
        return layer, experts

    def commit_bank(self, bank, staged, rows):
        layer, experts = staged
        self.alive -= 1
        self.events.append(("write", layer, [int(x) for x in experts]))
        return bank.at[np.asarray(rows)].set(jnp.asarray(np.asarray(experts) * 10 + layer, bank.dtype))


def test_every_expert_lands_in_its_row_with_two_groups_in_flight():
    store = RecordingStore()
    writes = [(0, [5, 1, 7], [0, 2, 4]), (3, [2, 6], [1, 3]), (4, [], []), (9, [4], [5])]
    (bank,) = bank_fill.fill(store, (jnp.full(6, -1, jnp.int32),), writes, group=2, in_flight=2)
    assert np.asarray(bank).tolist() == [50, 23, 10, 63, 70, 49]
    groups = [(0, [5, 1]), (0, [7]), (3, [2, 6]), (9, [4])]  # a layer's experts cut into groups of at most 2
    assert [e[1:] for e in store.events if e[0] == "stage"] == [(layer, list(g)) for layer, g in groups]
    assert store.moved == 6 and store.most_alive == 2
    # group i + 2 is staged only after group i is written: two groups' copies at most, the next one crossing
    order = [f"{kind} {layer} {experts}" for kind, layer, experts in store.events]
    for i in range(len(groups) - 2):
        assert order.index(f"write {groups[i][0]} {groups[i][1]}") < order.index(
            f"stage {groups[i + 2][0]} {groups[i + 2][1]}")


def test_one_group_in_flight_writes_before_it_stages_again():
    store = RecordingStore()
    bank_fill.fill(store, (jnp.zeros(4, jnp.int32),), [(1, [0, 1, 2, 3], [0, 1, 2, 3])], group=1, in_flight=1)
    assert [kind for kind, _, _ in store.events] == ["stage", "write"] * 4 and store.most_alive == 1


def test_rows_numbered_over_pieces_land_in_their_piece_in_groups_cut_at_its_edge():
    """Pieces of 4 and 2 rows: rows 0-3 are the first piece's, 4-5 the second's rows 0-1; a layer whose rows
    straddle the edge is written in groups within one piece each, every expert in its row."""
    store = RecordingStore()
    pieces = (jnp.full(4, -1, jnp.int32), jnp.full(2, -1, jnp.int32))
    writes = [(0, [5, 1, 7], [2, 3, 4]), (3, [2, 6, 8], [0, 5, 1])]
    first, second = bank_fill.fill(store, pieces, writes, group=2, in_flight=2)
    assert np.asarray(first).tolist() == [23, 83, 50, 10] and np.asarray(second).tolist() == [70, 63]
    written = [(layer, experts) for kind, layer, experts in store.events if kind == "write"]
    assert written == [(0, [5, 1]), (0, [7]), (3, [2, 8]), (3, [6])]
