"""engine.smallest: the r smallest entries in one reduction, exactly as lax.top_k(-values, r) picks them."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pdscope_jax.engine.smallest import smallest

PROTECTED = np.iinfo(np.int32).max


def _top_k(values, r):
    return np.asarray(jax.lax.top_k(-jnp.asarray(values), r)[1])


@pytest.mark.parametrize("size", [1, 7, 64, 800, 4799])
@pytest.mark.parametrize("r", [1, 2, 4, 5])
def test_equals_top_k_with_ties_free_and_protected_slots(size, r):
    if r > size:
        pytest.skip("r beyond the vector")
    rng = np.random.default_rng(size * 10 + r)
    pick = jax.jit(smallest, static_argnums=1)
    for trial in range(6):
        values = rng.integers(-1, max(2, size // 3), size).astype(np.int32)  # about three slots a value: ties
        if trial % 2:
            values[rng.random(size) < 0.5] = PROTECTED  # a layer's hits, never a victim while others remain
        if trial == 5:
            values[:] = PROTECTED  # nothing but protected slots: the lowest indices, as top_k gives
        np.testing.assert_array_equal(np.asarray(pick(jnp.asarray(values), r)), _top_k(values, r))


def test_extremes_of_int32():  # the lowest value whose negation top_k can take
    values = np.array([PROTECTED, np.iinfo(np.int32).min + 1, 0, PROTECTED, -5], np.int32)
    np.testing.assert_array_equal(np.asarray(smallest(jnp.asarray(values), 5)), _top_k(values, 5))


def test_rejects_r_outside_the_vector():
    with pytest.raises(ValueError, match="must lie in 1..3"):
        smallest(jnp.zeros(3, jnp.int32), 4)
