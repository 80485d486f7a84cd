"""AdaptSched: each prefill step and each decode mode against answers computed by hand (arithmetic in the
comments), the online hit rate, slot limits, and hypothesis properties (monotonicity, never more on-demand
loads than ondemand, a misprediction costs at most one on-demand round)."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdscope_jax.sched import AdaptSched, CostTable, LayerDemand, check_plan, make_planner


def linear_costs(cpu=1.0, gpu=0.5, launch=0.3, t_io=2.0, alpha=1.0, attn=3.0):
    """t_cpu(t) = cpu * t for 1 <= t <= 1000; t_gpu(m experts) = launch + m * (gpu - launch)."""
    return CostTable(token_buckets=(1, 1000), cpu_expert_seconds=(cpu, 1000 * cpu), gpu_expert_seconds=(gpu, gpu),
                     t_io=t_io, alpha=alpha, attn_prefill_seconds=(attn, attn), attn_decode_seconds=(attn, attn),
                     gpu_launch_seconds=launch)


def demand(tokens, resident=(), phase="prefill", next_scores=None, next_resident=(), free_slots=20, layer=0,
           next_layer=1, total_slots=0):
    e = len(tokens)
    res = np.zeros(e, bool)
    res[list(resident)] = True
    nres = np.zeros(e, bool)
    nres[list(next_resident)] = True
    return LayerDemand(layer=layer, phase=phase, tokens_per_expert=np.asarray(tokens), resident=res,
                       next_layer=next_layer, next_scores=None if next_scores is None else np.asarray(next_scores),
                       next_resident=nres if next_layer is not None else None, free_slots=free_slots,
                       total_slots=max(free_slots, total_slots))


def run(planner, d, c):
    plan = planner.plan(d, c)
    check_plan(d, plan)
    return plan, planner.last_decision


# ---- prefill ----------------------------------------------------------------------------------------------
# The paper's steps exactly (`PAPER`) first; the departures (the layer guard, the link window) after them.
PAPER = dict(layer_guard=False, link_window=False)

# Costs: cpu 1 s/token, t_gpu(m experts) = 0.3 + 0.2 m, t_io 2, alpha 1, t_attn 3.
# Current layer: experts 1..7 with 1, 2, 3, 5, 8, 13, 20 tokens, none resident: E_cur (n = 7).
# Next layer: scores proportional to 4, 6, 10, 12, 20 tokens on experts 2..6 (5 positive, fewer than the 7
# activated now, so all predicted); they sum to 52 = this layer's assignments, so predicted tokens are exactly
# 4, 6, 10, 12, 20: E_next (n' = 5).
PREFILL_TOKENS = [0, 1, 2, 3, 5, 8, 13, 20]
PREFILL_SCORES = np.array([0, 0, 4, 6, 10, 12, 20, 0]) / 52


def test_prefill_steps_by_hand():
    # Step 1: E_all ascending (c = current, x = next): 1c 2c 3c 4x 5c 6x 8c 10x 12x 13c 20x 20c (a tie puts the
    #   current expert after, i.e. hotter). T_C(i) = prefix CPU sum + 3; T_G(i) = 1 + 2 (12 - i) + t_g(cur part)
    #   + t_g(next part):
    #   i=4: T_C = 1+2+3+4 + 3 = 13; suffix holds 4 cur, 4 next: T_G = 1 + 16 + 1.1 + 1.1 = 19.2  -> no
    #   i=5: T_C = 15 + 3 = 18;      suffix holds 3 cur, 4 next: T_G = 1 + 14 + 0.9 + 1.1 = 17.0 -> yes, i = 5.
    #   L_global = E_all[5:] holds E_cur[4:] (8, 13, 20 tokens): j0 = 4.
    # Step 2 (boundary expert left out of the CPU side): i' = 4: T_G = 1 + 3*2 + (0.3 + 3*0.2) = 7.9 vs
    #   t_cpu(E_cur[0:3]) = 1+2+3 = 6 -> no; i' = 5: T_G = 1 + 2*2 + 0.7 = 5.7 vs t_cpu(E_cur[0:4]) = 11 -> yes.
    #   L_on = E_cur[5:] = experts 7 (20 tokens) and 6 (13).
    # Step 3: CPU side t_cpu(E_cur[0:5]) = 1+2+3+5+8 = 19, GPU side 5.7: T_gap = 13.3, f = (13.3 + 3) / 2 = 8.15;
    #   xi = 0.5 * (8.15 - 9 + 1) * 2 - 0.5 * (9 - 8.15) * 2 = 0.15 - 0.85 = -0.7 -> floor(f) = 8 > n' = 5:
    #   all of E_next, hottest first.
    # Streaming (20 slots hold two layers of 8): streamed = (t_transfer(8) = 17, hidden in max(5.7, 19) + 3 = 22)
    #   + t_g(5 predicted) 1.3 = 1.3; planned: R_hit prior 0.5 leaves half of L_pre's 52 tokens missed,
    #   min(max(1.3, CPU 26), t_transfer(2.5) + 1.3 = 7.3) = 7.3 -> stream.
    plan, dec = run(AdaptSched(**PAPER), demand(PREFILL_TOKENS, next_scores=PREFILL_SCORES), linear_costs())
    np.testing.assert_array_equal(plan.load_now, [7, 6])
    np.testing.assert_array_equal(plan.cpu, [1, 2, 3, 4, 5])
    np.testing.assert_array_equal(plan.prefetch, [6, 5, 4, 3, 2])
    assert plan.unload.size == 0 and plan.stream_next_layer and dec.stream
    assert (dec.mode, dec.n, dec.n_next, dec.i, dec.i_prime) == ("prefill", 7, 5, 5, 5)
    assert dec.T_G == pytest.approx(5.7) and dec.T_C == pytest.approx(19.0)
    assert dec.f == pytest.approx(8.15) and dec.xi == pytest.approx(-0.7)


def test_prefill_slot_limits_keep_hottest():
    # Same layer, 3 free slots: the two loads fit, one prefetch (the hottest predicted, expert 6) is left room.
    exact = AdaptSched(**PAPER)
    plan, _ = run(exact, demand(PREFILL_TOKENS, next_scores=PREFILL_SCORES, free_slots=3), linear_costs())
    np.testing.assert_array_equal(plan.load_now, [7, 6])
    np.testing.assert_array_equal(plan.prefetch, [6])
    # 1 free slot: step 2 wanted E_cur[5:], cut to the hottest, E_cur[6:]; nothing left for prefetching.
    exact = AdaptSched(**PAPER)
    plan, dec = run(exact, demand(PREFILL_TOKENS, next_scores=PREFILL_SCORES, free_slots=1), linear_costs())
    np.testing.assert_array_equal(plan.load_now, [7])
    assert plan.prefetch.size == 0 and dec.i_prime == 6


def test_prefill_global_queue_bounds_the_loads():
    # Without a predictor E_all = E_cur: step 1 over 7 experts. i=2: T_C = 3 + 3 = 6, T_G = 1 + 5*2 + (0.3 +
    # 5*0.2) = 12.3 -> no; i=3: T_C = 9, T_G = 1 + 8 + 1.1 = 10.1 -> no; i=4: T_C = 11 + 3 = 14, T_G = 1 + 6 +
    # 0.9 = 7.9 -> yes, j0 = 4. Step 2 as in the test above: i' = 5 (i' = 4 fails: 7.9 vs 6).
    plan, dec = run(AdaptSched(**PAPER), demand(PREFILL_TOKENS), linear_costs())
    assert (dec.i, dec.i_prime, dec.n_next) == (4, 5, 0)
    np.testing.assert_array_equal(plan.load_now, [7, 6])
    assert plan.prefetch.size == 0


def test_prefill_two_missing_experts_stay_on_cpu():
    # The prefill criterion's CPU side is t_cpu(E_cur[0:i'-1]): for i' = 0 and i' = 1 it is empty (0), so with
    # n <= 2 no load ever qualifies, however hot the experts (a consequence of the formula, documented).
    for tokens in ([500, 0, 0], [500, 0, 900]):
        plan, dec = run(AdaptSched(**PAPER), demand(tokens, next_layer=None), linear_costs())
        assert plan.load_now.size == 0 and dec.i_prime == dec.n
        np.testing.assert_array_equal(plan.cpu, np.flatnonzero(tokens))
    # With a third, cold expert (E_cur = 10, 500, 900 tokens): step 1 stops at i = 1 (T_G = 1 + 2*2 + 0.7 = 5.7 <
    # T_C = 10 + 3), j0 = 1; step 2: i' = 1 fails (CPU side 0), i' = 2: T_G = 1 + 2 + 0.5 = 3.5 < t_cpu(E_cur[0:1])
    # = 10 -> load the hottest.
    plan, _ = run(AdaptSched(**PAPER), demand([500, 10, 900], next_layer=None), linear_costs())
    np.testing.assert_array_equal(plan.load_now, [2])


def test_layer_guard_balances_a_layer_the_steps_leave_slower_than_loading_everything():
    # PREFILL_TOKENS without a predictor: steps 1-2 give i' = 5 (above), a CPU side t_cpu(E_cur[0:5]) = 19, while
    # loading all 7 now takes 1 + 7*2 + (0.3 + 7*0.2) = 16.7. The guard takes the i' of least max(T_G, T_C):
    # i'=0: 16.7; 1: max(14.5, 1); 2: max(12.3, 3); 3: max(10.1, 6) = 10.1; 4: max(7.9, 11); 5: max(5.7, 19).
    plan, dec = run(AdaptSched(), demand(PREFILL_TOKENS), linear_costs())
    assert dec.i_prime == 3 and dec.T_G == pytest.approx(10.1) and dec.T_C == pytest.approx(6.0)
    np.testing.assert_array_equal(plan.load_now, [7, 6, 5, 4])
    np.testing.assert_array_equal(plan.cpu, [1, 2, 3])
    # Two hot experts the paper's formula keeps on the CPU (1,400 s there): loading both takes 1 + 4 + 0.7.
    plan, dec = run(AdaptSched(), demand([500, 0, 900], next_layer=None), linear_costs())
    np.testing.assert_array_equal(plan.load_now, [2, 0])
    assert plan.cpu.size == 0 and dec.T_G == pytest.approx(5.7)
    # Five 1-token experts and one of 40: step 1 stops at i = 4 (T_C = 4 + 3 = 7 > T_G = 1 + 4 + 0.7 = 5.7), step 2
    # at i' = 5 (T_G = 1 + 2 + 0.5 = 3.5 < t_cpu(E_cur[0:4]) = 4): a layer of max(3.5, 5) = 5, faster than loading
    # all six (1 + 12 + 1.5 = 14.5): the guard leaves the steps' plan as it is.
    for planner in (AdaptSched(), AdaptSched(**PAPER)):
        plan, dec = run(planner, demand([0, 1, 1, 1, 1, 1, 40], next_layer=None), linear_costs())
        np.testing.assert_array_equal(plan.load_now, [6])
        assert dec.i_prime == 5 and dec.T_C == pytest.approx(5.0)


# Step 3 alone: experts 0..3 active (5 tokens each) and resident, so E_cur is empty; GPU side t_g = 0.3 + 4*0.2
# = 1.1, CPU side 0: T_gap = -1.1. t_attn = 3.4, t_io = 1 -> f = (-1.1 + 3.4) / 1 = 2.3.
# Predicted next: scores 1,2,3,4 on experts 4..7, sum 10, assignments 20 -> 2, 4, 6, 8 tokens.
STEP3 = dict(tokens=[5, 5, 5, 5, 0, 0, 0, 0], resident=[0, 1, 2, 3], next_scores=[0, 0, 0, 0, .1, .2, .3, .4])


@pytest.mark.parametrize("r_hit, expected", [
    # xi = 0.5 * (2.3 - 3 + 1) - 0.5 * (3 - 2.3) = 0.15 - 0.35 = -0.2 -> floor(f) = 2
    (0.5, [7, 6]),
    # xi = 0.8 * 0.3 - 0.2 * 0.7 = 0.24 - 0.14 = 0.10 -> ceil(f) = 3
    (0.8, [7, 6, 5]),
])
def test_step3_confidence(r_hit, expected):
    plan, dec = run(AdaptSched(r_hit_prior=r_hit, link_window=False), demand(**STEP3),
                    linear_costs(t_io=1.0, attn=3.4))
    np.testing.assert_array_equal(plan.prefetch, expected)
    assert dec.f == pytest.approx(2.3)
    assert dec.xi == pytest.approx(r_hit * 0.3 - (1 - r_hit) * 0.7)


@pytest.mark.parametrize("r_hit, expected", [
    # xi = 0.5 * (4.5 - 5 + 1) - 0.5 * (5 - 4.5) = 0 -> floor(f) = 4: all four predicted experts
    (0.5, [7, 6, 5, 4]),
    # xi > 0 -> ceil(f) = 5, cut to the four there are
    (0.8, [7, 6, 5, 4]),
])
def test_step3_link_window_counts_the_gpu_time_too(r_hit, expected):
    # STEP3 again (its 20 slots hold two layers of 8, but streaming the next one does not pay), with the link
    # window: nothing is loaded now, so the link is free for the layer's whole max(T_G, T_C) = 1.1 plus the next
    # attention 3.4: f = 4.5 (the paper's bubble gave 2.3).
    plan, dec = run(AdaptSched(r_hit_prior=r_hit), demand(**STEP3), linear_costs(t_io=1.0, attn=3.4))
    np.testing.assert_array_equal(plan.prefetch, expected)
    assert dec.f == pytest.approx(4.5)


def test_link_window_leaves_out_the_layers_own_loads():
    # PREFILL_TOKENS with the guard: i' = 3, T_G = 10.1 (4 loads: 1 + 4 * 2 = 9 of transfer), T_C = 6, t_attn = 3,
    # t_io = 2. The link is free after the loads: f = (10.1 + 3 - 9) / 2 = 2.05, xi = 0.5 * 0.05 * 2 - 0.5 * 0.95
    # * 2 < 0 -> 2 prefetches, the hottest of E_next (6, 5); the paper's bubble: f = (6 - 10.1 + 3) / 2 < 0, none.
    # 15 slots: two layers of 8 do not fit, so the next layer cannot stream.
    costs = linear_costs()
    layer = demand(PREFILL_TOKENS, next_scores=PREFILL_SCORES, free_slots=15)
    plan, linked = run(AdaptSched(), layer, costs)
    _, bubble = run(AdaptSched(link_window=False), layer, costs)
    assert linked.i_prime == bubble.i_prime == 3 and linked.T_G == pytest.approx(10.1) and linked.T_C == 6.0
    assert linked.f == pytest.approx(2.05) and bubble.f == pytest.approx(-0.55)
    np.testing.assert_array_equal(plan.prefetch, [6, 5])
    assert bubble.prefetches == 0 and not linked.stream
    # 20 slots: streaming the next layer pays under the paper's plan, so the link window is not used
    plan, streamed = run(AdaptSched(), demand(PREFILL_TOKENS, next_scores=PREFILL_SCORES), costs)
    assert streamed.stream and streamed.f == pytest.approx(-0.55) and plan.prefetch.size == 0


def test_r_hit_learned_through_observe():
    costs = linear_costs(t_io=1.0, attn=3.4)
    planner = AdaptSched(r_hit_prior=0.5, r_hit_window=2, link_window=False)
    plan, _ = run(planner, demand(**STEP3), costs)
    np.testing.assert_array_equal(plan.prefetch, [7, 6])
    planner.observe(0, "decode", [7, 6])      # wrong phase: ignored
    planner.observe(5, "prefill", [7, 6])     # no prediction made at layer 5: ignored
    assert planner.r_hit("prefill") == 0.5
    planner.observe(0, "prefill", [7, 6, 1])  # both prefetched experts activated: hit rate 1
    assert planner.r_hit("prefill") == 1.0 and planner.r_hit("decode") == 0.5
    plan, dec = run(planner, demand(**STEP3), costs)  # xi = 1.0 * 0.3 > 0 -> ceil(f) = 3
    np.testing.assert_array_equal(plan.prefetch, [7, 6, 5])
    planner.observe(0, "prefill", [0, 1, 2])  # none of 7, 6, 5: 0; window of 2 -> mean(1, 0)
    assert planner.r_hit("prefill") == 0.5
    run(planner, demand(**STEP3), costs)
    planner.observe(0, "prefill", [7, 1, 2])  # 1 of 2: window holds (0, 0.5)
    assert planner.r_hit("prefill") == 0.25


# ---- decode -----------------------------------------------------------------------------------------------

# Costs: cpu 1 s per expert (1 token), t_gpu(m) = 0.3 + 0.2 m, t_io 0.5, alpha 0.1, t_attn 1.2.
# k = 6 experts (0..5) active with 1 token each. n_c = argmin_x max(t_gpu(6 - x), x * 1):
#   x=0: max(1.5, 0) = 1.5; x=1: max(1.3, 1) = 1.3; x=2: max(1.1, 2) = 2  -> n_c = 1.
# Next layer: scores 1 on experts 0..5 (top-6 predicted), 1 predicted token each.
DECODE_COSTS = dict(t_io=0.5, alpha=0.1, attn=1.2)
DECODE = dict(tokens=[1, 1, 1, 1, 1, 1, 0, 0], phase="decode", next_scores=[1, 1, 1, 1, 1, 1, 0, 0])


def test_decode_mode_a_load_focus():
    # Resident 0,1,2 -> E_cur = 3,4,5 (n = 3 > 1); next resident 0..4 -> E_next = {5} (n' = 1 <= 1): mode a.
    # Step 2 with the boundary included, T_C = t_cpu(E_cur[0:i']); resident base 3 experts on the GPU:
    #   i'=0: T_C = 0 -> no.  i'=1: T_G = 0.1 + 2*0.5 + (0.3 + 5*0.2) = 2.4 vs 1 -> no.
    #   i'=2: T_G = 0.1 + 0.5 + (0.3 + 4*0.2) = 1.7 vs 2 -> yes: load E_cur[2:] = expert 5 (ties: higher id hotter).
    # (The prefill criterion would compare 1.7 with t_cpu(E_cur[0:1]) = 1 and load nothing.)
    plan, dec = run(AdaptSched(), demand(**DECODE, resident=[0, 1, 2], next_resident=[0, 1, 2, 3, 4]),
                    linear_costs(**DECODE_COSTS))
    assert (dec.mode, dec.n, dec.n_next, dec.n_c, dec.i_prime) == ("a", 3, 1, 1, 2)
    assert dec.T_G == pytest.approx(1.7) and dec.T_C == pytest.approx(2.0)
    np.testing.assert_array_equal(plan.load_now, [5])
    assert plan.prefetch.size == plan.unload.size == 0


def test_decode_mode_b_prefetch_focus():
    # Resident 0..4 plus idle 6, 7 -> E_cur = {5} (n = 1 <= 1); next resident 0,1,2 -> E_next = 3,4,5 (n' = 3): b.
    # No loads. GPU side t_g(5 resident) = 1.3, CPU side 1: T_gap = -0.3, f = (-0.3 + 1.2) / 0.5 = 1.8;
    # xi = 0.5 * 0.8 * 0.5 - 0.5 * 0.2 * 0.5 = 0.15 > 0 -> ceil(f) = 2.
    # Constraint (c - f)+ t_io + t_g(next) < t_cpu(E_next[0:n'-c]), next GPU set = 3 resident + c:
    #   c=2: 0.2*0.5 + (0.3 + 5*0.2) = 1.4 vs t_cpu(1 expert) = 1 -> no;  c=1: 0 + 1.1 vs 2 -> yes: 1 prefetch.
    # 0 free slots: unload max(n_c - n, 1 - 0) = 1 idle expert, least recently used: 7 was active one step
    # earlier, 6 never -> unload 6, whose slot takes the prefetch of expert 5.
    planner = AdaptSched()
    costs = linear_costs(**DECODE_COSTS)
    run(planner, demand([0, 0, 0, 0, 0, 0, 0, 1], phase="decode", resident=[7]), costs)
    plan, dec = run(planner, demand(**DECODE, resident=[0, 1, 2, 3, 4, 6, 7], next_resident=[0, 1, 2],
                                    free_slots=0), costs)
    assert (dec.mode, dec.n, dec.n_next, dec.n_c) == ("b", 1, 3, 1)
    assert dec.f == pytest.approx(1.8) and dec.xi == pytest.approx(0.15)
    assert plan.load_now.size == 0
    np.testing.assert_array_equal(plan.prefetch, [5])
    np.testing.assert_array_equal(plan.unload, [6])
    np.testing.assert_array_equal(plan.cpu, [5])


def test_decode_mode_c_unload_focus():
    # Everything resident in both layers: n = n' = 0 <= 1: mode c, unload n_c - n = 1 idle expert (6: lower id
    # among the never-used 6 and 7), nothing else.
    plan, dec = run(AdaptSched(), demand(**DECODE, resident=range(8), next_resident=range(6)),
                    linear_costs(**DECODE_COSTS))
    assert dec.mode == "c"
    np.testing.assert_array_equal(plan.unload, [6])
    assert plan.load_now.size == plan.prefetch.size == plan.cpu.size == 0


def test_hot_table_preloaded_never_unloaded():
    # Mode c as above, but expert 6 is in layer 0's hot table (counts 9 for it): the idle expert unloaded is 7.
    planner = AdaptSched(hot_per_layer=1, activation_counts={0: [0, 0, 0, 0, 0, 0, 9, 0]})
    np.testing.assert_array_equal(planner.hot_experts(0), [6])
    np.testing.assert_array_equal(planner.hot_experts(1), [0])  # no counts: the first ones
    assert make_planner("pdscope").hot_experts(0).size == 0  # no table by default
    plan, _ = run(planner, demand(**DECODE, resident=range(8), next_resident=range(6)), linear_costs(**DECODE_COSTS))
    np.testing.assert_array_equal(plan.unload, [7])


def test_decode_mode_d_cross_layer():
    # Resident 0,1 -> E_cur = 2..5 (n = 4 > 1); nothing resident next -> E_next = 0..5 (n' = 6 > 1): mode d.
    # Step 1: 10 experts of 1 token, next-layer ones first on ties. T_C(i) = i + 1.2;
    #   T_G(i) = 0.1 + 0.5 (10 - i) + t_g(2 resident + 4 cur) [1.5] + t_g(6 - i next):
    #   i=4: 0.1 + 3.0 + 1.5 + 0.7 = 5.3 vs 5.2 -> no;  i=5: 0.1 + 2.5 + 1.5 + 0.5 = 4.6 vs 6.2 -> yes; j0 = 0.
    # Step 2 (prefill criterion): i'=2: 0.1 + 1.0 + 1.1 = 2.2 vs t_cpu(E_cur[0:1]) = 1 -> no;
    #   i'=3: 0.1 + 0.5 + 0.9 = 1.5 vs 2 -> yes: load expert 5.
    # Step 3: CPU side 3 (experts 2,3,4), GPU side 1.5: f = (1.5 + 1.2) / 0.5 = 5.4;
    #   xi = 0.5 * 0.4 * 0.5 - 0.5 * 0.6 * 0.5 = -0.05 -> floor 5. Constraint: c=5: 0 + (0.3 + 5*0.2) = 1.3 vs
    #   t_cpu(E_next[0:1]) = 1 -> no; c=4: 1.1 vs 2 -> yes. Prefetch the 4 hottest of E_next: 5, 4, 3, 2.
    plan, dec = run(AdaptSched(), demand(**DECODE, resident=[0, 1]), linear_costs(**DECODE_COSTS))
    assert (dec.mode, dec.n, dec.n_next, dec.n_c, dec.i, dec.i_prime) == ("d", 4, 6, 1, 5, 3)
    assert dec.f == pytest.approx(5.4) and dec.xi == pytest.approx(-0.05)
    np.testing.assert_array_equal(plan.load_now, [5])
    np.testing.assert_array_equal(plan.prefetch, [5, 4, 3, 2])
    assert plan.unload.size == 0


def test_tiny_next_scores_predict_without_overflow():
    """Scores of subnormal size (a predictor's probabilities can underflow) share this layer's assignments like
    any others: predicted tokens come from shares, not from dividing by a vanishing sum."""
    scores = PREFILL_SCORES * 1e-310
    with np.errstate(all="raise"):
        plan, dec = run(AdaptSched(), demand(PREFILL_TOKENS, next_scores=scores), linear_costs())
    _, want = run(AdaptSched(), demand(PREFILL_TOKENS, next_scores=PREFILL_SCORES), linear_costs())
    assert dec.n_next == want.n_next == 5 and dec.prefetches == want.prefetches


def test_last_layer_and_no_predictor():
    for d in (demand(PREFILL_TOKENS, next_layer=None), demand(PREFILL_TOKENS)):
        plan, dec = run(AdaptSched(), d, linear_costs())
        assert plan.prefetch.size == 0 and dec.n_next == 0


# ---- properties -------------------------------------------------------------------------------------------


@st.composite
def cases(draw):
    e = draw(st.sampled_from([4, 8, 16, 32]))
    phase = draw(st.sampled_from(["prefill", "decode"]))
    if phase == "decode":
        k = draw(st.integers(1, min(e, 8)))
        tokens = np.zeros(e, np.int64)
        tokens[draw(st.permutations(range(e)))[:k]] = draw(st.integers(1, 4))
    else:
        tokens = np.array(draw(st.lists(st.integers(0, 400), min_size=e, max_size=e)))
    pos = st.floats(1e-5, 1e-2)
    gpu = draw(pos)
    costs = linear_costs(cpu=draw(pos) / 10, gpu=gpu, launch=gpu * draw(st.floats(0, 1)), t_io=draw(pos),
                         alpha=draw(st.floats(0, 1e-3)), attn=draw(st.floats(0, 1e-2)))
    d = demand(tokens, resident=[i for i in range(e) if draw(st.booleans())], phase=phase,
               next_scores=draw(st.lists(st.floats(0, 1), min_size=e, max_size=e)),
               next_resident=[i for i in range(e) if draw(st.booleans())], free_slots=draw(st.integers(0, 2 * e)))
    return d, costs, draw(st.floats(0, 1))


@settings(max_examples=200, deadline=None)
@given(case=cases())
def test_assignment_slots_and_monotonicity(case):
    d, costs, r_hit = case
    plan, dec = run(AdaptSched(r_hit_prior=r_hit), d, costs)
    tok = d.tokens_per_expert
    assert plan.gpu.size + plan.cpu.size == np.count_nonzero(d.activated)  # each activated expert exactly once
    assert plan.load_now.size + plan.prefetch.size <= d.free_slots + plan.unload.size
    not_loaded = np.setdiff1d(d.missing_cold_to_hot(), plan.load_now)
    if plan.load_now.size and not_loaded.size:  # on-demand monotonicity
        assert tok[not_loaded].max() <= tok[plan.load_now].min()
    assert not np.intersect1d(plan.unload, np.flatnonzero(d.activated)).size  # only idle experts are unloaded
    if dec.mode == "a":
        assert plan.prefetch.size == plan.unload.size == 0
    if dec.mode in ("b", "c"):
        assert plan.load_now.size == 0
    if dec.mode in ("prefill", "a", "d"):
        assert plan.unload.size == 0
    if dec.mode == "c":
        assert plan.prefetch.size == 0


@settings(max_examples=200, deadline=None)
@given(case=cases())
def test_never_loads_more_than_ondemand(case):
    d, costs, _ = case
    plan, _ = run(AdaptSched(), d, costs)
    ondemand = make_planner("ondemand").plan(d, costs)
    assert np.isin(plan.load_now, ondemand.load_now).all()


@settings(max_examples=150, deadline=None)
@given(case=cases(), data=st.data())
def test_misprediction_costs_at_most_one_on_demand_round(case, data):
    """Layer l predicts (with full confidence) experts that layer l+1 then never activates. Layer l+1's plan
    still computes exactly its activated experts, loads only its missing activated experts in one round, no
    more than ondemand would, and never computes the wrongly prefetched ones."""
    d, costs, _ = case
    e = d.num_experts
    predicted = np.array(data.draw(st.permutations(range(e))))[:max(e // 2, 1)]
    scores = np.zeros(e)
    scores[predicted] = 1.0
    planner = AdaptSched(r_hit_prior=1.0)
    first, _ = run(planner, LayerDemand(**{**d.__dict__, "next_scores": scores}), costs)
    actual = np.setdiff1d(np.arange(e), predicted)
    tokens = np.zeros(e, np.int64)
    tokens[actual] = data.draw(st.lists(st.integers(1, 50), min_size=actual.size, max_size=actual.size))
    resident = np.asarray(d.next_resident).copy()
    resident[first.prefetch] = True
    second = LayerDemand(layer=1, phase=d.phase, tokens_per_expert=tokens, resident=resident, next_layer=None,
                         next_scores=None, next_resident=None,
                         free_slots=max(d.free_slots - first.load_now.size - first.prefetch.size, 0),
                         total_slots=d.total_slots)
    plan, _ = run(planner, second, costs)
    planner.observe(0, d.phase, actual)
    assert np.isin(plan.load_now, actual).all()
    assert not np.isin(plan.gpu, first.prefetch).any() and not np.isin(plan.cpu, first.prefetch).any()
    assert plan.load_now.size <= make_planner("ondemand").plan(second, costs).load_now.size
    if first.prefetch.size:
        assert planner.r_hit(d.phase) == 0.0


# ---- full-layer double buffering in prefill ------------------------------------------------------------------

def test_prefill_streams_only_when_two_layers_fit_and_it_pays():
    c = linear_costs()
    fits = demand(PREFILL_TOKENS, next_scores=PREFILL_SCORES)  # 20 slots >= 2 x 8: streaming pays (see above)
    assert run(AdaptSched(**PAPER), fits, c)[0].stream_next_layer
    one_layer = demand(PREFILL_TOKENS, next_scores=PREFILL_SCORES, free_slots=15)  # 15 < 16: no double buffer
    plan, dec = run(AdaptSched(**PAPER), one_layer, c)
    assert not plan.stream_next_layer and not dec.stream
    # A perfect predictor (R_hit = 1): L_pre already covers the next layer, the stream gains nothing.
    assert not run(AdaptSched(r_hit_prior=1.0, **PAPER), fits, c)[0].stream_next_layer
    # Without scores the current layer's tokens stand in for the next layer's; no next layer, no stream.
    assert run(AdaptSched(**PAPER), demand(PREFILL_TOKENS), c)[0].stream_next_layer
    assert not run(AdaptSched(**PAPER), demand(PREFILL_TOKENS, next_layer=None), c)[0].stream_next_layer


def test_decode_never_streams():
    d = demand([0, 1, 1, 0, 1, 0, 0, 0], phase="decode", next_scores=PREFILL_SCORES)
    assert not run(AdaptSched(), d, linear_costs())[0].stream_next_layer
