"""The bench command's runs and options come from the policy registry: defaults, choices, help, the ablation
sequence, host-planned decode, which planners take `--hot-per-layer` and what a point records (no model is built)."""

from types import SimpleNamespace

import numpy as np
import pytest

from pdscope_jax.bench.runs import (ABLATION, AHEAD, HOST_DECODE, NO_BANK, NO_CPU, NO_TRIAL, PROGRAM_COPIES, WITH_CPU,
                                    ZERO_COPY, build_quality, engine_switches, plan_runs, planner_options,
                                    split_label)
from pdscope_jax.cli.bench import parse_args
from pdscope_jax.sched import COMPARED, PLAIN, POLICIES, planner_class


def test_policy_defaults_choices_and_help_come_from_the_registry(capsys):
    assert parse_args([]).policies == [*COMPARED, PLAIN]
    every = [*POLICIES, *(f"{name}{HOST_DECODE}" for name in POLICIES), PLAIN]
    assert parse_args(["--policies", *every]).policies == every
    with pytest.raises(SystemExit):
        parse_args(["--help"])
    text = capsys.readouterr().out
    for name, policy in POLICIES.items():
        assert f"{name}: {policy.description[:30]}" in " ".join(text.split())


def test_runs_for_policies_host_decode_and_plain():
    args = parse_args(["--policies", "ondemand", f"pdscope{HOST_DECODE}", f"pdscope{NO_BANK}", PLAIN,
                       "--hot-table", "t.json"])
    runs = plan_runs(args)
    assert [(r["label"], r["policy"]) for r in runs] == [("ondemand", "ondemand"), (f"pdscope{HOST_DECODE}", "pdscope"),
                                                          (f"pdscope{NO_BANK}", "pdscope"), (PLAIN, PLAIN)]
    assert [(r["device_decode"], r["decode_bank"]) for r in runs[:3]] == [(True, True), (False, True), (True, False)]
    assert engine_switches(runs[0], "t.json") == {"hot_table": "t.json", "async_io": True, "batched_gpu": True,
                                                  "device_decode": True, "decode_bank": True,
                                                  "decode_bank_pieces": False, "decode_cpu_experts": "auto",
                                                  "decode_copy_share": None,
                                                  "decode_bridge_copies": True, "decode_zero_copy": None,
                                                  "decode_copies_ahead": False, "decode_chunk": None,
                                                  "decode_trial": 8, "quality": None, "mixed_threshold": 1.0}
    assert engine_switches(plan_runs(parse_args(["--policies", f"pdscope{NO_TRIAL}"]))[0], None)["decode_trial"] == 0
    no_table = plan_runs(parse_args(["--policies", "ondemand"]))[0]
    assert engine_switches(no_table, "t.json")["hot_table"] is None


def test_suffixes_combine_and_unknown_ones_are_named():
    run = plan_runs(parse_args(["--policies", f"pdscope{NO_BANK}{NO_CPU}", f"static{WITH_CPU}:copy=0.25",
                                f"fate{PROGRAM_COPIES}", f"pdscope{AHEAD}", f"ondemand{ZERO_COPY}{PROGRAM_COPIES}",
                                "ondemand:nozerocopy"]))
    switches = [engine_switches(r, None) for r in run]
    assert [(s["decode_bank"], s["decode_cpu_experts"], s["decode_copy_share"], s["decode_bridge_copies"],
             s["decode_copies_ahead"], s["decode_zero_copy"]) for s in switches] == [
        (False, "off", None, True, False, None), (True, "auto", 0.25, True, False, None),
        (True, "auto", None, False, False, None), (True, "auto", None, True, True, None),
        (True, "auto", None, False, False, True), (True, "auto", None, True, False, False)]
    assert split_label("ondemand") == ("ondemand", {})
    assert [engine_switches(r, None)["decode_bank_pieces"] for r in plan_runs(parse_args(
        ["--policies", "pdscope:bankpieces", "pdscope"]))] == [True, False]
    assert split_label("pdscope:chunk=32") == ("pdscope", {"decode_chunk": 32})
    for bad, named in (("pdscope:fast", "':fast'"), ("pdscope:copy=2", ":copy=F"), ("pdscope:copy=x", ":copy=F"),
                       ("pdscope:chunk=0", ":chunk=N"), ("pdscope:chunk=x", ":chunk=N"),
                       ("pdscope:quality=int2", ":quality=Q")):
        with pytest.raises(ValueError, match=named):
            split_label(bad)


def test_quality_per_run_and_the_quality_the_runner_keeps_copies_for():
    args = parse_args(["--policies", "pdscope:quality=int8", "pdscope:quality=mixed", "--quantize", "int8",
                       "--mixed-threshold", "0.5"])
    runs = plan_runs(args)
    assert [(engine_switches(r, None)["quality"], engine_switches(r, None)["mixed_threshold"]) for r in runs] == [
        ("int8", 0.5), ("mixed", 0.5)]
    assert build_quality(args, runs) == "mixed"  # the int4 copies exist for the mixed run
    assert build_quality(parse_args(["--quantize", "int8"]), runs[:1]) is None


def test_ablation_runs_in_order_then_plain():
    runs = plan_runs(parse_args(["--ablation", "--policies", "ondemand"]))
    assert [r["label"] for r in runs] == [label for label, *_ in ABLATION] + [PLAIN]
    assert [engine_switches(r, "t.json")["hot_table"] for r in runs[:-1]] == [None] + ["t.json"] * 4
    assert all(planner_class(r["policy"]) for r in runs[:-1])


def test_hot_per_layer_goes_to_planners_with_a_fixed_hot_set():
    runner = SimpleNamespace(pool=SimpleNamespace(num_slots=12, can_double_buffer=True),
                             config=SimpleNamespace(num_experts=4))
    given = {name for name in POLICIES if planner_options(runner, name, 2) == {"hot_per_layer": 2}}
    fixed = {name for name in POLICIES if planner_class(name).hot_slots(12, 4, True, False) is not None}
    assert given == fixed == {"static"}
    assert all(planner_options(runner, name, None) == {} for name in POLICIES)


def test_a_point_records_the_allocator_peak_before_and_after_its_warm_ups():
    """The allocator's peak is the process's so far: the row keeps it before and after the warm-ups, so a timed
    run's peak can be told from what compiling and the trials held. None where the device reports none."""
    from pdscope_jax.bench.runs import PHASE_KEYS, time_point
    from pdscope_jax.runtime import allocator_peak

    memory = {"peak_bytes_in_use": 100}
    phase = {key: 1.0 for key in PHASE_KEYS}

    class Runner:
        devices = SimpleNamespace(accel=SimpleNamespace(memory_stats=lambda: dict(memory)))
        compiled_programs = {"total": 3}
        stats = {"prefill": phase, "decode": phase, "compiled_programs": {"total": 3}}

        def warmup(self, *shape):
            memory["peak_bytes_in_use"] = 250  # compiling and the decode trial held more

        def reset_stats(self):
            pass

        def generate(self, prompt, new_tokens):
            memory["peak_bytes_in_use"] = 260
            return SimpleNamespace(tokens=prompt, prefill_tokens_per_s=10.0, decode_tokens_per_s=2.0)

    args = SimpleNamespace(warmup=1, repeats=2, new_tokens=4)
    row = time_point(Runner(), {"policy": "static", "label": "static"}, {}, np.zeros((1, 8)), args, {}, lambda: None)
    assert (row["device_peak_before_warmup"], row["device_peak_after_warmup"]) == (100, 250)
    assert row["decode_tok_s"] == 2.0 and len(row["repeats"]) == 2
    assert allocator_peak(Runner.devices.accel, 300) == 300 and allocator_peak(Runner.devices.accel, None) == 260
    assert allocator_peak(SimpleNamespace(memory_stats=lambda: None), 7) == 7


def test_a_point_records_the_decode_trial_and_the_host_split_of_its_batch():
    """The row keeps what warm-up's trial chose and how device decode split the batch's misses between copies and
    the host (the engine's last repeat's stats); None where the engine decided neither for that batch."""
    from pdscope_jax.bench.runs import PHASE_KEYS, summarise

    phase = {key: 1.0 for key in PHASE_KEYS}
    split = {"copy_share": 0.0, "host_ms": 0.12, "link_ms": 0.36}
    repeat = {"prefill_tok_s": 10.0, "decode_tok_s": 2.0, "prefill": phase, "decode": phase,
              "compiled_programs": {"total": 3}, "decode_trials": {"1": {"chosen": "device"}},
              "decode_host": {"bridges": {}, "why_not": "", "splits": {"1": split}}}
    row = summarise("pdscope", 8, [repeat], 3, variant="pdscope", batch=1, engine={})
    assert row["decode_trial_result"] == {"chosen": "device"} and row["decode_host_split"] == split
    row = summarise("pdscope", 8, [repeat], 3, variant="pdscope", batch=2, engine={})
    assert row["decode_trial_result"] is None and row["decode_host_split"] is None


def test_a_points_line_names_its_gpu_peak_against_the_budget():
    from pdscope_jax.bench.report import peak_note

    row = {"repeats": [{"device_peak_bytes": 9_000_000_000}, {"device_peak_bytes": 11_000_000_000}],
           "device_peak_after_warmup": 8_000_000_000}
    assert peak_note(row, 10_000_000_000) == (", GPU peak 11.00 GB of the 10.00 GB budget (after the warm-ups 8.00)"
                                              " [bold yellow]10.0% over the budget[/]")
    assert peak_note(row, 12_000_000_000).endswith("budget (after the warm-ups 8.00)")  # within: not flagged
    assert peak_note({"repeats": [{"device_peak_bytes": None}]}, 10) == ""  # the device reports no peak
