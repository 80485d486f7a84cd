import math

import jax.numpy as jnp
import numpy as np
import pytest

from pdscope_jax.phaseper.losses import bce, expert_frequencies, expert_loss, focal_loss, phase_loss, targets

# One token, three experts, written out by hand.
Z = np.array([[2.0, -1.0, 0.5]], np.float32)
Y = np.array([[1.0, 0.0, 1.0]], np.float32)
F = np.array([0.5, 0.25, 1.0], np.float32)
GAMMA, LAM = 2.0, 0.5


def _hand():
    p = [1 / (1 + math.exp(-2.0)), 1 / (1 + math.exp(1.0)), 1 / (1 + math.exp(-0.5))]
    b = [-math.log(p[0]), -math.log(1 - p[1]), -math.log(p[2])]  # y = 1, 0, 1
    pt = [p[0], 1 - p[1], p[2]]
    l_expert = (b[0] / 0.5 + b[1] / 0.25 + b[2] / 1.0) / 3
    l_focal = sum((1 - pt[i]) ** GAMMA * b[i] for i in range(3)) / 3
    return b, l_expert, l_focal


def test_bce_matches_hand_computation():
    b, _, _ = _hand()
    np.testing.assert_allclose(np.asarray(bce(Z, Y))[0], b, rtol=1e-6)


def test_expert_and_focal_match_hand_computation():
    _, l_expert, l_focal = _hand()
    np.testing.assert_allclose(float(expert_loss(Z, Y, F)), l_expert, rtol=1e-6)
    np.testing.assert_allclose(float(focal_loss(Z, Y, GAMMA)), l_focal, rtol=1e-6)


@pytest.mark.parametrize("group", ["input", "output", "middle"])
@pytest.mark.parametrize("phase", ["prefill", "decode"])
def test_phase_and_group_dispatch(phase, group):
    b, l_expert, l_focal = _hand()
    want = {
        ("prefill", "input"): l_expert + LAM * l_focal,
        ("prefill", "output"): l_expert + LAM * l_focal,
        ("decode", "input"): l_focal,
        ("decode", "output"): l_focal,
    }.get((phase, group), sum(b) / 3)
    np.testing.assert_allclose(float(phase_loss(phase, group, Z, Y, F, LAM, GAMMA)), want, rtol=1e-6)


def test_mean_over_tokens_and_stability():
    z = jnp.array([[100.0, -100.0], [-100.0, 100.0]])
    y = jnp.array([[1.0, 0.0], [1.0, 0.0]])
    # token 0 is confidently right (loss ~0); token 1 confidently wrong: BCE = 100 on both experts.
    np.testing.assert_allclose(np.asarray(bce(z, y)), [[0, 0], [100, 100]], atol=1e-5)
    np.testing.assert_allclose(float(focal_loss(z, y, 2.0)), (0 + 100) / 2, rtol=1e-5)
    np.testing.assert_allclose(float(expert_loss(z, y, jnp.array([0.5, 0.25]))), (0 + (200 + 400) / 2) / 2, rtol=1e-5)


def test_targets_and_frequencies():
    e_next = np.array([[0, 2], [2, 3], [0, 2]])
    np.testing.assert_array_equal(targets(e_next, 4), [[1, 0, 1, 0], [0, 0, 1, 1], [1, 0, 1, 0]])
    np.testing.assert_allclose(expert_frequencies(e_next, 4, floor=0.1), [2 / 3, 0.1, 1.0, 1 / 3], rtol=1e-6)


@pytest.mark.parametrize("gamma", [0.0, 0.5, 2.0])
def test_focal_gradient_is_finite_when_confident(gamma):
    import jax

    z = jnp.array([[200.0, -200.0, 0.0]])
    y = jnp.array([[1.0, 0.0, 1.0]])
    grad = np.asarray(jax.grad(lambda z: focal_loss(z, y, gamma))(z))
    assert np.isfinite(grad).all() and grad[0, 2] < 0
