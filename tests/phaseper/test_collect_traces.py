import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from pdscope_jax import models
from pdscope_jax.api import Runner
from pdscope_jax.cli.collect_traces import collect_traces_main
from pdscope_jax.phaseper.collect import collect_traces, moe_layers, walk
from pdscope_jax.phaseper.traces import TraceWriter, load_traces
from pdscope_jax.presets import preset

B, T, STEPS = 2, 12, 3


def _model(name):
    return models.build(preset(name), nnx.Rngs(0), jnp.float32)


@functools.partial(jax.jit, static_argnames=("graphdef", "use_walk"))
def _run(state, ids, pos, *, graphdef, use_walk):
    model = nnx.merge(graphdef, state)
    return walk(model, ids, pos) if use_walk else model(ids, pos)[0]


def jwalk(model, ids, pos):
    """`walk` without cache, compiled (eager NNX on CPU dispatches op by op, which is slow)."""
    graphdef, state = nnx.split(model)
    return _run(state, ids, pos, graphdef=graphdef, use_walk=True)


def jlogits(model, ids, pos):
    graphdef, state = nnx.split(model)
    return _run(state, ids, pos, graphdef=graphdef, use_walk=False)


def _prompts(cfg, count):
    return np.random.default_rng(1).integers(0, cfg.vocab_size, (count, T)).astype(np.int32)


@pytest.fixture(scope="module")
def deepseek():
    return _model("tiny-deepseek-v2-lite")


def test_walk_is_the_model_forward(deepseek):
    model = deepseek
    cfg = model.config
    ids = jnp.asarray(_prompts(cfg, B))
    pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), ids.shape)
    out = jwalk(model, ids, pos)
    np.testing.assert_allclose(out.logits, jlogits(model, ids, pos), atol=1e-5)
    m = len(cfg.moe_layers)
    assert out.a.shape == (m, B * T, cfg.hidden_size) and out.cache is None
    assert out.weights.shape == out.experts.shape == (m, B * T, cfg.num_experts_per_tok)
    # `a` is what the router sees: routing it again gives the recorded choice.
    for pos_l, layer in enumerate(moe_layers(model)):
        w, e = model.layers[layer].mlp.route(out.a[pos_l])
        assert (np.asarray(e) == np.asarray(out.experts[pos_l])).all()
        np.testing.assert_allclose(w, out.weights[pos_l], atol=1e-6)


def test_collect_records_prefill_and_greedy_decode_apart(tmp_path, deepseek):
    model = deepseek
    cfg = model.config
    prompts = _prompts(cfg, 5)  # 2 batches of 2; the fifth prompt is dropped
    layers = moe_layers(model)
    with TraceWriter(tmp_path / "t", cfg.fingerprint(), layers, cfg.hidden_size, cfg.num_experts_per_tok,
                     cfg.num_experts, flush_tokens=16) as writer:
        stats = collect_traces(model, prompts, writer, STEPS, batch_size=B)
    traces = load_traces(tmp_path / "t")
    k, m = cfg.num_experts_per_tok, len(layers)

    # One causal forward over prompts + their greedy continuation (Runner.generate) routes every token as the
    # collector must have: prompt positions in prefill, continuation positions in decode.
    generated = Runner(model).generate(prompts[:4], max_new_tokens=STEPS).tokens  # [4, STEPS]
    seq = np.concatenate([prompts[:4], generated], axis=1)
    pos = jnp.broadcast_to(jnp.arange(T + STEPS, dtype=jnp.int32), seq.shape)
    full = jwalk(model, jnp.asarray(seq), pos)
    experts = np.asarray(full.experts).reshape(m, 4, T + STEPS, k)
    a = np.asarray(full.a).reshape(m, 4, T + STEPS, cfg.hidden_size)
    for i, layer in enumerate(layers):
        rec = traces.layer("prefill", layer)
        assert rec["e"].shape == (4 * T, k) and rec["steps"].tolist() == [B * T, B * T]
        assert (rec["e"] == experts[i, :, :T].reshape(-1, k)).all()
        np.testing.assert_allclose(rec["a"], a[i, :, :T].reshape(-1, cfg.hidden_size), rtol=2e-3, atol=2e-3)  # f16

        rec = traces.layer("decode", layer)
        assert rec["steps"].tolist() == [B] * (2 * STEPS)
        want = experts[i, :, T:]  # [4, STEPS, K]
        # records are ordered batch by batch, step by step, sequence by sequence
        got = rec["e"].reshape(2, STEPS, B, k).transpose(0, 2, 1, 3).reshape(4, STEPS, k)
        assert (got == want).all()

    pre, dec = stats.phases["prefill"], stats.phases["decode"]
    assert (pre.tokens, pre.forwards, dec.tokens, dec.forwards) == (4 * T, 2, 4 * STEPS, 2 * STEPS)
    assert pre.counts.shape == (m, cfg.num_experts) and (pre.counts.sum(1) == 4 * T * k).all()
    assert (dec.counts.sum(1) == 4 * STEPS * k).all()
    np.testing.assert_allclose(pre.mean_hidden()[0], a[0, :, :T].reshape(-1, cfg.hidden_size).mean(0),
                               rtol=1e-4, atol=1e-5)
    sim = pre.similarity()
    assert sim.shape == (m,) and sim[0] == sim[1] and (np.abs(sim) <= 1 + 1e-6).all()


def test_collect_rejects_mismatched_writer(tmp_path, deepseek):
    model = deepseek
    cfg = model.config
    writer = TraceWriter(tmp_path / "t", "fp", (1, 2), cfg.hidden_size, cfg.num_experts_per_tok, cfg.num_experts)
    with pytest.raises(ValueError, match="MoE layers"):
        collect_traces(model, _prompts(cfg, 2), writer, 1, batch_size=2)


def test_cli_writes_traces_and_layer_stats(tmp_path, capsys):
    out = tmp_path / "traces"
    assert collect_traces_main(["--model", "tiny-deepseek-v2-lite", "--out", str(out), "--prompts", "4",
                                "--prompt-len", "16", "--decode-steps", "2", "--batch", "2", "--dtype", "float32",
                                "--split", "heldout"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["prefill"] == {"tokens": 64, "forwards": 2} and summary["decode"] == {"tokens": 8, "forwards": 4}
    traces = load_traces(out)
    assert traces.tokens("prefill", 1) == 64 and traces.tokens("decode", 3) == 8
    assert "split heldout" in traces.description and "utf-8 bytes" in traces.description
    stats = json.loads((out / "layer_stats.json").read_text())
    assert stats["layers"] == [1, 2, 3]
    assert np.asarray(stats["phases"]["decode"]["expert_counts"]).sum() == 8 * 3 * 3
