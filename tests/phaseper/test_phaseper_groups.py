import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdscope_jax.phaseper.groups import (
    detect_groups,
    group_of,
    layer_similarity,
    plot_groups,
    routing_weight_spread,
)


def _profile(num, rise, fall, width, noise, seed):
    """Low, sigmoid rise centred between layers rise-1 and rise, high, sigmoid fall before layer fall."""
    x = np.arange(num, dtype=np.float64)
    sig = lambda c: 1 / (1 + np.exp(-(x - c) / width))  # noqa: E731
    s = 0.3 + 0.6 * (sig(rise - 0.5) - sig(fall - 0.5))
    return s + noise * np.random.default_rng(seed).normal(size=num)


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("num,rise,fall", [(26, 6, 20), (48, 10, 38), (12, 3, 9)])
def test_boundaries_land_where_built(num, rise, fall, seed):
    s = _profile(num, rise, fall, width=0.8, noise=0.04, seed=seed)
    input_end, middle_end = detect_groups(s)
    assert abs(input_end - rise) <= 1 and abs(middle_end - fall) <= 1


def test_similarity_from_hidden_states_end_to_end():
    rng = np.random.default_rng(0)
    num, rise, fall = 20, 5, 15
    target = _profile(num, rise, fall, width=0.5, noise=0.0, seed=0)
    hidden = [rng.normal(size=(64, 32))]
    for l in range(1, num):
        # mix the previous state with an orthogonalised fresh direction so cos(h_l, h_{l-1}) = target[l]
        prev = hidden[-1] / np.linalg.norm(hidden[-1], axis=1, keepdims=True)
        fresh = rng.normal(size=prev.shape)
        fresh -= np.sum(fresh * prev, axis=1, keepdims=True) * prev
        fresh /= np.linalg.norm(fresh, axis=1, keepdims=True)
        hidden.append(target[l] * prev + np.sqrt(1 - target[l] ** 2) * fresh)
    sim = layer_similarity(hidden)
    np.testing.assert_allclose(sim[1:], target[1:], atol=1e-5)
    assert sim[0] == sim[1]
    assert detect_groups(sim) == (rise, fall)


def test_identical_and_orthogonal_layers():
    h = np.eye(4)
    np.testing.assert_allclose(layer_similarity([h, h, h]), [1, 1, 1], atol=1e-6)
    np.testing.assert_allclose(layer_similarity([h, np.roll(h, 1, axis=1)]), [0, 0], atol=1e-6)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(-1, 1, allow_nan=False), min_size=3, max_size=40))
def test_always_valid_nonempty_groups(profile):
    input_end, middle_end = detect_groups(np.array(profile))
    assert 1 <= input_end < middle_end <= len(profile) - 1
    names = [group_of(i, (input_end, middle_end)) for i in range(len(profile))]
    assert names[0] == "input" and names[-1] == "output" and "middle" in names


def test_too_few_layers():
    assert detect_groups(np.array([0.1, 0.9, 0.2])) == (1, 2)
    with pytest.raises(ValueError, match="at least 3"):
        detect_groups(np.array([0.1, 0.9]))


def test_plot_and_spread(tmp_path):
    s = _profile(16, 4, 12, 0.8, 0.02, 0)
    spread = routing_weight_spread([np.full((5, 2), 0.5), np.array([[0.9, 0.1]])])
    np.testing.assert_allclose(spread, [0.0, 0.4], atol=1e-6)
    path = plot_groups(s, np.linspace(0.1, 0.3, 16), detect_groups(s), tmp_path / "plots" / "groups.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_groups_from_traces(tmp_path):
    from pdscope_jax.phaseper.groups import groups_from_traces
    from pdscope_jax.phaseper.traces import load_traces, write_synthetic_traces

    traces = load_traces(write_synthetic_traces(tmp_path / "t", layers=tuple(range(6)), decode_steps=0))
    groups, similarity, spread = groups_from_traces(traces, "prefill", max_tokens=100)
    assert 1 <= groups[0] < groups[1] <= 5 and similarity.shape == spread.shape == (6,)
    with pytest.raises(ValueError, match="no decode traces"):
        groups_from_traces(traces, "decode")
