"""Generation and the public API: greedy = argmax of full recompute, sampling, input checks, name resolution."""

import shutil
from pathlib import Path

import numpy as np
import pytest
import tokenizers

import pdscope_jax
from pdscope_jax.generation.generator import CHUNK_COMPILER_OPTIONS, GenerationResult, Generator
from pdscope_jax.presets import UnknownModelError
from pdscope_jax.text.tokenizer import token_batch

DATA = Path(__file__).parents[1] / "data"


@pytest.fixture(scope="module")
def v2():
    return pdscope_jax.load("tiny-deepseek-v2-lite", dtype="float32")


@pytest.fixture(scope="module")
def qwen():
    return pdscope_jax.load("tiny-qwen3-30b-a3b", dtype="float32", seed=1)


PROMPT = np.random.default_rng(0).integers(0, 256, (2, 6)).astype(np.int32)


@pytest.mark.parametrize("runner", ["v2", "qwen"])
def test_greedy_generate_equals_argmax_of_full_recompute(runner, request):
    runner = request.getfixturevalue(runner)
    out = runner.generate(PROMPT, max_new_tokens=8)
    assert out.tokens.shape == (2, 8) and out.tokens.dtype == np.int32
    # Causal: the full forward over prompt + generated tokens predicts each generated token at the step before.
    logits = runner.logits(np.concatenate([PROMPT, out.tokens], axis=1))
    np.testing.assert_array_equal(logits[:, PROMPT.shape[1] - 1:-1].argmax(-1), out.tokens)
    assert out.text is None


def test_rates_count_prompt_tokens_in_prefill_and_the_rest_in_decode():
    """Prefill covers B * prompt_len tokens and yields each sequence's first new token; decode the others."""
    out = GenerationResult.timed(np.zeros((2, 8), np.int32), prompt_len=6, prefill_seconds=0.5, decode_seconds=2.0)
    assert (out.prefill_seconds, out.decode_seconds) == (0.5, 2.0)
    assert out.prefill_tokens_per_s == pytest.approx(2 * 6 / 0.5)
    assert out.decode_tokens_per_s == pytest.approx(2 * 7 / 2.0)
    one = GenerationResult.timed(np.zeros((3, 1), np.int32), prompt_len=4, prefill_seconds=1.0, decode_seconds=0.0)
    assert one.decode_tokens_per_s == 0.0  # one new token: nothing decoded, and no division by a zero time


def test_sampling(v2):
    a = v2.generate(PROMPT, max_new_tokens=8, temperature=1.0, seed=3)
    b = v2.generate(PROMPT, max_new_tokens=8, temperature=1.0, seed=3)
    c = v2.generate(PROMPT, max_new_tokens=8, temperature=1.0, seed=4)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    assert not np.array_equal(a.tokens, c.tokens)
    greedy = v2.generate(PROMPT, max_new_tokens=8)
    top1 = v2.generate(PROMPT, max_new_tokens=8, temperature=1.0, top_k=1, seed=5)
    np.testing.assert_array_equal(top1.tokens, greedy.tokens)


def test_decode_in_chunks_gives_the_step_by_step_tokens(v2):
    """Four steps per program, the last program the rest (10 decode steps: 4 + 4 + 2): the same tokens as one step
    per program, greedy and sampled (the sampler's key follows the step counter across programs)."""
    assert v2._generator.decode_chunk == 1  # the CPU's default
    chunked = Generator(v2.model, decode_chunk=4)
    for settings in ({}, {"temperature": 1.0, "seed": 7, "top_p": 0.9}):
        out = chunked.generate(PROMPT, max_new_tokens=11, **settings)
        ref = v2.generate(PROMPT, max_new_tokens=11, **settings)
        assert out.tokens.shape == (2, 11)
        np.testing.assert_array_equal(out.tokens, ref.tokens)
    with pytest.raises(ValueError, match="decode_chunk"):
        Generator(v2.model, decode_chunk=0)


def test_chunk_programs_compiler_options_are_valid_xla_options():
    """XLA checks the options' names and values on every backend, so a mistake fails here, not first on a GPU."""
    import jax
    import jax.numpy as jnp

    compiled = jax.jit(lambda x: x + 1).lower(jnp.ones(2)).compile(compiler_options=CHUNK_COMPILER_OPTIONS)
    np.testing.assert_array_equal(compiled(jnp.ones(2)), [2.0, 2.0])


def test_input_checks(v2):
    with pytest.raises(ValueError, match="different lengths"):
        v2.generate([[1, 2, 3], [1, 2]], max_new_tokens=2)
    with pytest.raises(ValueError, match="tokenizer"):
        v2.generate("hello", max_new_tokens=2)
    with pytest.raises(ValueError, match="token ids must lie"):
        v2.logits([[1, v2.config.vocab_size]])
    with pytest.raises(ValueError, match="max_new_tokens"):
        v2.generate([[1, 2]], max_new_tokens=0)
    np.testing.assert_array_equal(token_batch([3, 4], None), [[3, 4]])


def test_bfloat16_default_runs():
    runner = pdscope_jax.load("tiny-mixtral-8x7b")
    assert runner.model.embed.embedding.dtype == np.dtype("bfloat16")
    logits = runner.logits([[1, 2, 3]])
    assert logits.dtype == np.float32 and np.isfinite(logits).all()
    assert runner.generate([[1, 2, 3]], max_new_tokens=3).tokens.shape == (1, 3)


def test_unknown_name_lists_known_names():
    with pytest.raises(UnknownModelError, match="tiny-mixtral-8x7b"):
        pdscope_jax.load("no-such-model")


def _word_tokenizer(path, vocab_size):
    vocab = {f"w{i}": i for i in range(vocab_size)}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.decoder = tokenizers.decoders.WordPiece()
    tok.save(str(path / "tokenizer.json"))


def test_checkpoint_from_hf_cache_with_text_prompt(tmp_path, monkeypatch):
    snapshot = tmp_path / "hub" / "models--acme--tiny-mixtral" / "snapshots" / "0123abc"
    shutil.copytree(DATA / "mixtral", snapshot)
    _word_tokenizer(snapshot, 96)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    runner = pdscope_jax.load("acme/tiny-mixtral", dtype="float32")
    ref = np.load(snapshot / "reference.npz")
    text = " ".join(f"w{i}" for i in ref["input_ids"][0])
    out = runner.generate(text, max_new_tokens=8)
    np.testing.assert_array_equal(out.tokens[0], ref["greedy_tokens"][0])
    assert out.text == [" ".join(f"w{i}" for i in ref["greedy_tokens"][0])]
    random = pdscope_jax.load("acme/tiny-mixtral", weights="random", dtype="float32")
    assert random.tokenizer is None and not np.allclose(random.logits(ref["input_ids"]), ref["logits"], atol=1e-2)
