"""The offloaded runner checks a call's arguments before its warm-up compiles anything."""

import math

import numpy as np
import pytest

import pdscope_jax
from pdscope_jax.errors import InputError


@pytest.fixture(scope="module")
def runner():
    return pdscope_jax.load("tiny-deepseek-v2-lite", dtype="float32", policy="ondemand", gpu_memory="1GB",
                            max_seq_len=64)


def test_an_empty_batch_is_an_input_error_not_a_division_by_zero(runner):
    with pytest.raises(InputError, match="at least one sequence"):
        runner.engine.logits(np.zeros((0, 4), np.int32))
    with pytest.raises(InputError, match="at least one sequence"):
        runner.logits(np.zeros((0, 4), np.int32))


def test_bad_arguments_fail_before_the_warm_up(runner, monkeypatch):
    monkeypatch.setattr(runner.engine, "warmup", lambda *a: pytest.fail("warm-up ran before the check"))
    with pytest.raises(InputError) as info:
        runner.generate(np.ones((2, 60), np.int32), max_new_tokens=10, temperature=math.nan, top_k=1000)
    text = str(info.value)
    for phrase in ("exceeds max_batch=1", "exceed max_seq_len=64", "temperature", "top_k"):
        assert phrase in text
    with pytest.raises(InputError, match="token ids must lie"):
        runner.generate([[1, 3 + 2**32]], max_new_tokens=2)
