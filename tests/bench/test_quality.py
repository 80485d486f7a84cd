"""`pdscope-jax quality` (bench.quality): a tiny run's perplexity is the cross-entropy computed by hand from the
plain model's logits, the reference agrees with itself, the JSON holds its fields, and bad options exit 2 before
anything loads."""

import contextlib
import io
import json
import math

import numpy as np
import pytest

import pdscope_jax
from pdscope_jax.bench import quality
from pdscope_jax.cli import main as cli

MODEL = "tiny-deepseek-v2-lite"
# 3 windows in batches of 2: the last batch is padded
ARGS = dict(window=32, tokens=96, batch=2, prompts=2, prompt_len=8, new_tokens=6)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("quality") / "q.json"
    argv = ["quality", MODEL, "--dtype", "float32", "--quantize", "int4", "--out", str(out)]
    for key, value in ARGS.items():
        argv += [f"--{key.replace('_', '-')}", str(value)]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):  # rich's Console writes to sys.stdout as it is when it writes
        rc = cli.main(argv)
    return rc, json.loads(out.read_text()), printed.getvalue()


def test_reference_perplexity_is_the_cross_entropy_of_the_logits(run):
    rc, doc, _ = run
    assert rc == 0
    settings = quality.Settings(model=MODEL, dtype="float32", **ARGS)
    windows = quality.heldout_data(settings).windows
    assert windows.shape == (3, 32) and doc["windows"] == 3 and doc["tokens_scored"] == 3 * 31
    logits = pdscope_jax.load(MODEL, dtype="float32").logits(windows).astype(np.float64)
    losses = []
    for w, row in zip(windows, logits):
        for t in range(len(w) - 1):
            losses.append(math.log(sum(math.exp(v - row[t].max()) for v in row[t])) + row[t].max() - row[t][w[t + 1]])
    ref = doc["precisions"][0]
    assert ref["precision"] == "float32" and ref["quantize"] is None
    assert ref["nll"] == pytest.approx(sum(losses) / len(losses), rel=1e-5)
    assert ref["ppl"] == pytest.approx(math.exp(ref["nll"]), rel=1e-12)


def test_the_json_holds_every_field_and_the_reference_agrees_with_itself(run):
    _, doc, printed = run
    for key in ("what", "command", "commit", "machine", "model", "weights", "dtype", "window", "tokens", "seed",
                "prompts", "prompt_len", "new_tokens", "split", "encoding", "acceptance"):
        assert key in doc, key
    assert doc["command"].startswith("pdscope-jax quality tiny-deepseek-v2-lite --dtype float32")
    assert doc["weights"] == "random (seeded, seed 0)" and doc["encoding"] == "utf-8 bytes mod vocab"
    ref, q4 = doc["precisions"]
    assert (ref["agreement"], ref["first_divergence"], ref["delta_pct"]) == (1.0, ARGS["new_tokens"], 0.0)
    assert ref["pass"] is None and q4["quantize"] == "int4" and q4["target_pct"] == 3.0
    assert q4["pass"] == (q4["delta_pct"] <= 3.0)
    assert q4["delta_pct"] == pytest.approx(100 * (q4["ppl"] / ref["ppl"] - 1), rel=1e-9)
    assert 0.0 <= q4["agreement"] <= 1.0 and 0.0 <= q4["first_divergence"] <= ARGS["new_tokens"]
    # int4: K/2 bytes of integers + one float32 scale per 32 rows (K = 64 or 32), against 4-byte floats
    assert q4["expert_bytes"] < ref["expert_bytes"] / 6
    assert doc["acceptance"]["int4 ppl delta %"]["pass"] == q4["pass"]
    assert ("PASS" if q4["pass"] else "FAIL") in printed and "int4" in printed


def test_agreement_counts_equal_positions_and_the_first_difference():
    ref = np.array([[1, 2, 3, 4], [5, 6, 7, 8]])
    other = np.array([[1, 9, 3, 4], [5, 6, 7, 8]])  # row 0 differs at 1 only; row 1 never: counts 4
    assert quality.agreement(ref, other) == (7 / 8, (1 + 4) / 2)
    assert quality.agreement(ref, ref) == (1.0, 4.0)
    with pytest.raises(ValueError):
        quality.agreement(ref, ref[:, :3])


def test_bad_options_exit_2_naming_each_problem_before_loading(capsys, monkeypatch):
    import pdscope_jax.api

    monkeypatch.setattr(pdscope_jax.api, "load", lambda *a, **k: (_ for _ in ()).throw(AssertionError("loaded")))
    assert cli.main(["quality", "nosuch-model", "--tokens", "0", "--window", "1", "--dtype", "float16"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "4 problems" in err
    for text in ("--tokens must be an integer >= 1", "--window must be at least 2", "--dtype 'float16'",
                 "unknown model 'nosuch-model'"):
        assert text in err, text
    assert cli.main(["quality", MODEL, "--window", "64", "--tokens", "32"]) == 2
    assert "--tokens 32 is less than one --window of 64" in capsys.readouterr().err
    assert cli.main(["quality", MODEL, "--tokens", str(10**9), "--window", "512"]) == 2  # checked on the split
    assert "lower --tokens" in capsys.readouterr().err
