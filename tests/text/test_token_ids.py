"""Token ids are checked on the values given, before the int32 cast: no id silently becomes another."""

import numpy as np
import pytest

from pdscope_jax.errors import InputError
from pdscope_jax.text.tokenizer import token_batch


def test_an_id_past_int32_is_refused_not_wrapped():
    with pytest.raises(InputError, match=r"token ids must lie in \[0, 256\); got 1\.\.4294967299"):
        token_batch([[1, 3 + 2**32]], None, 256)
    with pytest.raises(InputError, match=r"\[0, 2147483648\)"):  # without a vocabulary: the cast's range
        token_batch(np.array([[3 + 2**32]], np.int64), None)
    with pytest.raises(InputError, match="must lie in"):
        token_batch(np.array([[2**63]], np.uint64), None, 256)


def test_empty_batches_and_non_integer_ids_are_refused():
    for bad in (np.zeros((0, 4), np.int32), np.zeros((2, 0), np.int32), []):
        with pytest.raises(InputError, match="at least one sequence of at least one token"):
            token_batch(bad, None, 256)
    for bad in ([[1.0, 2.0]], [[True]], [["a", 1]]):
        with pytest.raises(InputError):
            token_batch(bad, None, 256)
    np.testing.assert_array_equal(token_batch(np.array([[1, 255]], np.uint64), None, 256), [[1, 255]])
