"""Cost-table files: sealed on save, a corrupt or truncated file is a CostTableError naming it and the fix."""

from __future__ import annotations

import json

import pytest

from pdscope_jax.sched.costs import CostTable, CostTableError

TABLE = CostTable.analytic(expert_bytes=1e6, flops_per_token=1e6, pcie_GBps=25, cpu_GFLOPs=100, gpu_TFLOPs=100,
                           model="m")


def test_save_seals_and_load_checks(tmp_path):
    path = tmp_path / "t.json"
    TABLE.save(path)
    assert CostTable.load(path) == TABLE and len(json.loads(path.read_text())["checksum"]) == 64
    path.write_text(path.read_text().replace('"model": "m"', '"model": "n"'))
    with pytest.raises(CostTableError, match=r"t.json: cost table is corrupt or was edited.*pdscope-jax profile"):
        CostTable.load(path)


def test_truncated_or_missing_file(tmp_path):
    path = tmp_path / "t.json"
    TABLE.save(path)
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(CostTableError, match=r"t.json is not valid JSON .*corrupt or truncated.*pdscope-jax profile"):
        CostTable.load(path)
    with pytest.raises(CostTableError, match=r"nope.json is missing"):
        CostTable.load(tmp_path / "nope.json")


def test_a_hand_written_table_without_a_checksum_still_loads(tmp_path):
    (tmp_path / "t.json").write_text(TABLE.to_json())
    assert CostTable.load(tmp_path / "t.json") == TABLE
