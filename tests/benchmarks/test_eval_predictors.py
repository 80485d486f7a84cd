"""benchmarks/eval_predictors.py and benchmarks/finetune_experiment.py end to end on a tiny random model."""

import json

import numpy as np
import pytest

import pdscope_jax
from pdscope_jax.phaseper.checkpoint import load_predictors, save_predictors
from pdscope_jax.phaseper.collect import collect_traces, moe_layers
from pdscope_jax.phaseper.predictor import PredictorHParams, PredictorSet
from pdscope_jax.phaseper.traces import TraceWriter, load_traces
from script_import import BENCHMARKS, import_script

MODEL = "tiny-deepseek-v2-lite"
B, T, STEPS = 2, 12, 3


def _script(name):
    return import_script(BENCHMARKS / f"{name}.py")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """Traces of the tiny model (random weights, seed 0: what `load(MODEL)` gives) and an untrained checkpoint."""
    root = tmp_path_factory.mktemp("eval")
    runner = pdscope_jax.load(MODEL, weights="random", dtype="float32")
    model, cfg = runner.model, runner.config
    prompts = np.random.default_rng(0).integers(0, cfg.vocab_size, (2 * B, T)).astype(np.int32)
    with TraceWriter(root / "traces", cfg.fingerprint(), moe_layers(model), cfg.hidden_size, cfg.num_experts_per_tok,
                     cfg.num_experts, description="tiny smoke") as writer:
        collect_traces(model, prompts, writer, STEPS, batch_size=B)
    pset = PredictorSet(PredictorHParams(cfg.hidden_size, cfg.num_experts_per_tok, cfg.num_experts, 8, 16),
                        moe_layers(model), (1, 2))
    ckpt = save_predictors(pset, cfg, root / "predictors", corpus="tiny smoke")
    return root, ckpt, load_traces(root / "traces")


def test_eval_predictors_reports_every_group_phase_and_baseline(setup):
    root, ckpt, traces = setup
    ev = _script("eval_predictors")
    out_json, out_png = root / "p.json", root / "p.png"
    assert ev.main(["--model", MODEL, "--predictors", str(ckpt), "--train-traces", str(traces.dir),
                    "--eval", f"heldout={traces.dir}", "--eval", f"ood={traces.dir}", "--out-json", str(out_json),
                    "--out-png", str(out_png), "--latency-reps", "3"]) == 0
    report = json.loads(out_json.read_text())
    assert report["command"].startswith("python benchmarks/eval_predictors.py --model")
    for name in ("heldout", "ood"):
        for phase in ("prefill", "decode"):
            groups = report["results"][name][phase]["groups"]
            want = {"phaseper", "fate_topk", "fate_probsum", "frequency"} | ({"prev_token"} if phase == "decode"
                                                                             else set())
            assert set(groups) == {"input", "middle"}  # the output group holds only the last MoE layer
            for g in groups:
                assert set(groups[g]) - {"layers"} == want
                for m in want:
                    assert 0.0 <= groups[g][m]["recall_at_k"] <= 1.0 and 0.0 <= groups[g][m]["table5"] <= 1.0
    # Same traces as held-out and OOD: no drop at all; the in-domain and out-of-domain targets apply to each
    acc = report["acceptance"]
    assert report["ood_drop_points"]["ood"]["prefill_table5"] == pytest.approx(0.0)
    assert acc["heldout_prefill_table5"]["target"] == ">= 0.95" and acc["ood_prefill_table5"]["target"] == ">= 0.85"
    assert acc["ood_decode_recall_at_k"]["groups"].keys() == {"input", "middle"}
    assert report["text_near_duplicates_removed"] == {"heldout": None, "ood": None}  # not cut from the corpus
    latency = report["latency"]["cpu:0"]  # per network kind, for one token and one prompt of T tokens
    assert {k for k in latency if k.endswith("_tokens")} == {f"{kind}_{n}_tokens" for kind in ("shallow", "deep")
                                                               for n in (1, T)}
    assert all(v["p90_ms"] >= v["median_ms"] for k, v in latency.items() if k.endswith("_tokens"))
    assert report["weights"] == "random"
    assert report["predictors"]["checkpoint_bytes_on_disk"] > 0 and report["predictors"]["param_bytes_total"] > 0
    assert out_png.stat().st_size > 0


def test_baselines_are_aligned_with_the_traces(setup):
    root, _, traces = setup
    ev = _script("eval_predictors")
    gates = ev.Gates(MODEL)
    assert ev.step_layout(traces) == (B, T, STEPS)
    # The gate of a layer applied to that layer's own input reproduces its recorded choice exactly, so the
    # Fate baselines (gate of l+1 on the input of l) use the right routers.
    for layer in traces.layers:
        d = traces.layer("prefill", layer)
        top = np.argsort(-gates.probs(layer, d["a"]), axis=1)[:, :traces.k]
        assert (np.sort(top, axis=1) == np.sort(d["e"], axis=1)).all()
        assert (np.sort(gates.picks(layer, d["a"], chunk=5), axis=1) == np.sort(d["e"], axis=1)).all()
    # Previous-token reuse: decode step 0 reuses the last prompt token, later steps the same sequence's token.
    nxt = traces.layers[1]
    n = len(traces.pairs("decode", traces.layers[0]))
    freq = np.full(traces.num_experts, 1.0 / traces.num_experts)
    scores = ev.prev_token_scores(traces, nxt, n, freq)
    top = np.sort(np.argsort(-scores, axis=1)[:, :traces.k], axis=1)
    pre, dec = traces.layer("prefill", nxt)["e"], traces.layer("decode", nxt)["e"]
    assert (top[1] == np.sort(pre[1 * T + T - 1])).all()  # batch 0, sequence 1, first decode step
    assert (top[B + 1] == np.sort(dec[1])).all()  # batch 0, sequence 1, second decode step
    assert (top[STEPS * B] == np.sort(pre[B * T + T - 1])).all()  # batch 1, sequence 0, first decode step
    assert ev.request_steps(traces, "prefill", 2 * B * T).tolist() == [T] * (2 * B)


def test_finetune_experiment_records_triggers_and_token_path(setup):
    root, ckpt, _ = setup
    ft = _script("finetune_experiment")
    out_json, out_png = root / "f.json", root / "f.png"
    assert ft.main(["--model", MODEL, "--predictors", str(ckpt), "--before", "1", "--after", "2",
                    "--prompt-len", "8", "--decode-steps", "3", "--threshold", "0.0", "--steps", "1",
                    "--out-json", str(out_json), "--out-png", str(out_png)]) == 0
    report = json.loads(out_json.read_text())
    fin = report["finetune"]
    assert fin["triggers"] >= 1 and fin["finetunes"] >= 1 and fin["finetune_seconds"] > 0
    tp = report["token_path"]
    assert tp["observe"]["n"] == 3 * (1 + 3) * 2  # requests x forwards x source layers
    assert tp["decode_step"]["n"] == 3 * 3
    assert len(report["per_request"]) == 3 and report["per_request"][-1]["domain"] == "ood"
    for arm in ("tuned", "frozen"):
        values = report["recall_at_k_all_layers"][arm]
        measured = [v for v in values.values() if v is not None]
        assert measured and all(0.0 <= v <= 1.0 for v in measured), values
    assert out_png.stat().st_size > 0


def test_fair_fate_ranks_a_step_by_picks_then_by_probability(monkeypatch):
    ev = _script("eval_predictors")
    probs = np.array([[0.5, 0.3, 0.2], [0.1, 0.45, 0.45], [0.05, 0.55, 0.4]])  # [N=3, E=3], top-1 picks
    summed = ev.topk_counts(np.array([[0], [1], [1]]), probs).sum(axis=0)
    assert np.argsort(-summed).tolist() == [1, 0, 2]  # by picks (2, 1, 0), whatever the summed probability
    assert np.argsort(-ev.topk_counts(np.array([[0], [2], [1]]), probs).sum(axis=0)).tolist() == [1, 2, 0]  # ties
    # the near-duplicates of a collected set are read back from its description
    seen = []
    monkeypatch.setattr(ev.corpus, "load_corpus", lambda seed, ood_source: seen.append((seed, ood_source)) or
                        type("C", (), {"dedup": {"ood": type("D", (), {"to_json": lambda self: {"removed": 1}})()}}))
    assert ev.text_dedup("m (float32), split ood (cjk), 64 prompts x 256 tokens, batch 16, seed 3") == {"removed": 1}
    assert seen == [(3, "cjk")] and ev.text_dedup("split train (stdlib), seed 0") is None


def test_ceiling_views_cut_whole_prompts_and_score_on_them(setup):
    root, ckpt, traces = setup
    ceiling = _script("predictor_ceiling")
    val = ceiling.PromptView(traces, B, 2 * B)  # the second batch of prompts
    layer = traces.layers[0]
    pre, dec = val.pairs("prefill", layer), val.pairs("decode", layer)
    np.testing.assert_array_equal(pre.a, traces.pairs("prefill", layer).a[B * T:])
    np.testing.assert_array_equal(dec.e_next, traces.pairs("decode", layer).e_next[B * STEPS:])
    assert pre.steps.tolist() == [T] * B and dec.steps.tolist() == [B] * STEPS  # prompts; collected decode steps
    with pytest.raises(ValueError, match="whole batches"):
        ceiling.PromptView(traces, 1, 2 * B)
    gates = _script("eval_predictors").Gates(MODEL)
    pset, _ = load_predictors(ckpt, gates.cfg)
    scores = ceiling.score(pset, gates, ceiling.PromptView(traces, 0, B), val, ("decode",))
    assert set(scores["decode"]["all"]) == {"phaseper", "fate_topk", "frequency"}
