"""benchmarks/results_index.py: the index and the README table come from the result JSON files themselves."""

import json
from pathlib import Path

from script_import import import_script

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "results_index.py"
RESULTS = SCRIPT.parent / "results"


def _module():
    return import_script(SCRIPT)


def _bench(call, commit, workload, points, **extra):
    return {"what": f"test run {call}", "command": f"/x/pdscope_jax/__main__.py --workload {workload} --call {call}",
            "commit": commit, "call": call, "weights": "random", "model": "deepseek-v2-lite", "workload": workload,
            "ablation": False, **extra,
            "results": [{"policy": p, "batch": 1, "prompt_len": 4096, "prefill_tok_s": pf, "decode_tok_s": dc}
                        for p, pf, dc in points]}


def test_index_and_readme_table_hold_the_files_figures_and_commands(tmp_path, capsys):
    (tmp_path / "offload_a.json").write_text(json.dumps(_bench(
        7, "abc1234", "uniform", [("pdscope", 1234.5, 21.25), ("plain", 26000.0, 109.4)],
        headline_skip=["greedy"])))
    (tmp_path / "offload_b.json").write_text(json.dumps(_bench(
        9, "def5678", "uniform", [("pdscope", 8490.2, 18.31), ("greedy", 3000.0, 5.0)],
        headline_skip=["greedy"])))
    mod = _module()
    assert mod.main(["--dir", str(tmp_path)]) == 0
    index = (tmp_path / "README.md").read_text()
    for text in ("`offload_a.json`", "`offload_b.json`", "`abc1234` (call 7)", "`def5678` (call 9)",
                 "python3 -m pdscope_jax bench --workload uniform --call 7", "pdscope 1,234 / 21.2",
                 "pdscope 8,490 / 18.3", "plain 26,000 / 109"):
        assert text in index, text

    capsys.readouterr()
    assert mod.main(["--dir", str(tmp_path), "--readme"]) == 0
    table = capsys.readouterr().out
    rows = {line.split("|")[1].strip(): line for line in table.splitlines() if line.startswith("| `")}
    assert "8,490 / 18.3" in rows["`pdscope`"]          # the newest call wins
    assert "26,000 / 109.4" in rows["`plain`"]          # taken from the older file, the only one that has it
    assert "`greedy`" not in rows                       # skipped: not a current figure
    assert "DeepSeek-V2-Lite, uniform" in table and "calls 7, 9" in table
    assert len(table.splitlines()) <= 18


def test_every_kept_result_carries_command_and_commit():
    mod = _module()
    for name, d in mod.load(RESULTS):
        p = mod.provenance(d)
        assert p.get("command") and p.get("commit") and p.get("weights"), name


def test_readme_table_keeps_budgets_and_engine_switches_apart(tmp_path, capsys):
    """A newer run at another budget gets its own column; a NAME:nobank variant never stands for its policy."""
    capped = {"runtime": {"gpu_memory": 24e9, "expert_pool": 8e9}}
    (tmp_path / "offload_old.json").write_text(json.dumps(_bench(5, "aaa1111", "uniform", [("pdscope", 8000.0, 18.0)],
                                                                 **capped)))
    new = _bench(6, "bbb2222", "uniform", [("pdscope", 8200.0, 23.5), ("pdscope", 7800.0, 18.4)],
                 runtime={"gpu_memory": 24e9, "expert_pool": None})
    new["results"][1]["variant"] = "pdscope:nobank"
    (tmp_path / "offload_new.json").write_text(json.dumps(new))
    mod = _module()
    assert mod.main(["--dir", str(tmp_path), "--readme"]) == 0
    table = capsys.readouterr().out
    header = next(line for line in table.splitlines() if line.startswith("| policy"))
    assert "DeepSeek-V2-Lite, uniform, 24 GB |" in header and "DeepSeek-V2-Lite, uniform, 24 GB, 8 GB pool" in header
    row = next(line for line in table.splitlines() if line.startswith("| `pdscope`"))
    assert "8,000 / 18.0" in row and "8,200 / 23.5" in row and "7,800" not in row


def test_readme_table_names_an_h100s_column(tmp_path, capsys):
    """The table's card is the H200; a run on an H100 gets its own column that says so."""
    budget = {"runtime": {"gpu_memory": 24e9, "expert_pool": None}}
    (tmp_path / "h200.json").write_text(json.dumps(_bench(7, "ccc3333", "uniform", [("pdscope", 8000.0, 50.0)],
                                                          device="gpu:0 NVIDIA H200", **budget)))
    (tmp_path / "h100.json").write_text(json.dumps(_bench(8, "ddd4444", "uniform", [("pdscope", 7000.0, 45.0)],
                                                          device="gpu:0 NVIDIA H100 80GB HBM3", **budget)))
    assert _module().main(["--dir", str(tmp_path), "--readme"]) == 0
    table = capsys.readouterr().out
    header = next(line for line in table.splitlines() if line.startswith("| policy"))
    assert "DeepSeek-V2-Lite, uniform, 24 GB |" in header and "DeepSeek-V2-Lite, uniform, 24 GB, H100 |" in header
    row = next(line for line in table.splitlines() if line.startswith("| `pdscope`"))
    assert "8,000 / 50.0" in row and "7,000 / 45.0" in row


def test_readme_table_names_a_budget_given_in_mib_in_mib(tmp_path, capsys):
    """A budget set to a peer's measured peak (a whole number of MiB) reads as such, not as 17.0991 GB."""
    peak = {"runtime": {"gpu_memory": 16307 * 2**20, "expert_pool": None}}
    (tmp_path / "peak.json").write_text(json.dumps(_bench(9, "eee5555", "uniform", [("pdscope", 6000.0, 50.0)],
                                                          **peak)))
    assert _module().main(["--dir", str(tmp_path), "--readme"]) == 0
    header = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("| policy"))
    assert "DeepSeek-V2-Lite, uniform, 16,307 MiB |" in header


def test_readme_table_keeps_a_run_matched_by_nvidia_smi_apart_from_a_budget_of_that_figure(tmp_path, capsys):
    """A run held to a peer's nvidia-smi peak has a smaller budget; its column names the matched figure, apart from a
    run whose budget was that figure."""
    peak = {"runtime": {"gpu_memory": 24399 * 2**20, "expert_pool": None}}
    matched = {"runtime": {"gpu_memory": 21726 * 2**20, "expert_pool": None}, "matched_gpu_mib": 24399}
    (tmp_path / "budget.json").write_text(json.dumps(_bench(10, "fff6666", "uniform", [("pdscope", 9000.0, 80.0)],
                                                            **peak)))
    (tmp_path / "matched.json").write_text(json.dumps(_bench(11, "aaa7777", "uniform", [("pdscope", 8500.0, 58.0)],
                                                             **matched)))
    assert _module().main(["--dir", str(tmp_path), "--readme"]) == 0
    table = capsys.readouterr().out
    header = next(line for line in table.splitlines() if line.startswith("| policy"))
    assert "DeepSeek-V2-Lite, uniform, 24,399 MiB |" in header
    assert "DeepSeek-V2-Lite, uniform, 24,399 MiB by nvidia-smi |" in header and "21,726" not in header
    row = next(line for line in table.splitlines() if line.startswith("| `pdscope`"))
    assert "9,000 / 80.0" in row and "8,500 / 58.0" in row


def test_readme_table_puts_whole_model_runs_in_a_column_of_their_own(tmp_path, capsys):
    """A file of `plain` runs alone takes no budget: its column reads "whole model", whatever budget its runtime
    recorded, apart from a file that holds offloaded runs beside the plain one at that budget."""
    budget = {"runtime": {"gpu_memory": 24e9, "expert_pool": None}}
    (tmp_path / "whole.json").write_text(json.dumps(_bench(12, "bbb8888", "uniform", [("plain", 23862.0, 228.5)],
                                                           device="gpu:0 NVIDIA H100 80GB HBM3", **budget)))
    (tmp_path / "offload.json").write_text(json.dumps(_bench(
        13, "ccc9999", "uniform", [("pdscope", 8000.0, 50.0), ("plain", 26000.0, 90.0)],
        device="gpu:0 NVIDIA H100 80GB HBM3", **budget)))
    assert _module().main(["--dir", str(tmp_path), "--readme"]) == 0
    table = capsys.readouterr().out
    header = next(line for line in table.splitlines() if line.startswith("| policy"))
    assert "DeepSeek-V2-Lite, uniform, whole model, H100 |" in header
    assert "DeepSeek-V2-Lite, uniform, 24 GB, H100 |" in header
    row = next(line for line in table.splitlines() if line.startswith("| `plain`"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    columns = [c.strip() for c in header.strip("|").split("|")]
    assert cells[columns.index("DeepSeek-V2-Lite, uniform, whole model, H100")] == "23,862 / 228.5"
    assert cells[columns.index("DeepSeek-V2-Lite, uniform, 24 GB, H100")] == "26,000 / 90.0"
