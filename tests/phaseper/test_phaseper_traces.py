import json

import numpy as np
import pytest

from pdscope_jax.phaseper.traces import TraceError, TraceWriter, load_traces

LAYERS, D, K, E = (1, 2, 3), 8, 2, 6


def _step(rng, n):
    a = rng.normal(size=(n, D)).astype(np.float32)
    w = rng.random((n, K)).astype(np.float32)
    e = np.stack([rng.choice(E, K, replace=False) for _ in range(n)]).astype(np.int32)
    return a, w, e


def test_roundtrip_alignment_steps_and_counts(tmp_path):
    rng = np.random.default_rng(0)
    given = {}
    with TraceWriter(tmp_path / "t", "fp0", LAYERS, D, K, E, flush_tokens=5) as writer:
        for phase, sizes in (("prefill", [7, 3, 4]), ("decode", [1] * 6)):
            for n in sizes:
                for layer in LAYERS:
                    a, w, e = _step(rng, n)
                    writer.add(phase, layer, a, w, e)
                    given.setdefault((phase, layer), []).append((a, w, e))
    traces = load_traces(tmp_path / "t")
    assert traces.fingerprint == "fp0" and traces.layers == LAYERS
    for phase, total, steps in (("prefill", 14, [7, 3, 4]), ("decode", 6, [1] * 6)):
        for pos, layer in enumerate(LAYERS[:-1]):
            pairs = traces.pairs(phase, layer)
            cat = [np.concatenate([g[i] for g in given[(phase, layer)]]) for i in range(3)]
            nxt = np.concatenate([g[2] for g in given[(phase, LAYERS[pos + 1])]])
            assert len(pairs) == total and pairs.next_layer == LAYERS[pos + 1]
            assert pairs.a.dtype == np.float16
            np.testing.assert_array_equal(pairs.a, cat[0].astype(np.float16))
            np.testing.assert_array_equal(pairs.w, cat[1])
            np.testing.assert_array_equal(pairs.e, cat[2])
            np.testing.assert_array_equal(pairs.e_next, nxt)
            np.testing.assert_array_equal(pairs.steps, steps)
        counts = traces.layer(phase, 1)["counts"]
        first = given[(phase, 1)][0][2]
        np.testing.assert_array_equal(counts[0], np.bincount(first.reshape(-1), minlength=E))
    with pytest.raises(TraceError, match="last MoE layer"):
        traces.pairs("prefill", LAYERS[-1])


def test_memory_is_bounded_and_shards_are_visible_before_close(tmp_path):
    rng = np.random.default_rng(1)
    writer = TraceWriter(tmp_path / "t", "fp", LAYERS, D, K, E, flush_tokens=10)
    for _ in range(7):
        for layer in LAYERS:
            writer.add("prefill", layer, *_step(rng, 4))
            assert all(n < 10 for n in writer._buffered.values())
    manifest = json.loads((tmp_path / "t" / "manifest.json").read_text())
    assert manifest["complete"] is False
    assert [s["tokens"] for s in manifest["shards"]["prefill"]["1"]] == [12, 12]
    assert load_traces(tmp_path / "t").tokens("prefill", 1) == 24  # only complete shards are read
    writer.close()
    assert load_traces(tmp_path / "t").tokens("prefill", 1) == 28
    assert not list((tmp_path / "t").rglob(".*tmp*")), "temporary files left behind"


def test_token_budget_per_phase_keeps_alignment(tmp_path):
    rng = np.random.default_rng(2)
    kept = []
    with TraceWriter(tmp_path / "t", "fp", LAYERS, D, K, E, max_tokens={"prefill": 10, "decode": 3}) as writer:
        for _ in range(3):
            kept.append([writer.add("prefill", layer, *_step(rng, 4)) for layer in LAYERS])
        for _ in range(5):
            writer.add("decode", 2, *_step(rng, 1))
    assert kept == [[4, 4, 4], [4, 4, 4], [2, 2, 2]]
    traces = load_traces(tmp_path / "t")
    pairs = traces.pairs("prefill", 1)
    assert len(pairs) == 10 and list(pairs.steps) == [4, 4, 2]
    assert traces.tokens("decode", 2) == 3 and traces.tokens("decode", 1) == 0
    assert len(traces.pairs("decode", 1)) == 0


def test_shards_not_in_manifest_are_ignored(tmp_path):
    rng = np.random.default_rng(3)
    with TraceWriter(tmp_path / "t", "fp", LAYERS, D, K, E, flush_tokens=4) as writer:
        for layer in LAYERS:
            writer.add("prefill", layer, *_step(rng, 4))
    stray = tmp_path / "t" / "prefill" / "layer1"
    for field in ("a", "w", "e", "steps", "counts"):
        np.save(stray / f"{field}.000001.npy", np.load(stray / f"{field}.000000.npy"))
    assert load_traces(tmp_path / "t").tokens("prefill", 1) == 4


def test_rejects_bad_calls(tmp_path):
    rng = np.random.default_rng(4)
    writer = TraceWriter(tmp_path / "t", "fp", LAYERS, D, K, E)
    a, w, e = _step(rng, 3)
    with pytest.raises(TraceError, match="phase"):
        writer.add("train", 1, a, w, e)
    with pytest.raises(TraceError, match="layer 7"):
        writer.add("prefill", 7, a, w, e)
    with pytest.raises(TraceError, match="expected a"):
        writer.add("prefill", 1, a[:, :4], w, e)
    with pytest.raises(TraceError, match="expert ids"):
        writer.add("prefill", 1, a, w, e + E)
    writer.close()
    with pytest.raises(TraceError, match="already holds traces"):
        TraceWriter(tmp_path / "t", "fp", LAYERS, D, K, E)
    with pytest.raises(TraceError, match="no manifest"):
        load_traces(tmp_path)


def test_lazy_reading_is_bounded(tmp_path):
    rng = np.random.default_rng(5)
    layers = tuple(range(6))
    with TraceWriter(tmp_path / "t", "fp", layers, D, K, E, flush_tokens=4) as writer:
        for _ in range(3):
            for layer in layers:
                writer.add("prefill", layer, *_step(rng, 4))
    traces = load_traces(tmp_path / "t", cache_layers=2)
    for layer in layers[:-1]:
        assert len(traces.pairs("prefill", layer)) == 12
        assert len(traces._cache) <= 2
    head = traces.layer("prefill", 0, max_tokens=5)
    np.testing.assert_array_equal(head["e"], traces.layer("prefill", 0)["e"][:5])
    assert set(head) == {"a", "w", "e"} and len(head["a"]) == 5
