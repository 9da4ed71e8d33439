"""DPPO (Binary-TV, Binary-KL) and DRO (stppo.algos.baselines.dppo, .dro): hand-computed cases,
a plain-loop reference, limiting cases, mask invariance, split batches, the gradient's closed
form and gradcheck, option errors (docs/design.md §2). Equality with verl's functions of the same
names: tests/verl/test_baselines_vs_verl.py."""

import math

import pytest
import torch

from stppo import metric_names as K
from test_algos_baselines import grad_of, one_row, run
from helpers.algos import (check_garbage_is_ignored, check_half_batches_sum_to_whole, check_one_line_error,
                                loop_agg, make_inputs)

AGGS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")
MODES = ("dppo_tv", "dppo_kl", "dro")


def inputs(n, t, seed, **kw):
    """`make_inputs` with log π ≤ −0.01: probabilities, as the binary divergences need."""
    x = make_inputs(n, t, seed=seed, dtype=torch.float64, **kw)
    x["log_probs"] = x["log_probs"].clamp(max=-0.01)
    return x


def probs_row(p, p_old, adv):
    """One trajectory whose sampled tokens have probabilities p (π_θ) and p_old (π_old)."""
    x = one_row([1.0] * len(p), adv)
    x["log_probs"] = torch.tensor([[math.log(v) for v in p]], dtype=torch.float64)
    x["old_log_probs"] = torch.tensor([[math.log(v) for v in p_old]], dtype=torch.float64)
    return x


def binary_kl(p_old, p):
    return p_old * math.log(p_old / p) + (1 - p_old) * math.log((1 - p_old + 1e-8) / (1 - p + 1e-8))


# --- hand-computed cases ---------------------------------------------------------------------
P, P_OLD, A = [0.7, 0.4, 0.1, 0.95], [0.5, 0.5, 0.2, 0.9], [1.0, -1.0, -1.0, 1.0]


@pytest.mark.parametrize("mode,delta", [("dppo_tv", 0.15), ("dppo_kl", 0.05)])
def test_dppo_hand_computed_mask_loss_gradient_and_metrics(mode, delta):
    # TV: p − p̂ = [0.2, −0.1, −0.1, 0.05]: token 0 (A > 0) leaves the region δ = 0.15.
    # KL: D = [0.0872, 0.0204, 0.0444, 0.0207]: token 0 moved up past δ = 0.05, the rest inside.
    if mode == "dppo_kl":
        assert binary_kl(0.5, 0.7) > delta and max(binary_kl(q, p) for q, p in
                                                     zip(P_OLD[1:], P[1:])) < delta
    x = probs_row(P, P_OLD, A)
    loss, g, m = grad_of(x, mode, clip_low=delta, clip_high=delta, options={"clip_ratio_c": 20.0})
    rho = [p / q for p, q in zip(P, P_OLD)]
    inside = [0.0, 1.0, 1.0, 1.0]
    s = [-mi * a * r * math.log(p) for mi, a, r, p in zip(inside, A, rho, P)]
    assert loss.item() == pytest.approx(sum(s) / 4)
    expect = [-mi * a * r / 4 for mi, a, r in zip(inside, A, rho)]
    assert torch.allclose(g, torch.tensor([expect], dtype=torch.float64))
    assert m[K.PG_CLIPFRAC_HIGH].item() == pytest.approx(0.25)
    assert m[K.PG_CLIPFRAC_LOW].item() == 0.0 and m[K.PG_CLIPFRAC_LOWER].item() == 0.0
    assert m[K.CLIP_BIAS_NORM].item() == pytest.approx(math.sqrt(1.4 ** 2 / 4))  # b = ρA, token 0
    assert m[K.PG_LOSS].item() == pytest.approx(loss.item())


def test_dppo_truncates_the_ratio_at_c_and_counts_it_as_verl():
    x = probs_row([0.6, 0.3], [0.2, 0.25], [-1.0, 1.0])  # ρ = 3, 1.2; TV region 0.5 holds both
    loss, g, m = grad_of(x, "dppo_tv", clip_low=0.5, clip_high=0.5, options={"clip_ratio_c": 2.0})
    assert torch.allclose(g, torch.tensor([[2.0 / 2, -1.2 / 2]], dtype=torch.float64))
    assert loss.item() == pytest.approx((2.0 * math.log(0.6) - 1.2 * math.log(0.3)) / 2)
    assert m[K.PG_CLIPFRAC_LOWER].item() == pytest.approx(0.5)  # ρ = 3 > C inside the region
    assert m[K.PG_CLIPFRAC].item() == 0.0
    assert m[K.CLIP_BIAS_NORM].item() == pytest.approx(math.sqrt((-3.0 + 2.0) ** 2 / 2))


def test_dppo_a_zero_advantage_token_counts_on_the_low_side_as_in_verl():
    x = probs_row([0.2, 0.5], [0.6, 0.5], [0.0, 1.0])  # token 0: A = 0, p − p̂ = −0.4 < −0.15
    _, g, m = grad_of(x, "dppo_tv", clip_low=0.15, clip_high=0.15)
    assert m[K.PG_CLIPFRAC_LOW].item() == pytest.approx(0.5) and g[0, 0].item() == 0.0


def test_dro_hand_computed_loss_gradient_and_metrics():
    x = one_row([1.5, 0.5, 1.0], [1.0, -2.0, 0.5])
    x["log_probs"] = x["log_probs"] - 1.0  # log π = log ρ − 1, log π_old = −1
    x["old_log_probs"] = x["old_log_probs"] - 1.0
    loss, g, m = grad_of(x, "dro", options={"beta": 0.5})
    d = [math.log(1.5), math.log(0.5), 0.0]
    lp = [v - 1.0 for v in d]
    a = [1.0, -2.0, 0.5]
    assert loss.item() == pytest.approx(sum(-(ai * li - 0.25 * di * di)
                                            for ai, li, di in zip(a, lp, d)) / 3)
    assert torch.allclose(g, torch.tensor([[(-ai + 0.5 * di) / 3 for ai, di in zip(a, d)]],
                                          dtype=torch.float64))
    b = [(r - 1) * ai + 0.5 * di for r, ai, di in zip((1.5, 0.5, 1.0), a, d)]
    assert m[K.CLIP_BIAS_NORM].item() == pytest.approx(math.sqrt(sum(v * v for v in b) / 3))
    assert m[K.PG_CLIPFRAC].item() == 0.0 and m[K.PPO_KL].item() == pytest.approx(-sum(d) / 3)


# --- a plain-loop reference -----------------------------------------------------------------------
def loop_loss(mode, lp, old, adv, mask, agg, low, high, cap=20.0, beta=0.05):
    n, t = mask.shape
    s = torch.zeros(n, t, dtype=lp.dtype)
    for i in range(n):
        for j in range(t):
            if not mask[i, j]:
                continue
            a, l, o = adv[i, j], lp[i, j], old[i, j]
            d = torch.clamp(l - o, -20, 20)
            if mode == "dro":
                s[i, j] = -(a * l - 0.5 * beta * d * d)
                continue
            p, q = math.exp(float(l)), math.exp(float(o))
            if mode == "dppo_tv":
                inside = p - q <= high if a > 0 else p - q >= -low
            else:
                kl = binary_kl(q, p)
                inside = (kl <= high or p <= q) if a > 0 else (kl <= low or p >= q)
            s[i, j] = -float(inside) * a * min(math.exp(float(d)), cap) * l
    return loop_agg(s, mask, agg)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("agg", AGGS)
def test_vectorised_equals_the_plain_loop(mode, agg):
    x = inputs(6, 14, 3, spread=0.5)
    low, high = (0.1, 0.08) if mode == "dppo_tv" else (0.02, 0.03)
    opts = {"beta": 0.3} if mode == "dro" else {"clip_ratio_c": 1.3}
    loss, m = run(x, mode, loss_agg=agg, clip_low=low, clip_high=high, options=opts)
    ref = loop_loss(mode, x["log_probs"], x["old_log_probs"], x["advantages"], x["loss_mask"], agg,
                    low, high, opts.get("clip_ratio_c", 20.0), opts.get("beta", 0.05))
    assert loss.item() == pytest.approx(ref.item(), rel=1e-12)
    if mode != "dro":
        assert 0 < m[K.PG_CLIPFRAC].item() < 1  # the regions bind here


# --- limiting cases ---------------------------------------------------------------------------
@pytest.mark.parametrize("agg", AGGS)
def test_at_ratio_one_the_new_modes_have_the_policy_gradient_of_ppo(agg):
    x = inputs(5, 12, 1)
    x["log_probs"] = x["old_log_probs"].clone()
    _, g_ppo, _ = grad_of(x, loss_agg=agg)
    for mode in MODES:
        _, g, _ = grad_of(x, mode, loss_agg=agg)
        assert torch.allclose(g, g_ppo, atol=1e-14), mode


@pytest.mark.parametrize("mode", ("dppo_tv", "dppo_kl"))
def test_dppo_with_an_unbounded_region_is_the_importance_sampling_gradient(mode):
    x = inputs(5, 12, 2, spread=0.6)
    _, g, m = grad_of(x, mode, clip_low=0.999, clip_high=1e6, options={"clip_ratio_c": 1e9})
    rho = (x["log_probs"] - x["old_log_probs"]).exp()
    want = torch.where(x["loss_mask"], -rho * x["advantages"], 0.0) / x["loss_mask"].sum()
    assert torch.allclose(g, want, atol=1e-15) and m[K.PG_CLIPFRAC].item() == 0.0
    assert m[K.CLIP_BIAS_NORM].item() == pytest.approx(0.0, abs=1e-15)


def test_dro_tends_to_the_plain_policy_gradient_as_beta_goes_to_zero():
    x = inputs(4, 10, 4, spread=0.5)
    _, g, _ = grad_of(x, "dro", options={"beta": 1e-12})
    want = torch.where(x["loss_mask"], -x["advantages"], 0.0) / x["loss_mask"].sum()
    assert torch.allclose(g, want, atol=1e-12)


# --- invariances and gradients --------------------------------------------------------------------
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("agg", AGGS)
def test_garbage_on_masked_positions_changes_neither_loss_nor_gradient(mode, agg):
    check_garbage_is_ignored(lambda d, **kw: grad_of(d, mode, **kw), inputs(6, 16, 6), agg)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("agg", AGGS)
def test_half_batches_with_global_denominators_sum_to_whole_batch(mode, agg):
    check_half_batches_sum_to_whole(lambda d, **kw: grad_of(d, mode, **kw), inputs(8, 14, 7), agg)


@pytest.mark.parametrize("mode", ("dppo_tv", "dppo_kl"))
def test_dppo_gradient_is_the_stop_gradient_closed_form(mode):
    """DPPO's loss value holds sg(min(ρ, C)) log π with a detached mask, so finite differences
    (gradcheck) see ∂ρ and the mask's jumps too: the gradient is −m A min(ρ, C) w instead."""
    from stppo.algos import agg_weights
    from stppo.algos.baselines import binary_kl_mask, binary_tv_mask

    x = inputs(4, 10, 8, spread=0.6)
    _, g, _ = grad_of(x, mode, clip_low=0.1, clip_high=0.05, loss_agg="seq-mean-token-mean",
                      options={"clip_ratio_c": 1.5})
    fn = binary_tv_mask if mode == "dppo_tv" else binary_kl_mask
    inside = fn(x["log_probs"], x["old_log_probs"], x["advantages"], 0.1, 0.05)
    rho = (x["log_probs"] - x["old_log_probs"]).exp().clamp(max=1.5)
    w = agg_weights(x["loss_mask"], "seq-mean-token-mean", dtype=torch.float64)
    want = torch.where(x["loss_mask"] & inside, -rho * x["advantages"] * w, 0.0)
    assert torch.allclose(g, want, atol=1e-15) and not inside[x["loss_mask"]].all()


def test_dro_gradcheck_float64():
    x = inputs(3, 8, 8)
    assert torch.autograd.gradcheck(lambda lp: run(x, "dro", lp=lp, options={"beta": 0.7})[0],
                                    (x["log_probs"].clone().requires_grad_(True),))


# --- options --------------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, match", [
    (dict(loss_mode="dppo_tv", options={"clip_ratio_c": 0.0}), "clip_ratio_c must be > 0"),
    (dict(loss_mode="dppo_kl", options={"beta": 1.0}), "no option.s. beta; valid: clip_ratio_c"),
    (dict(loss_mode="dro", options={"beta": -1.0}), "beta must be > 0"),
    (dict(loss_mode="dro", dual_clip=3.0), "has no dual clip"),
    (dict(loss_mode="dppo_tv", ratio_level="turn"), "defined at ratio_level token, got 'turn'"),
])
def test_invalid_options_are_one_line_errors(kwargs, match):
    check_one_line_error(match, **kwargs)
