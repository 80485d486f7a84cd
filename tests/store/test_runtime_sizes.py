"""Runtime sizes: bytes or strings, finite and non-negative; every bad field named in one RuntimeConfigError."""

import math

import numpy as np
import pytest

from pdscope_jax.errors import InputError
from pdscope_jax.runtime import RuntimeConfig, RuntimeConfigError
from pdscope_jax.store.budget import BudgetError


@pytest.mark.parametrize("field, bad", [("expert_pool", math.nan), ("gpu_memory", math.nan),
                                        ("gpu_memory", math.inf), ("expert_pool", -math.inf)])
def test_nan_and_infinite_sizes_name_the_field(field, bad):
    with pytest.raises(RuntimeConfigError, match=f"{field}: a size must be a finite number of bytes"):
        RuntimeConfig(**{field: bad})


def test_numpy_numbers_are_sizes_and_integer_fields_must_be_integers():
    rc = RuntimeConfig(gpu_memory=np.int64(10**9), expert_pool=np.float64(4e6), max_batch=np.int32(2))
    assert (rc.gpu_memory, rc.expert_pool, rc.max_batch) == (10**9, 4 * 10**6, 2)
    for field, bad in (("max_batch", 1.5), ("max_seq_len", "128"), ("prefill_chunk", math.nan),
                       ("max_batch", True)):
        with pytest.raises(RuntimeConfigError, match=f"{field} must be a positive integer"):
            RuntimeConfig(**{field: bad})


def test_every_bad_field_is_named_at_once_and_is_an_input_error():
    with pytest.raises(RuntimeConfigError) as info:
        RuntimeConfig(gpu_memory="3QB", expert_pool=math.nan, max_batch=0)
    assert len(info.value.problems) == 3
    assert issubclass(RuntimeConfigError, InputError) and issubclass(BudgetError, InputError)
