"""The one sampler: settings are arrays (a new setting compiles nothing), each filter does what it says, rows are
independent of their batch, logprobs are the model's own."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pdscope_jax
from pdscope_jax.generation.sampling import SamplingParams, SamplingState, sample_jit, top_k_chunked

V = 32
LOGITS = jnp.asarray(np.random.default_rng(0).normal(size=(1, V)) * 3, jnp.float32)


def draw(params: SamplingParams, logits=LOGITS, prompt=((0,),), steps=range(64)):
    """Tokens drawn at each step from the same logits (the counts of earlier draws apply)."""
    state = SamplingState.create(params, [list(p) for p in prompt], V)
    out = []
    for step in steps:
        picked, state = sample_jit(logits, state, step)
        out.append(np.asarray(picked.token))
    return np.stack(out, axis=1)  # [B, steps]


def test_greedy_and_degenerate_filters_give_the_argmax():
    best = int(np.argmax(LOGITS[0]))
    for params in (SamplingParams(), SamplingParams(temperature=1.0, top_k=1),
                   SamplingParams(temperature=2.0, top_p=1e-6), SamplingParams(temperature=5.0, min_p=1.0)):
        assert set(draw(params, steps=range(16))[0]) == {best}, params


def test_filters_keep_only_their_set():
    order = np.argsort(-np.asarray(LOGITS[0]))
    probs = np.asarray(jax.nn.softmax(LOGITS[0]))
    assert set(draw(SamplingParams(temperature=1.0, top_k=3))[0]) <= set(order[:3])
    nucleus = order[: int(np.searchsorted(np.cumsum(probs[order]), 0.8)) + 1]
    assert set(draw(SamplingParams(temperature=1.0, top_p=0.8))[0]) <= set(nucleus)
    assert set(draw(SamplingParams(temperature=1.0, min_p=0.3))[0]) <= set(np.flatnonzero(probs >= 0.3 * probs.max()))
    wide = draw(SamplingParams(temperature=1.0), steps=range(200))[0]
    assert len(set(wide)) > 3  # without a filter the draw does spread


def test_penalties_steer_away_from_repeats():
    best = int(np.argmax(LOGITS[0]))
    # a huge repetition penalty on the prompt's tokens: the argmax, seen in the prompt, is never chosen
    assert best not in draw(SamplingParams(repetition_penalty=1e6), prompt=((best,),), steps=range(4))[0]
    # frequency/presence: greedy never repeats a token while unseen ones remain close enough
    tokens = draw(SamplingParams(presence_penalty=2.0, frequency_penalty=2.0), steps=range(6))[0]
    assert tokens[0] == best and len(set(tokens)) > 1


def test_seeds_and_rows_are_independent_of_the_batch():
    a = SamplingParams(temperature=1.0, seed=1)
    b = SamplingParams(temperature=0.7, top_k=5, seed=2)
    both = np.concatenate([LOGITS, LOGITS])
    state = SamplingState.create([a, b], [[0], [0]], V)
    rows = []
    for step in range(20):
        picked, state = sample_jit(both, state, step)
        rows.append(np.asarray(picked.token))
    rows = np.stack(rows, axis=1)
    np.testing.assert_array_equal(rows[0], draw(a, steps=range(20))[0])
    np.testing.assert_array_equal(rows[1], draw(b, steps=range(20))[0])
    assert not np.array_equal(draw(a, steps=range(20)), draw(SamplingParams(temperature=1.0, seed=3), steps=range(20)))


@pytest.mark.parametrize("rows", [[SamplingParams(), SamplingParams(presence_penalty=1.5)],
                                  [SamplingParams(), SamplingParams(temperature=0.7, top_k=5, seed=2)]])
def test_the_branching_sampler_gives_the_same_tokens(rows):
    """`branch=True` (chunk programs) skips the drawing only where every row is greedy: same tokens and logprobs
    as the select form, for an all-greedy batch (the skipping branch) and a mixed one (the drawing branch)."""
    from pdscope_jax.generation.sampling import sample

    both = jnp.concatenate([LOGITS, LOGITS[:, ::-1]])
    branching = jax.jit(lambda logits, state, step: sample(logits, state, step, branch=True))
    state = plain = SamplingState.create(rows, [[0], [0]], V)
    for step in range(12):
        picked, state = branching(both, state, step)
        want, plain = sample_jit(both, plain, step)
        np.testing.assert_array_equal(picked.token, want.token)
        np.testing.assert_array_equal(picked.top_logprobs, want.top_logprobs)
    assert "cond" in str(jax.make_jaxpr(lambda s: sample(both, s, 0, branch=True))(state))


def test_logprobs_are_the_model_distribution():
    state = SamplingState.create(SamplingParams(temperature=0.5, repetition_penalty=1.3), [[1]], V)
    picked, _ = sample_jit(LOGITS, state, 0)
    raw = np.asarray(jax.nn.log_softmax(LOGITS[0]))
    np.testing.assert_allclose(picked.logprob[0], raw[int(picked.token[0])], rtol=1e-6)
    np.testing.assert_array_equal(picked.top_ids[0], np.argsort(-raw)[: picked.top_ids.shape[1]])


@pytest.mark.parametrize("vocab", [2048, 2049, 5000, 151936])
def test_chunked_top_k_is_top_k_ties_included(vocab):
    """The two-stage top-k gives lax.top_k's values and indices: many ties, -inf entries, a vocabulary that is not a
    multiple of the chunk, one finite entry in the last place."""
    rng = np.random.default_rng(vocab)
    x = rng.integers(-4, 4, size=(3, vocab)).astype(np.float32)
    x[0, :100] = -np.inf
    x[1] = -np.inf
    x[1, -1] = 1.0
    for n in (1, 20):
        want = jax.lax.top_k(jnp.asarray(x), n)
        got = top_k_chunked(jnp.asarray(x), n, chunk=512)
        np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
        np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))


def test_new_settings_compile_nothing():
    """Counted twice: the jitted sampler's cache, and every backend compilation jax reports while a whole-model
    and an offloaded generate run under several settings."""
    settings = [dict(), dict(temperature=0.7), dict(temperature=1.3, top_k=5, seed=9),
                dict(temperature=0.9, top_p=0.5, min_p=0.1, presence_penalty=0.5, frequency_penalty=-0.5,
                     repetition_penalty=1.2, seed=4)]
    before = sample_jit._cache_size()
    for params in settings:
        draw(SamplingParams(**params), steps=range(2))
    assert sample_jit._cache_size() == max(before, 1)

    ids = np.arange(1, 7, dtype=np.int32)[None]
    plain = pdscope_jax.load("tiny-deepseek-v2-lite", dtype="float32")
    offloaded = pdscope_jax.load("tiny-deepseek-v2-lite", dtype="float32", policy="ondemand", gpu_memory="1GB",
                                 max_seq_len=64)
    plain.generate(ids, max_new_tokens=4)
    offloaded.generate(ids, max_new_tokens=4)
    compiled = offloaded.engine.compiled_programs["total"]
    compiles = []

    def listen(event, *_args, **_kwargs):
        if "backend_compile" in event:
            compiles.append(event)

    jax.monitoring.register_event_duration_secs_listener(listen)
    outputs = set()
    try:
        for params in settings:
            outputs.add(plain.generate(ids, max_new_tokens=4, **params).tokens.tobytes())
            offloaded.generate(ids, max_new_tokens=4, **params)
        assert compiles == [] and offloaded.engine.compiled_programs["total"] == compiled
        plain.generate(np.ones((3, 5), np.int32), max_new_tokens=2)  # a new shape does compile: the count works
        assert compiles
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    assert len(outputs) > 1  # the settings did change the answers


@pytest.mark.parametrize("bad, phrase", [
    (dict(top_p=0.0), "top_p must be"), (dict(min_p=1.5), "min_p must be"),
    (dict(presence_penalty=3.0), "presence_penalty must be"), (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(frequency_penalty=float("nan")), "frequency_penalty must be")])
def test_params_name_their_range(bad, phrase):
    problems = SamplingParams(**bad).problems(V)
    assert len(problems) == 1 and phrase in problems[0]
