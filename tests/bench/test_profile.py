"""`pdscope-jax profile` on a tiny preset: a measured cost table the planners can load by name."""

import json

import pytest

from pdscope_jax.errors import InputError
from pdscope_jax.presets import preset
from pdscope_jax.cli.profile import profile_main
from pdscope_jax.sched import CostTable, load_cost_table
from pdscope_jax.sched.costs import table_name


def test_profile_tiny_preset_saves_a_loadable_table(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PDSCOPE_JAX_COSTS", str(tmp_path))
    saved = profile_main(["tiny-qwen3-30b-a3b", "--dtype", "float32", "--max-tokens", "64", "--repeats", "2",
                          "--decode-max-batch", "8"])
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    name = table_name("tiny-qwen3-30b-a3b", "cpu-standin")
    assert summary["json"] == str(tmp_path / f"{name}.json") and summary["device"] == "cpu-standin"
    table = load_cost_table(name)  # found by name in the cost-table directory
    assert table == CostTable.from_dict(saved) and table.source == "measured"
    assert table.token_buckets == (1, 2, 4, 8, 16, 32, 64)
    e = preset("tiny-qwen3-30b-a3b").num_experts
    assert table.transfer_counts == (1, 2, 4, 8)[: e.bit_length()] and table.transfer_counts[-1] == e
    assert table.t_io > 0 and table.alpha >= 0 and 0 <= table.gpu_launch_seconds <= min(table.gpu_expert_seconds)
    for values in (table.cpu_expert_seconds, table.gpu_expert_seconds, table.attn_prefill_seconds,
                   table.attn_decode_seconds, table.transfer_seconds):
        assert all(v > 0 for v in values)
    meta = dict(table.meta)
    assert meta["accelerator"].startswith("cpu:1") and meta["cpu_backend"] == "cpu:0"
    assert meta["accelerator_is_cpu_standin"] == "True" and "--max-tokens 64" in meta["command"]
    # decode beyond --decode-max-batch is scaled from the largest measured batch
    assert table.attn_decode_seconds[-1] == pytest.approx(table.attn_decode_seconds[3] * 64 / 8)


def test_profile_rejects_empty_buckets_and_names_every_problem(tmp_path):
    with pytest.raises(InputError, match="--max-tokens must be an integer >= 1, got 0") as err:
        profile_main(["tiny-qwen3-30b-a3b", "--max-tokens", "0", "--repeats", "0", "--out", str(tmp_path / "x.json")])
    assert "--max-tokens 0 drops every bucket" in str(err.value) and "--repeats must be" in str(err.value)
    assert not (tmp_path / "x.json").exists()


def test_profile_of_quantized_experts_is_its_own_table(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PDSCOPE_JAX_COSTS", str(tmp_path))
    saved = profile_main(["tiny-qwen3-30b-a3b", "--quantize", "int4", "--max-tokens", "8", "--repeats", "2",
                          "--decode-max-batch", "2"])
    name = table_name("tiny-qwen3-30b-a3b-int4", "cpu-standin")
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["json"] == str(tmp_path / f"{name}.json")
    table = load_cost_table(name)
    assert table == CostTable.from_dict(saved) and dict(table.meta)["quantize"] == "int4"
    assert all(v > 0 for v in (*table.cpu_expert_seconds, *table.gpu_expert_seconds, *table.transfer_seconds))
