"""The baseline losses (stppo.algos.baselines): hand-computed cases, limiting cases against the
clip path, mask invariance, split batches, gradcheck and option errors (docs/design.md §2).
Equality with verl's own functions: tests/verl/test_baselines_vs_verl.py."""

import math

import pytest
import torch

from stppo import metric_names as K
from stppo.algos import PRESETS, sapo_gate
from keyword_loss import policy_loss
from helpers.algos import (check_garbage_is_ignored, check_half_batches_sum_to_whole, check_one_line_error,
                                make_inputs)

MODES = ("cispo", "gmpo", "sapo", "clip_cov", "kl_cov", "bapo")
AGGS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")
LEVEL = {"gmpo": "sequence"}


def run(x, mode="clip", lp=None, seed=0, **kw):
    kw = {"clip_low": 0.2, "clip_high": 0.2, "ratio_level": LEVEL.get(mode, "token"),
          "loss_agg": "token-mean", "loss_mode": mode, **kw}
    torch.manual_seed(seed)  # clip_cov's draw
    return policy_loss(x["log_probs"] if lp is None else lp, x["old_log_probs"], x["advantages"],
                       x["loss_mask"], x["turn_ids"], **kw)


def grad_of(x, mode="clip", **kw):
    lp = x["log_probs"].detach().clone().requires_grad_(True)
    loss, m = run(x, mode, lp=lp, **kw)
    loss.backward()
    return loss.detach(), lp.grad, m


def one_row(rho, adv, mask=None):
    rho = torch.tensor([rho], dtype=torch.float64)
    t = rho.shape[1]
    return dict(log_probs=rho.log(), old_log_probs=torch.zeros_like(rho),
                advantages=torch.tensor([adv], dtype=torch.float64),
                loss_mask=torch.ones(1, t, dtype=torch.bool) if mask is None else mask,
                turn_ids=torch.zeros(1, t, dtype=torch.long))


# --- hand-computed cases ---------------------------------------------------------------------
def test_cispo_hand_computed_loss_gradient_and_metrics():
    x = one_row([1.5, 0.5, 1.1, 0.7], [1.0, -1.0, -1.0, 2.0])
    loss, g, m = grad_of(x, "cispo")
    w = [1.2, 0.8, 1.1, 0.8]  # sg(clip(ρ, 0.8, 1.2))
    lp = [math.log(r) for r in (1.5, 0.5, 1.1, 0.7)]
    a = [1.0, -1.0, -1.0, 2.0]
    assert loss.item() == pytest.approx(-sum(wi * ai * li for wi, ai, li in zip(w, a, lp)) / 4)
    assert torch.allclose(g, torch.tensor([[-wi * ai / 4 for wi, ai in zip(w, a)]],
                                          dtype=torch.float64))
    assert m[K.PG_CLIPFRAC_HIGH].item() == pytest.approx(0.25)  # ρ = 1.5
    assert m[K.PG_CLIPFRAC_LOW].item() == pytest.approx(0.5)  # ρ = 0.5, 0.7, whatever sign of A
    assert m[K.CLIP_BIAS_NORM].item() == pytest.approx(math.sqrt((0.09 + 0.09 + 0.04) / 4))
    assert m[K.PG_LOSS].item() == pytest.approx(loss.item())


def test_sapo_hand_computed_loss_and_gradient():
    x = one_row([1.5, 0.5, 1.0], [1.0, -1.0, 0.0])
    loss, g, m = grad_of(x, "sapo", options={"tau_pos": 2.0, "tau_neg": 3.0})
    sig = lambda z: 1.0 / (1.0 + math.exp(-z))  # noqa: E731
    f1, f2 = sig(2.0 * 0.5) * 4 / 2.0, sig(3.0 * -0.5) * 4 / 3.0  # A = 0 takes τ_neg: no effect
    assert loss.item() == pytest.approx((-f1 * 1.0 + f2 * 1.0) / 3)
    s1, s2 = sig(1.0), sig(-1.5)
    expect = [-4 * s1 * (1 - s1) * 1.5 / 3, 4 * s2 * (1 - s2) * 0.5 / 3, 0.0]
    assert torch.allclose(g, torch.tensor([expect], dtype=torch.float64))
    assert m[K.PG_CLIPFRAC].item() == 0.0
    b = [1.5 * (1 - 4 * s1 * (1 - s1)), -0.5 * (1 - 4 * s2 * (1 - s2)), 0.0]
    assert m[K.CLIP_BIAS_NORM].item() == pytest.approx(math.sqrt(sum(v * v for v in b) / 3))


def test_gmpo_hand_computed_two_trajectories():
    mask = torch.tensor([[True, True, False, True], [True, False, False, False]])
    x = one_row([math.exp(0.1), math.exp(0.6), 7.0, math.exp(-0.1)], [1.0, 1.0, 9.0, 1.0], mask)
    x = {k: torch.cat([v, v]) for k, v in x.items()}
    x["loss_mask"] = mask
    x["advantages"][1] = -2.0
    x["log_probs"][1, 0] = -0.7  # A < 0, δ = −0.7 < −0.4: clipped to −0.4
    loss, g, m = grad_of(x, "gmpo", clip_low=0.4, clip_high=0.4, loss_agg="seq-mean-token-mean")
    r1 = math.exp((0.1 + 0.4 - 0.1) / 3)  # δ = 0.6 with A > 0 clipped to 0.4
    r2 = math.exp(-0.4)
    assert loss.item() == pytest.approx((-1.0 * r1 + 2.0 * r2) / 2)
    # ∂/∂δ_t of −Ā ρ̄ / 2 = −Ā ρ̄ / (2 |y|) on unclipped tokens, 0 on clipped ones
    expect = [[-r1 / 6, 0.0, 0.0, -r1 / 6], [0.0, 0.0, 0.0, 0.0]]
    assert torch.allclose(g, torch.tensor(expect, dtype=torch.float64))
    assert m[K.PG_CLIPFRAC_HIGH].item() == pytest.approx(1 / 4)
    assert m[K.PG_CLIPFRAC_LOW].item() == pytest.approx(1 / 4)
    assert m[K.RATIO_MEAN].item() == pytest.approx((3 * r1 + r2) / 4)


def test_kl_cov_penalises_the_largest_covariance_token():
    x = one_row([1.2, 0.9, 1.0, 1.1], [2.0, -1.0, 0.0, 0.5])
    x["log_probs"] = x["log_probs"] + torch.tensor([[-0.1, -2.0, -1.0, -0.5]], dtype=torch.float64)
    x["old_log_probs"] = x["old_log_probs"] + torch.tensor([[-0.1, -2.0, -1.0, -0.5]],
                                                           dtype=torch.float64)
    loss, g, m = grad_of(x, "kl_cov", options={"kl_cov_ratio": 0.25, "ppo_kl_coef": 0.5})
    lp = x["log_probs"][0].tolist()
    a = [2.0, -1.0, 0.0, 0.5]
    ma, ml = sum(a) / 4, sum(lp) / 4
    cov = [(ai - ma) * (li - ml) for ai, li in zip(a, lp)]
    top = max(range(4), key=lambda i: cov[i])
    rho = [1.2, 0.9, 1.0, 1.1]
    s = [-ai * ri for ai, ri in zip(a, rho)]
    s[top] += 0.5 * abs(math.log(rho[top]))
    assert loss.item() == pytest.approx(sum(s) / 4)
    expect = [-ai * ri / 4 for ai, ri in zip(a, rho)]
    expect[top] += 0.5 * math.copysign(1.0, math.log(rho[top])) / 4
    assert torch.allclose(g, torch.tensor([expect], dtype=torch.float64))
    assert m[K.COV_SELECTED_FRAC].item() == pytest.approx(0.25)


def test_clip_cov_detaches_a_candidate_and_only_a_candidate():
    # Cov_t = (A_t − Ā)(log π_t − mean log π) = [1.5, 0.3, 0, 0]: only token 0 is in (1, 5)
    x = one_row([1.0, 1.0, 1.0, 1.0], [2.0, -1.0, 0.5, 0.5])
    x["log_probs"] = torch.tensor([[1.0, -0.2, 0.1, -0.9]], dtype=torch.float64)  # mean 0
    x["old_log_probs"] = x["log_probs"].clone()
    loss, g, m = grad_of(x, "clip_cov", options={"clip_cov_ratio": 0.25})
    assert g[0, 0].item() == 0.0 and m[K.COV_SELECTED_FRAC].item() == pytest.approx(0.25)
    assert torch.allclose(g[0, 1:], torch.tensor([1.0, -0.5, -0.5], dtype=torch.float64) / 4)
    assert loss.item() == pytest.approx((0.0 + 1.0 - 0.5 - 0.5) / 4)


# --- BAPO (no verl reference: hand cases and a literal Algorithm 1) ---------------------------
def test_bapo_raises_c_high_until_the_positive_share_reaches_rho0():
    x = one_row([2.0, 1.0], [1.0, -2.0])
    loss, g, m = grad_of(x, "bapo", clip_low=0.4, clip_high=0.2)
    # c_high = 1.2: P/(P+N) = 1.2/3.2 = .375; 1.25: .385; 1.3: .394; 1.35: 1.35/3.35 = .403 ≥ .4
    assert m[K.BAPO_CLIP_HIGH].item() == pytest.approx(1.35)
    assert m[K.BAPO_CLIP_LOW].item() == pytest.approx(0.6)
    assert m[K.BAPO_POS_SHARE].item() == pytest.approx(1.35 / 3.35)
    assert loss.item() == pytest.approx((-1.35 + 2.0) / 2)  # token 0 clipped at 1.35
    assert torch.allclose(g, torch.tensor([[0.0, 1.0]], dtype=torch.float64))
    assert m[K.PG_CLIPFRAC_HIGH].item() == pytest.approx(0.5)


def test_bapo_ends_at_the_last_state_when_rho0_is_out_of_reach():
    x = one_row([2.0, 0.5], [1.0, -10.0])
    _, _, m = grad_of(x, "bapo", clip_low=0.4, clip_high=0.2)
    assert m[K.BAPO_CLIP_HIGH].item() == pytest.approx(3.0)  # a⁺ + 36 δ₁ = b⁺
    assert m[K.BAPO_CLIP_LOW].item() == pytest.approx(0.9)  # then a⁻ + 15 δ₂ = b⁻
    assert m[K.BAPO_POS_SHARE].item() == pytest.approx(2.0 / (2.0 + 9.0))


def test_bapo_schedule_is_algorithm_1():
    from stppo.algos import bapo_schedule

    opts = dict(PRESETS["bapo"].options)
    s = bapo_schedule(0.6, 1.2, opts)
    assert len(s) == 1 + 36 + 15 and s[0] == (0.6, 1.2)
    assert s[36] == pytest.approx((0.6, 3.0)) and s[-1] == pytest.approx((0.9, 3.0))
    assert bapo_schedule(0.6, 1.2, {**opts, "lower_max": 0.61}) == [(0.6, 1.2)]  # c_low stuck


def literal_algorithm_1(rho, adv, w, a_lo, a_hi, o):
    """Algorithm 1 of arXiv 2510.18927 as written: a while loop over Python floats."""
    def share(c_lo, c_hi):
        p = sum(wi * min(r, c_hi) * a for r, a, wi in zip(rho, adv, w) if a > 0)
        n = sum(wi * max(r, c_lo) * -a for r, a, wi in zip(rho, adv, w) if a < 0)
        return 1.0 if p + n == 0 else p / (p + n)
    c_lo, c_hi, tol = a_lo, a_hi, 1e-9
    while share(c_lo, c_hi) < o["rho0"] and c_lo + o["lower_step"] <= o["lower_max"] + tol:
        if c_hi + o["upper_step"] <= o["upper_max"] + tol:
            c_hi += o["upper_step"]
        else:
            c_lo += o["lower_step"]
    return c_lo, c_hi


@pytest.mark.parametrize("seed", range(6))
def test_bapo_vectorised_search_equals_the_literal_loop(seed):
    x = make_inputs(5, 12, seed=seed, spread=0.8, dtype=torch.float64)
    x["advantages"] = x["advantages"] - 0.3 * (seed % 3)  # push toward negative dominance
    _, _, m = grad_of(x, "bapo", clip_low=0.4, clip_high=0.2)
    mask = x["loss_mask"]
    rho = (x["log_probs"] - x["old_log_probs"])[mask].exp().tolist()
    adv = x["advantages"][mask].tolist()
    lo, hi = literal_algorithm_1(rho, adv, [1.0] * len(rho), 0.6, 1.2,
                                 dict(PRESETS["bapo"].options))
    assert m[K.BAPO_CLIP_LOW].item() == pytest.approx(lo)
    assert m[K.BAPO_CLIP_HIGH].item() == pytest.approx(hi)
    # the loss is the clip path's at the chosen bounds (whose `surrogate_parts` forms the bound
    # 1 ± ε of Python floats with torch.where, in float32: agreement to ~1e-8 in float64)
    ref, _ = run(x, "clip", clip_low=1 - lo, clip_high=hi - 1)
    got, _ = run(x, "bapo", clip_low=0.4, clip_high=0.2)
    assert got.item() == pytest.approx(ref.item(), abs=1e-7)


# --- limiting cases against the clip path --------------------------------------------------------
@pytest.mark.parametrize("agg", AGGS)
def test_at_ratio_one_every_mode_has_the_policy_gradient_of_ppo(agg):
    x = make_inputs(5, 12, seed=1, dtype=torch.float64)
    x["log_probs"] = x["old_log_probs"].clone()
    _, g_ppo, _ = grad_of(x, loss_agg=agg)
    for mode in ("cispo", "sapo", "bapo", "kl_cov", "clip_cov"):
        opts = {"clip_cov_lb": 1e8, "clip_cov_ub": 1e9} if mode == "clip_cov" else None
        opts = {"kl_cov_ratio": 1e-6, "ppo_kl_coef": 0.0} if mode == "kl_cov" else opts
        _, g, _ = grad_of(x, mode, loss_agg=agg, options=opts)
        assert torch.allclose(g, g_ppo, atol=1e-14), mode


def test_sapo_tends_to_the_unclipped_gradient_as_tau_goes_to_zero_and_to_zero_as_tau_grows():
    x = make_inputs(4, 10, seed=2, spread=0.5, dtype=torch.float64)
    unclipped = torch.where(x["loss_mask"], -(x["log_probs"] - x["old_log_probs"]).exp()
                            * x["advantages"], 0.0) / x["loss_mask"].sum()
    _, g_small, _ = grad_of(x, "sapo", options={"tau_pos": 1e-4, "tau_neg": 1e-4})
    assert torch.allclose(g_small, unclipped, atol=1e-8)
    _, g_big, _ = grad_of(x, "sapo", options={"tau_pos": 1e5, "tau_neg": 1e5})
    assert g_big.abs().max().item() < 1e-12
    assert sapo_gate(torch.tensor(1.0), torch.tensor(2.0)).item() == pytest.approx(1.0)


def test_gmpo_without_clipping_is_the_sequence_ratio_clip_path():
    x = make_inputs(5, 12, seed=3, spread=0.05, dtype=torch.float64)  # |δ| ≪ 0.4: nothing clips
    a, g_a, _ = grad_of(x, "gmpo", clip_low=0.4, clip_high=0.4, loss_agg="seq-mean-token-mean")
    b, g_b, _ = grad_of(x, ratio_level="sequence", clip_low=0.9, clip_high=10.0,
                        loss_agg="seq-mean-token-mean")
    assert a.item() == pytest.approx(b.item(), rel=1e-12)
    assert torch.allclose(g_a, g_b, atol=1e-14)


def test_gmpo_on_one_token_trajectories_is_token_ppo_with_log_space_bounds():
    x = one_row([1.6, 0.5, 1.1, 0.7, 1.3], [1.0, -1.0, -1.0, 2.0, -0.5])
    x = {k: v.reshape(5, 1) for k, v in x.items()}
    a, g_a, _ = grad_of(x, "gmpo", clip_low=0.3, clip_high=0.2, loss_agg="seq-mean-token-mean")
    b, g_b, _ = grad_of(x, clip_low=1 - math.exp(-0.3), clip_high=math.exp(0.2) - 1,
                        loss_agg="seq-mean-token-mean")
    assert a.item() == pytest.approx(b.item(), abs=1e-7)  # the clip path's bound is float32
    assert torch.allclose(g_a, g_b, atol=1e-14)


def test_bapo_met_at_the_start_is_the_clip_path():
    x = make_inputs(5, 12, seed=4, dtype=torch.float64)
    x["advantages"] = x["advantages"].abs()  # only positive advantages: share 1 at once
    a, g_a, m = grad_of(x, "bapo", clip_low=0.3, clip_high=0.25, dual_clip=3.0)
    b, g_b, _ = grad_of(x, clip_low=0.3, clip_high=0.25, dual_clip=3.0)
    assert m[K.BAPO_CLIP_HIGH].item() == pytest.approx(1.25)
    assert a.item() == pytest.approx(b.item(), rel=1e-12) and torch.allclose(g_a, g_b, atol=1e-14)


def test_truncated_is_weights_on_the_clip_path_scale_each_token_term():
    x = make_inputs(5, 12, seed=5, dtype=torch.float64)
    ones = torch.ones_like(x["advantages"])
    for level in ("token", "turn", "sequence"):
        a, _ = run(x, ratio_level=level)
        b, _ = run(x, ratio_level=level, rollout_is_weights=ones)
        assert a.item() == b.item()  # ω ≡ 1: the same loss, bit for bit
        c, _ = run(x, ratio_level=level, rollout_is_weights=2.5 * ones)
        assert c.item() == pytest.approx(2.5 * a.item(), rel=1e-12)
    from stppo.algos import agg_loss, clipped_surrogate

    omega = 0.5 + torch.rand(x["advantages"].shape, dtype=torch.float64,
                             generator=torch.Generator().manual_seed(0))
    rho = (x["log_probs"] - x["old_log_probs"]).exp()
    s = clipped_surrogate(rho, torch.where(x["loss_mask"], x["advantages"], 0.0), 0.2, 0.2).loss
    ref = agg_loss(omega * s, x["loss_mask"], "token-mean")
    got, _ = run(x, rollout_is_weights=omega)
    assert got.item() == pytest.approx(ref.item(), rel=1e-12)


# --- invariances --------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("agg", AGGS)
def test_garbage_on_masked_positions_changes_neither_loss_nor_gradient(mode, agg):
    check_garbage_is_ignored(lambda d, **kw: grad_of(d, mode, **kw), make_inputs(6, 16, seed=6, dtype=torch.float64), agg)


@pytest.mark.parametrize("mode", ("cispo", "sapo", "gmpo"))
@pytest.mark.parametrize("agg", AGGS)
def test_half_batches_with_global_denominators_sum_to_whole_batch(mode, agg):
    check_half_batches_sum_to_whole(lambda d, **kw: grad_of(d, mode, **kw), make_inputs(8, 14, seed=7, dtype=torch.float64), agg)


def test_cispo_gradient_is_the_stop_gradient_closed_form():
    """CISPO's loss value holds sg(ρ̂) log π, so finite differences (gradcheck) see ∂ρ̂ too: its
    gradient is checked against −ρ̂ A w instead."""
    x = make_inputs(4, 10, seed=8, spread=0.6, dtype=torch.float64)
    _, g, _ = grad_of(x, "cispo", clip_low=0.3, clip_high=0.25, loss_agg="seq-mean-token-mean")
    from stppo.algos import agg_weights

    rho_hat = (x["log_probs"] - x["old_log_probs"]).exp().clamp(0.7, 1.25)
    w = agg_weights(x["loss_mask"], "seq-mean-token-mean", dtype=torch.float64)
    assert torch.allclose(g, torch.where(x["loss_mask"], -rho_hat * x["advantages"] * w, 0.0),
                          atol=1e-15)


@pytest.mark.parametrize("mode", ("sapo", "gmpo", "kl_cov", "bapo"))
def test_gradcheck_float64(mode):
    x = make_inputs(3, 8, seed=8, dtype=torch.float64)

    def f(lp):
        return run(x, mode, lp=lp)[0]
    assert torch.autograd.gradcheck(f, (x["log_probs"].clone().requires_grad_(True),))


def test_empty_batches_give_zero_loss_and_finite_metrics():
    x = make_inputs(3, 8, seed=9, dtype=torch.float64)
    x["loss_mask"] = torch.zeros_like(x["loss_mask"])
    for mode in MODES:
        loss, m = run(x, mode)
        assert loss.item() == 0.0, mode
        assert all(torch.isfinite(v) for v in m.values()), mode


# --- options and argument errors ----------------------------------------------------------------
@pytest.mark.parametrize("kwargs, match", [
    (dict(loss_mode="nope"), "loss_mode='nope' is not valid; allowed: clip, cispo, gmpo, sapo"),
    (dict(loss_mode="sapo", options={"tau": 1.0}), "no option.s. tau; valid: tau_pos, tau_neg"),
    (dict(loss_mode="cispo", options={"tau_pos": 1.0}), "no option.s. tau_pos; valid: none"),
    (dict(loss_mode="sapo", options={"tau_pos": "x"}), "option tau_pos must be a number"),
    (dict(loss_mode="sapo", options={"tau_neg": 0.0}), "tau_neg must be > 0"),
    (dict(loss_mode="cispo", ratio_level="turn"), "defined at ratio_level token, got 'turn'"),
    (dict(loss_mode="gmpo"), "defined at ratio_level sequence, got 'token'"),
    (dict(loss_mode="cispo", clip_bias={"kind": "clip_bias_norm"}), "takes no clip-bias scale"),
    (dict(loss_mode="sapo", dual_clip=3.0), "has no dual clip"),
    (dict(loss_mode="bapo", options={"rho0": 1.5}), "rho0 must be in .0, 1."),
    (dict(loss_mode="clip_cov", options={"clip_cov_lb": 6.0}), "clip_cov_lb must be < clip_cov_ub"),
    (dict(options={"x": 1.0}), "loss_mode='clip' has no option.s. x"),
])
def test_invalid_modes_and_options_are_one_line_errors(kwargs, match):
    check_one_line_error(match, **kwargs)


def test_rollout_is_weights_must_match_the_tensors():
    x = make_inputs(2, 6, seed=0)
    with pytest.raises(ValueError, match="rollout_is_weights has shape"):
        run(x, rollout_is_weights=torch.ones(2, 5))


# --- presets ------------------------------------------------------------------------------------
def test_baseline_presets_match_the_design_table_and_their_conf_files():
    from stppo.config import CONF_DIR, compose, to_config

    table = {  # preset: (ratio, loss_mode, advantage, loss_agg, clip_low, clip_high) — §2
        "dapo": ("token", "clip", "grpo", "token-mean", 0.2, 0.28),
        "cispo": ("token", "cispo", "grpo", "token-mean", 0.99, 0.28),
        "gmpo": ("sequence", "gmpo", "grpo", "seq-mean-token-mean", 0.4, 0.4),
        "sapo": ("token", "sapo", "grpo", "seq-mean-token-mean", 0.2, 0.2),
        "clip_cov": ("token", "clip_cov", "grpo", "token-mean", 0.2, 0.2),
        "kl_cov": ("token", "kl_cov", "grpo", "token-mean", 0.2, 0.2),
        "bapo": ("token", "bapo", "grpo", "token-mean", 0.4, 0.2),
        "rloo": ("token", "clip", "rloo", "seq-mean-token-mean", 0.2, 0.2),
        "reinforce_pp": ("token", "clip", "reinforce_pp", "seq-mean-token-mean", 0.2, 0.2),
        "dppo_tv": ("token", "dppo_tv", "grpo", "token-mean", 0.15, 0.15),
        "dppo_kl": ("token", "dppo_kl", "grpo", "token-mean", 0.05, 0.05),
        "dro": ("token", "dro", "grpo", "token-mean", 0.2, 0.2),
        "sspo": ("token", "sspo", "grpo", "seq-mean-token-mean", 0.2, 0.2),
        "tir_optimal_token_baseline": ("token", "clip", "tir_optimal_token_baseline", "token-mean",
                                       0.2, 0.2),
    }
    assert list(PRESETS)[8:] == list(table)
    for name, row in table.items():
        p = PRESETS[name]
        assert (p.ratio_level, p.loss_mode, p.advantage, p.loss_agg, p.clip_low,
                p.clip_high) == row
        assert not p.use_critic and p.clip_bias == "none"
        a = to_config(compose([f"algo={name}"])).algo  # the run's config takes the preset's values
        assert a.spec == p.spec() and a.loss_options == dict(p.options)
        assert (a.ratio_level, a.loss_mode, a.advantage, a.loss_agg, a.use_critic, a.clip_low,
                a.clip_high) == (p.ratio_level, p.loss_mode, p.advantage, p.loss_agg,
                                 p.use_critic, p.clip_low, p.clip_high)
        assert (a.dynamic_sampling.enabled, a.overlong.enabled) == (p.dynamic_sampling,
                                                                    p.overlong)
        first = (CONF_DIR / "algo" / f"{name}.yaml").read_text().splitlines()[0]
        # the optimal token baseline has no paper: verl's docs and a blog
        source = "docs/algo/otb.md" if name == "tir_optimal_token_baseline" else "arXiv"
        assert first.startswith("# ") and source in first, name  # what it is and its source
    assert PRESETS["dapo"].dynamic_sampling and PRESETS["dapo"].overlong
    assert dict(PRESETS["sapo"].options) == {"tau_pos": 1.0, "tau_neg": 1.05}
    assert dict(PRESETS["bapo"].options) == {"rho0": 0.4, "lower_max": 0.9, "upper_max": 3.0,
                                             "lower_step": 0.02, "upper_step": 0.05}
    assert dict(PRESETS["dppo_tv"].options) == dict(PRESETS["dppo_kl"].options) == {
        "clip_ratio_c": 20.0}
    assert dict(PRESETS["dro"].options) == {"beta": 0.05}
    assert dict(PRESETS["sspo"].options) == {"entropy_alpha": 1.0, "scale_min": 0.5,
                                             "scale_max": 2.0}


def test_every_preset_spec_makes_a_valid_policy_loss_call():
    from stppo.algos import policy_loss as spec_loss

    x = make_inputs(3, 8, seed=0, dtype=torch.float64)
    segments = torch.where(x["loss_mask"], torch.arange(8) // 2, -1)  # subsentences of 2 (SSPO)
    for name in PRESETS:
        out = spec_loss(x["log_probs"], x["old_log_probs"], x["advantages"], x["loss_mask"],
                        x["turn_ids"], PRESETS[name].spec(), segment_ids=segments)
        assert torch.isfinite(out.loss), name
        assert out.ratio.shape == out.clipped.shape == x["log_probs"].shape
    assert PRESETS["sapo"].spec(clip_high=0.3).clip_high == 0.3
    with pytest.raises(TypeError):
        PRESETS["cispo"].spec(nope=1)


@pytest.mark.parametrize("mode", ("bapo", "cispo", "sapo"))
def test_reduce_makes_batch_statistics_those_of_every_shard(mode):
    """Two identical shards: with global denominators and reduce = 2·(this shard's sums), each
    shard's loss is half the whole batch's and BAPO's bounds and clip_bias/norm are the whole's."""
    from stppo.algos import agg_denoms

    x = make_inputs(5, 12, seed=11, spread=0.6, dtype=torch.float64)
    opts = {"rho0": 0.317} if mode == "bapo" else None  # BAPO stops at c_high = 1.4 here
    whole = {k: torch.cat([v, v]) for k, v in x.items()}
    a, g_a, m_a = grad_of(whole, mode, clip_low=0.4, clip_high=0.2, options=opts)
    b, g_b, m_b = grad_of(x, mode, clip_low=0.4, clip_high=0.2, options=opts,
                          global_denoms=agg_denoms(whole["loss_mask"]), reduce=lambda t: 2 * t)
    assert mode != "bapo" or m_a[K.BAPO_CLIP_HIGH].item() == pytest.approx(1.4)
    assert b.item() == pytest.approx(a.item() / 2, rel=1e-12)
    assert torch.allclose(torch.cat([g_b, g_b]), g_a, atol=1e-15)
    for k in (K.CLIP_BIAS_NORM, K.BAPO_CLIP_LOW, K.BAPO_CLIP_HIGH, K.BAPO_POS_SHARE):
        if k in m_a:
            assert m_b[k].item() == pytest.approx(m_a[k].item(), rel=1e-12), k
