"""The offload engine over several accelerators (`engine.shards`): every policy, with pools that evict, that
double-buffer and that hold every expert, gives the plain model's logits and greedy tokens (float32, 1e-4) with
each accelerator holding an equal share of every layer's experts: two accelerators on the suite's two CPU devices
(the second stands in on the CPU backend's own), four in a child process with five CPU devices; the families,
quantized experts, chunked batched prefill, continuous batching, shares placed by a hot table, `load` and the
bench CLI's checks."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import pdscope_jax
from offload_reference import POLICIES, check, compare
from pdscope_jax.cli import bench as bench_cli
from pdscope_jax.engine.batching import OffloadBatcher
from pdscope_jax.engine.shards import owners
from pdscope_jax.errors import InputError
from pdscope_jax.generation.sampling import SamplingParams
from pdscope_jax.sched.hot import write_layer_stats

HERE = os.path.dirname(os.path.abspath(__file__))
DEADLINE_S = 300
MODEL = "tiny-deepseek-v2-lite"
CASES = [("gpu", "all")] + [(policy, pool) for policy in POLICIES[1:] for pool in ("small", "double")]
# the other families: every policy once, over a pool that evicts (`gpu`: one that holds every expert)
FAMILY_CASES = [("gpu", "all")] + [(policy, "small") for policy in POLICIES[1:]]
OTHER_FAMILIES = ("tiny-qwen3-30b-a3b", "tiny-mixtral-8x7b", "tiny-moonlight-16b-a3b")
FOUR_CASES = [("gpu", "all"), ("pdscope", "small"), ("ondemand", "double")]

FOUR_ACCELERATORS = r"""
import json, sys
import jax
jax.config.update("jax_num_cpu_devices", 5)
sys.path.insert(0, sys.argv[1])
from offload_reference import compare
cases = json.loads(sys.argv[2])
print("RESULT " + json.dumps({name: compare(name, 4, [tuple(c) for c in cases[name]]) for name in cases}),
      flush=True)
"""


@pytest.fixture(scope="module")
def two():
    return {(r["policy"], r["pool"]): r for r in compare(MODEL, 2, CASES)}


@pytest.mark.parametrize("policy, pool", CASES)
def test_every_policy_over_two_accelerators_matches_plain_model(two, policy, pool):
    check(two[(policy, pool)], 2, 8)


def test_every_accelerator_copies_over_its_own_link(two):
    """With a pool that evicts, each accelerator loads experts of its own share from its own host copies."""
    assert all(moved > 0 for moved in two[("ondemand", "small")]["bytes_moved"])


def test_pdscope_evens_its_plans_out_across_accelerators_and_baselines_plan_alone(two):
    assert two[("pdscope", "small")]["accelerator_moves"] > 0  # sched.across moved experts between CPU and GPU
    assert all(r["accelerator_moves"] == 0 for (policy, _), r in two.items() if policy != "pdscope")


@pytest.mark.parametrize("name", OTHER_FAMILIES)
def test_every_policy_of_every_family_over_two_accelerators(name):
    from pdscope_jax.presets import preset

    found = compare(name, 2, FAMILY_CASES)
    assert [(r["policy"], r["pool"]) for r in found] == FAMILY_CASES
    for result in found:
        check(result, 2, preset(name).num_experts)


def test_quantized_experts_over_two_accelerators():
    for result in compare(MODEL, 2, [("pdscope", "small"), ("ondemand", "double")], quant="int8"):
        check(result, 2, 8)


def test_chunked_batched_prefill_over_two_accelerators():
    for result in compare(MODEL, 2, [("pdscope", "double"), ("greedy", "small")], batch=2, prompt=12, new=4,
                          prefill_chunk=8):
        check(result, 2, 8)


def test_four_accelerators_every_policy_and_every_family():
    """Over four accelerators: on the main model a pool of every expert, one that evicts (`pdscope`) and one that
    double-buffers (`ondemand`); each other family with `pdscope` over a pool that evicts. Every policy and pool of
    every family runs over two accelerators above: what four add is the split of each layer, alike for all."""
    cases = {MODEL: FOUR_CASES, **{name: [("pdscope", "small")] for name in OTHER_FAMILIES}}
    proc = subprocess.run([sys.executable, "-c", FOUR_ACCELERATORS, HERE, json.dumps(cases)], capture_output=True,
                          text=True, timeout=DEADLINE_S, env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))[7:])
    assert sorted(results) == sorted(cases)
    from pdscope_jax.presets import preset

    for name, found in results.items():
        assert [(r["policy"], r["pool"]) for r in found] == [tuple(c) for c in cases[name]]
        for result in found:
            check(result, 4, preset(name).num_experts)


def test_without_counts_each_accelerator_owns_a_block_of_ids():
    owned = owners(8, 4, (1, 2))
    for layer in (1, 2):
        np.testing.assert_array_equal(owned[layer], np.arange(8).reshape(4, 2))


def test_a_hot_table_evens_out_each_layers_traffic_over_the_accelerators():
    counts = {1: np.array([90, 80, 70, 60, 4, 3, 2, 1]), 2: np.array([1, 1, 1, 1, 1, 1, 1, 50])}
    owned = owners(8, 2, (1, 2), counts)
    np.testing.assert_array_equal(owned[1], [[0, 3, 4, 7], [1, 2, 5, 6]])  # 90+60+4+1 = 155 vs 80+70+3+2 = 155
    assert sorted(np.concatenate(owned[2]).tolist()) == list(range(8))  # a partition of the layer
    assert all(len(share) == 4 for share in owned[2])  # equal shares, whatever the counts
    # by id, accelerator 0 would carry 300 of layer 1's 310 counted tokens
    assert [counts[1][share].sum() for share in owned[1]] == [155, 155]


def test_a_hot_table_of_another_model_is_named():
    with pytest.raises(ValueError, match="layer 1 3 expert counts, the model has 8 experts"):
        owners(8, 2, (1,), {1: np.ones(3)})


def test_shares_placed_by_a_hot_table_match_plain_model(tmp_path):
    layers = (1, 2, 3)  # tiny-deepseek-v2-lite's MoE layers: the first layer is dense
    counts = {phase: {layer: np.array([9, 8, 7, 6, 1, 1, 1, 1]) for layer in layers} for phase in ("prefill",)}
    path = write_layer_stats(tmp_path / "layer_stats.json", layers, counts)
    for result in compare(MODEL, 2, [("pdscope", "small"), ("static", "double")], hot_table=str(path)):
        check(result, 2, 8)
        # 9+6+1+1 = 17 vs 8+7+1+1 = 17 counted tokens; by id it would be 30 vs 4
        assert result["owned"] == {layer: [[0, 3, 4, 6], [1, 2, 5, 7]] for layer in layers}


def test_load_runs_a_policy_over_two_accelerators():
    runner = pdscope_jax.load(MODEL, dtype="float32", compile_cache=False, policy="pdscope", accelerators=2,
                              gpu_memory="1GB", max_seq_len=64)
    plain = pdscope_jax.load(MODEL, dtype="float32", compile_cache=False)
    ids = np.array([[5, 6, 7, 8]], np.int32)
    np.testing.assert_array_equal(runner.generate(ids, 4).tokens, plain.generate(ids, 4).tokens)
    assert runner.engine.stats["accelerators"] == 2


def test_continuous_batching_over_two_accelerators_gives_each_request_its_tokens_alone():
    runner = pdscope_jax.load(MODEL, dtype="float32", compile_cache=False, policy="pdscope", accelerators=2,
                              gpu_memory="1GB", expert_pool="40KB", max_seq_len=64, max_batch=2)
    plain = pdscope_jax.load(MODEL, dtype="float32", compile_cache=False)
    rng = np.random.default_rng(1)
    prompts, new = [rng.integers(0, runner.config.vocab_size, n) for n in (5, 13, 3)], [6, 3, 5]
    alone = [plain.generate([p], max_new_tokens=n).tokens[0].tolist() for p, n in zip(prompts, new)]
    batcher = OffloadBatcher(runner.engine, chunk=8)
    got, of_slot, waiting = {}, {}, [0, 1, 2]
    while waiting or batcher.active:
        if waiting and batcher.free_slots:
            i = waiting.pop(0)
            of_slot[batcher.admit(prompts[i], SamplingParams(), new[i])] = i
            got[i] = []
        for emitted in batcher.step():
            got[of_slot[emitted.slot]].append(emitted.token)
    assert [got[i] for i in range(3)] == alone


def test_serve_refuses_accelerators_without_a_policy():
    from pdscope_jax.cli import serve as serve_cli

    with pytest.raises(InputError, match="--accelerators splits the offload engine's experts: give a --policy"):
        serve_cli.main([MODEL, "--accelerators", "2"])
    with pytest.raises(InputError, match=r"accelerators=3, but this process sees 2 device\(s\)"):
        serve_cli.main([MODEL, "--policy", "pdscope", "--accelerators", "3"])


def test_bench_names_accelerators_that_do_not_split_the_experts(tmp_path):
    args = bench_cli.parse_args(["--model", MODEL, "--accelerators", "3", "--out", str(tmp_path)])
    with pytest.raises(InputError, match=r"--accelerators: E=8 routed experts .* N=3 .*use N in \[1, 2, 4, 8\]"):
        bench_cli.check_args(args)
