"""Model families on tiny presets: cache vs full recompute, routers, expert combination, state conversions."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from pdscope_jax import models
from pdscope_jax.models import experts
from pdscope_jax.models.experts import combine_experts, expert_ffn
from pdscope_jax.presets import PUBLISHED, preset

TINY = ["tiny-deepseek-v2-lite", "tiny-moonlight-16b-a3b", "tiny-qwen3-30b-a3b", "tiny-mixtral-8x7b"]


def tiny_model(name, dtype=jnp.float32):
    """Two layers keep every feature (DeepSeek: one dense layer, then a MoE layer) and compile fast."""
    return models.build(preset(name).replace(num_layers=2), nnx.Rngs(0), dtype)


def _full(graphdef, state, ids, positions):
    return nnx.merge(graphdef, state)(ids, positions)[0]


def _cached(graphdef, state, ids, positions, cache):
    return nnx.merge(graphdef, state)(ids, positions, cache)


@pytest.mark.parametrize("name", TINY)
def test_cached_decode_equals_full_recompute(name):
    model = tiny_model(name)
    graphdef, state = nnx.split(model)
    b, prompt, steps = 2, 5, 9
    ids = jnp.asarray(np.random.default_rng(0).integers(0, model.config.vocab_size, (b, prompt + steps)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(prompt + steps, dtype=jnp.int32), ids.shape)
    full = jax.jit(_full, static_argnums=0)(graphdef, state, ids, positions)

    cached = jax.jit(_cached, static_argnums=0, donate_argnums=4)
    cache = model.init_cache(b, 32, jnp.float32)
    logits, cache = cached(graphdef, state, ids[:, :prompt], positions[:, :prompt], cache)
    pieces = [logits]
    for t in range(prompt, prompt + steps):
        logits, cache = cached(graphdef, state, ids[:, t:t + 1], positions[:, t:t + 1], cache)
        pieces.append(logits)
    np.testing.assert_allclose(np.concatenate(pieces, axis=1), full, atol=1e-4, rtol=0)
    assert np.abs(np.asarray(full)).max() > 0.01  # logits are not trivially zero


@pytest.mark.parametrize("name", ["tiny-deepseek-v2-lite", "tiny-moonlight-16b-a3b"])
def test_mla_decode_attends_in_the_latent_space(name, monkeypatch):
    """A decode step against a long cache (the latent path's minimum): attending in the latent space gives the
    expanded attention's logits (float32) with fewer products than expanding every cached position (XLA's cost
    analysis of the two steps)."""
    from pdscope_jax.models import deepseek

    model = tiny_model(name)
    graphdef, state = nnx.split(model)
    b, prompt = 2, 40
    ids = jnp.asarray(np.random.default_rng(1).integers(0, model.config.vocab_size, (b, prompt + 1)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(prompt + 1, dtype=jnp.int32), ids.shape)
    cache = jax.jit(_cached, static_argnums=0)(graphdef, state, ids[:, :prompt], positions[:, :prompt],
                                               model.init_cache(b, deepseek.LATENT_MIN_CACHE, jnp.float32))[1]
    step = (graphdef, state, ids[:, prompt:], positions[:, prompt:], cache)

    def run():  # a new function each time: the path is chosen while tracing, and jax caches traces by function
        compiled = jax.jit(lambda *args: _cached(*args), static_argnums=0).lower(*step).compile()
        return compiled(*step[1:])[0], compiled.cost_analysis()["flops"]

    latent, latent_flops = run()
    monkeypatch.setattr(deepseek, "LATENT_MAX_QUERY", 0)
    expanded, expanded_flops = run()
    np.testing.assert_allclose(latent, expanded, atol=2e-5, rtol=0)
    assert latent_flops < 0.5 * expanded_flops, (latent_flops, expanded_flops)


def test_mla_cache_holds_latent_not_heads():
    model = tiny_model("tiny-deepseek-v2-lite")
    cfg = model.config
    cache = model.init_cache(3, 16, jnp.float32)
    assert len(cache) == cfg.num_layers
    assert cache[0].latent.shape == (3, 16, cfg.kv_lora_rank)
    assert cache[0].k_rope.shape == (3, 16, cfg.qk_rope_head_dim)


@pytest.mark.parametrize("name", TINY)
def test_router_outputs(name):
    model = tiny_model(name)
    cfg = model.config
    layer = model.layers[cfg.first_k_dense]
    assert layer.is_moe and not any(model.layers[i].is_moe for i in range(cfg.first_k_dense))
    h = jnp.asarray(np.random.default_rng(1).normal(size=(40, cfg.hidden_size)), jnp.float32)
    weights, ids = layer.mlp.route(h)
    assert weights.dtype == jnp.float32 and ids.dtype == jnp.int32
    assert weights.shape == ids.shape == (40, cfg.num_experts_per_tok)
    ids = np.asarray(ids)
    assert ids.min() >= 0 and ids.max() < cfg.num_experts
    assert all(len(set(row)) == len(row) for row in ids)  # k distinct experts per token
    sums = np.asarray(weights).sum(-1)
    # transformers renormalises in Qwen3/Mixtral and in DeepSeek's noaux_tc router only
    if cfg.norm_topk_prob and (not cfg.uses_mla or cfg.topk_method == "noaux_tc"):
        np.testing.assert_allclose(sums, cfg.routed_scaling_factor, rtol=1e-5)
    else:
        assert (sums <= cfg.routed_scaling_factor * (1 + 1e-5)).all()


def test_noaux_tc_groups_and_bias():
    cfg = preset("tiny-moonlight-16b-a3b").replace(n_group=4, topk_group=2, num_experts=16, num_layers=2)
    model = models.build(cfg, nnx.Rngs(0), jnp.float32)
    gate = model.layers[cfg.first_k_dense].mlp.gate
    h = jnp.asarray(np.random.default_rng(2).normal(size=(64, cfg.hidden_size)), jnp.float32)
    weights, ids = gate(h)
    groups = np.asarray(ids) // (cfg.num_experts // cfg.n_group)
    assert all(len(set(row)) <= cfg.topk_group for row in groups)
    # A large correction bias on expert 5 makes every token choose it, with its unbiased sigmoid score.
    gate.e_score_correction_bias[...] = jnp.zeros(cfg.num_experts).at[5].set(10.0)
    weights2, ids2 = gate(h)
    assert (np.asarray(ids2) == 5).any(axis=1).all()
    scores = jax.nn.sigmoid(h @ gate.kernel[...])
    chosen = np.take_along_axis(np.asarray(scores), np.asarray(ids2), axis=1)
    np.testing.assert_allclose(np.asarray(weights2), chosen / chosen.sum(1, keepdims=True) * cfg.routed_scaling_factor,
                               rtol=1e-5)


def _experts(rng, e=6, d=16, f=8, n=50, k=2):
    x = jnp.asarray(rng.normal(size=(n, d)), jnp.float32)
    gate_up = jnp.asarray(rng.normal(size=(e, d, 2 * f)) / 4, jnp.float32)
    down = jnp.asarray(rng.normal(size=(e, f, d)) / 3, jnp.float32)
    ids = jnp.asarray(np.stack([rng.choice(e, k, replace=False) for _ in range(n)]), jnp.int32)
    weights = jnp.asarray(rng.random((n, k)), jnp.float32)
    return x, weights, ids, gate_up, down


@pytest.fixture(params=["batched", "tile_after_tile"])
def tiles_for_small_experts(request, monkeypatch):
    """The tiled path normally waits for large experts; let these toy ones reach it, in both of its forms (all
    tiles as one batched matmul, or one tile after another when the gathered weights would be too large)."""
    monkeypatch.setattr(experts, "TILED_MIN_EXPERT_ELEMENTS", 0)
    if request.param == "tile_after_tile":
        monkeypatch.setattr(experts, "GROUPED_MAX_BYTES", 0)


@pytest.mark.parametrize("n", [4, 50, 200])  # 8, 100, 400 assignments over 6 experts: gather, ragged_dot, tiles
def test_combine_experts_matches_per_expert_sum(n, tiles_for_small_experts):
    rng = np.random.default_rng(3)
    x, weights, ids, gate_up, down = _experts(rng, n=n)
    e = gate_up.shape[0]
    each = np.stack([np.asarray(expert_ffn(x, gate_up[i], down[i])) for i in range(e)], axis=1)  # [N, E, D]
    want = np.einsum("nk,nkd->nd", np.asarray(weights), np.take_along_axis(each, np.asarray(ids)[..., None], 1))
    got = jax.jit(combine_experts)(x, weights, ids, gate_up, down, jnp.arange(e, dtype=jnp.int32))
    np.testing.assert_allclose(got, want, atol=1e-5)
    same = jax.jit(combine_experts, static_argnums=5)(x, weights, ids, gate_up, down, None)  # expert e in slot e
    np.testing.assert_array_equal(same, got)


def test_combine_experts_tiles_hold_skewed_routing(tiles_for_small_experts):
    """Every token on the same two experts (the most tiles one slot can need) over a pool with more slots than
    experts, as in the offload engine: the tiles still cover every assignment."""
    rng = np.random.default_rng(5)
    x, weights, _, gate_up, down = _experts(rng, e=6, n=300)
    ids = jnp.tile(jnp.asarray([[4, 1]], jnp.int32), (300, 1))
    slot_of = jnp.asarray([7, 2, 9, 0, 5, 3], jnp.int32)  # 6 experts in a pool of 10 slots
    pool_gu = jnp.zeros((10,) + gate_up.shape[1:], gate_up.dtype).at[slot_of].set(gate_up)
    pool_dn = jnp.zeros((10,) + down.shape[1:], down.dtype).at[slot_of].set(down)
    want = sum(np.asarray(weights[:, j:j + 1]) * np.asarray(expert_ffn(x, gate_up[e], down[e]))
               for j, e in enumerate((4, 1)))
    got = jax.jit(combine_experts)(x, weights, ids, pool_gu, pool_dn, slot_of)
    np.testing.assert_allclose(got, want, atol=1e-5)


@pytest.mark.parametrize("n", [4, 50, 200])
def test_combine_experts_slot_maps_partition_the_sum(n, tiles_for_small_experts):
    """Experts split over two slot pools (as the engine does) add up to the all-resident result."""
    rng = np.random.default_rng(4)
    x, weights, ids, gate_up, down = _experts(rng, n=n)
    e = gate_up.shape[0]
    full = combine_experts(x, weights, ids, gate_up, down, jnp.arange(e, dtype=jnp.int32))
    on_a = np.array([0, 2, 3])  # pool A holds experts 0, 2, 3 in slots 0..2; pool B holds the rest
    slot_a = np.full(e, -1, np.int32)
    slot_a[on_a] = np.arange(len(on_a))
    on_b = np.setdiff1d(np.arange(e), on_a)
    slot_b = np.full(e, -1, np.int32)
    slot_b[on_b] = np.arange(len(on_b))
    part_a = combine_experts(x, weights, ids, gate_up[on_a], down[on_a], jnp.asarray(slot_a))
    part_b = combine_experts(x, weights, ids, gate_up[on_b], down[on_b], jnp.asarray(slot_b))
    np.testing.assert_allclose(part_a + part_b, full, atol=1e-5)
    assert np.abs(np.asarray(part_a)).max() > 0 and np.abs(np.asarray(part_b)).max() > 0


@pytest.mark.parametrize("n", [4, 50, 200])
def test_combine_experts_over_a_pool_larger_than_the_layer(n, tiles_for_small_experts):
    """The engine's case: a pool of more slots than the layer has experts, some of them other layers' (slot 0
    among those, where invalid assignments point), and experts scattered over it."""
    rng = np.random.default_rng(5)
    x, weights, ids, gate_up, down = _experts(rng, n=n)
    e = gate_up.shape[0]
    full = combine_experts(x, weights, ids, gate_up, down, jnp.arange(e, dtype=jnp.int32))
    slot_of = np.array([3, 17, 9, 1, 12, 6], np.int32)  # 6 experts in a pool of 20 slots
    pool_gu = jnp.asarray(rng.normal(size=(20, *gate_up.shape[1:])), jnp.float32).at[slot_of].set(gate_up)
    pool_dn = jnp.asarray(rng.normal(size=(20, *down.shape[1:])), jnp.float32).at[slot_of].set(down)
    got = jax.jit(combine_experts)(x, weights, ids, pool_gu, pool_dn, jnp.asarray(slot_of))
    np.testing.assert_allclose(got, full, atol=1e-5)


@pytest.mark.parametrize("name", TINY)
def test_flat_state_round_trip_and_sources_cover_parameters(name):
    model = tiny_model(name)
    cfg = model.config
    flat = models.to_flat(model)
    shapes = models.abstract_state(cfg, jnp.float32)
    assert set(flat) == set(shapes) == set(models.checkpoint_sources(cfg))
    assert all(flat[p].shape == shapes[p].shape for p in flat)
    bumped = {p: v + 1 for p, v in flat.items()}
    rebuilt = models.from_flat(cfg, jnp.float32, bumped)
    assert all(np.array_equal(v, bumped[p]) for p, v in models.to_flat(rebuilt).items())
    with pytest.raises(ValueError, match="missing"):
        models.from_flat(cfg, jnp.float32, {p: v for p, v in flat.items() if p != "norm.weight"})


def test_expert_layout_and_router_dtype():
    cfg = preset("tiny-moonlight-16b-a3b")
    shapes = models.abstract_state(cfg, jnp.bfloat16)
    layer = f"layers.{cfg.first_k_dense}.mlp"
    d, f, e = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts
    assert shapes[f"{layer}.experts.gate_up"].shape == (e, d, 2 * f)
    assert shapes[f"{layer}.experts.down"].shape == (e, f, d)
    assert shapes[f"{layer}.experts.down"].dtype == jnp.bfloat16
    assert shapes[f"{layer}.gate.kernel"].dtype == jnp.float32  # DeepSeek routers stay float32, as in transformers
    assert shapes[f"{layer}.gate.e_score_correction_bias"].shape == (e,)
    assert f"{layer}.shared_experts.gate_proj.kernel" in shapes
    src = models.checkpoint_sources(cfg)[f"{layer}.experts.gate_up"]
    assert src.stacked and src.transpose and len(src.keys) == e
    assert src.keys[3] == (f"model.layers.{cfg.first_k_dense}.mlp.experts.3.gate_proj.weight",
                           f"model.layers.{cfg.first_k_dense}.mlp.experts.3.up_proj.weight")


# Total parameters of the published models (their model cards): checks every family's shapes at full size.
PUBLISHED_PARAMS = {"deepseek-v2-lite": 15.7e9, "qwen3-30b-a3b": 30.5e9, "mixtral-8x7b": 46.7e9,
                    "moonlight-16b-a3b": 16.0e9, "deepseek-v2": 236e9, "deepseek-v3": 671e9,
                    "qwen3-235b-a22b": 235e9, "mixtral-8x22b": 141e9}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_published_parameter_counts(name):
    cfg = preset(name)
    shapes = models.abstract_state(cfg, jnp.bfloat16)
    total = sum(int(np.prod(s.shape)) for s in shapes.values())
    assert abs(total / PUBLISHED_PARAMS[name] - 1) < 0.02, total
    expert_params = sum(int(np.prod(s.shape)) for p, s in shapes.items() if ".experts." in p)
    assert expert_params == len(cfg.moe_layers) * cfg.num_experts * cfg.expert_param_count()


def test_abstract_models_share_no_variable():
    cfg = preset("tiny-deepseek-v2-lite")
    first, second = models.abstract_model(cfg, jnp.float32), models.abstract_model(cfg, jnp.float32)
    first.embed.embedding.set_value(jax.ShapeDtypeStruct((0,), jnp.float32))  # as a caller emptying a parameter
    assert second.embed.embedding.get_value().shape == (cfg.vocab_size, cfg.hidden_size)
    assert models.abstract_model(cfg, jnp.float32).embed.embedding.get_value().shape[0] == cfg.vocab_size
