"""SSPO (stppo.algos.baselines.sspo) and its subsentences (stppo.algos.segments.subsentence_ids):
hand-computed cases, the rule that a subsentence never crosses a turn or an observation, a
plain-loop reference, limiting cases against the clip path, mask invariance, split batches,
gradcheck and option errors (docs/design.md §2). SSPO has no verl reference."""

import math

import pytest
import torch

from stppo import metric_names as K
from stppo.algos.segments import subsentence_ids, subsentence_runs
from keyword_loss import policy_loss
from helpers.algos import check_garbage_is_ignored, check_half_batches_sum_to_whole, loop_agg, make_inputs

AGGS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")


def delimiters(x, seed=0, share=0.3):
    """Random subsentence ends (N, T) bool, garbage-free: any position may hold one."""
    g = torch.Generator().manual_seed(seed)
    return torch.rand(x["loss_mask"].shape, generator=g) < share


def run(x, ends, lp=None, **kw):
    kw = {"clip_low": 0.2, "clip_high": 0.2, "loss_agg": "token-mean", "loss_mode": "sspo", **kw}
    seg = subsentence_ids(ends, x["loss_mask"], x["turn_ids"])
    return policy_loss(x["log_probs"] if lp is None else lp, x["old_log_probs"], x["advantages"],
                       x["loss_mask"], x["turn_ids"], segment_ids=seg, **kw)


def grad_of(x, ends, **kw):
    lp = x["log_probs"].detach().clone().requires_grad_(True)
    loss, m = run(x, ends, lp=lp, **kw)
    loss.backward()
    return loss.detach(), lp.grad, m


# --- subsentences -------------------------------------------------------------------------------
def loop_subsentences(ends, mask, turns):
    """Subsentence ids by walking each row token by token."""
    out = torch.full(mask.shape, -1, dtype=torch.long)
    for i in range(mask.shape[0]):
        k, open_run = -1, False
        for t in range(mask.shape[1]):
            if not mask[i, t]:
                open_run = False
                continue
            if not open_run or turns[i, t] != turns[i, t - 1] or ends[i, t - 1]:
                k += 1
            out[i, t], open_run = k, True
    return out


def test_subsentences_hand_computed_turns_observations_and_delimiters():
    mask = torch.tensor([[0, 1, 1, 1, 1, 0, 0, 1, 1, 1, 1, 0]], dtype=torch.bool)
    turns = torch.tensor([[-1, 0, 0, 0, 0, -1, -1, 1, 1, 2, 2, -1]])
    ends = torch.tensor([[0, 0, 1, 0, 0, 1, 0, 0, 1, 0, 1, 0]], dtype=torch.bool)
    # turn 0: "a ." | "b c" (a gap after), turn 1: "d ." (the delimiter closes it), turn 2: "e f."
    assert subsentence_ids(ends, mask, turns).tolist() == [[-1, 0, 0, 1, 1, -1, -1, 2, 2, 3, 3, -1]]
    # turns 1 and 2 touch: the turn boundary splits them even without a delimiter
    assert subsentence_ids(torch.zeros_like(ends), mask, turns).tolist() == [
        [-1, 0, 0, 0, 0, -1, -1, 1, 1, 2, 2, -1]]


@pytest.mark.parametrize("seed", range(4))
def test_subsentences_equal_a_loop_and_never_cross_a_turn(seed):
    x = make_inputs(7, 30, seed=seed, max_turns=5)
    ends = delimiters(x, seed)
    got = subsentence_ids(ends, x["loss_mask"], x["turn_ids"])
    assert torch.equal(got, loop_subsentences(ends, x["loss_mask"], x["turn_ids"]))
    for i in range(7):
        for k in set(got[i][x["loss_mask"][i]].tolist()):
            assert len(set(x["turn_ids"][i][got[i] == k].tolist())) == 1
    assert torch.equal(subsentence_runs(got, x["loss_mask"], x["turn_ids"]), got)  # canonical


def test_labels_crossing_a_turn_or_an_observation_are_split():
    mask = torch.tensor([[1, 1, 1, 0, 1, 1]], dtype=torch.bool)
    turns = torch.tensor([[0, 0, 1, -1, 1, 1]])
    same = torch.zeros(1, 6, dtype=torch.long)  # one label everywhere
    assert subsentence_runs(same, mask, turns).tolist() == [[0, 0, 1, -1, 2, 2]]


# --- hand-computed cases ---------------------------------------------------------------------
def hand_row(adv):
    """One turn of 4 tokens, a delimiter at token 1: subsentences {0, 1}, {2, 3}. −log π_old =
    [1, 1, 3, 3]: H = 1 and 3 against H̄ = 2, so w = 0.5 and 1.5 (α = 1). δ = [0.2, 0, 0.2, 0.2]:
    ρ₁ = e^0.1, ρ₂ = e^0.2."""
    old = torch.tensor([[-1.0, -1.0, -3.0, -3.0]], dtype=torch.float64)
    x = dict(old_log_probs=old, log_probs=old + torch.tensor([[0.2, 0.0, 0.2, 0.2]],
                                                              dtype=torch.float64),
             advantages=torch.tensor([adv], dtype=torch.float64),
             loss_mask=torch.ones(1, 4, dtype=torch.bool), turn_ids=torch.zeros(1, 4, dtype=torch.long))
    return x, torch.tensor([[False, True, False, False]])


def test_sspo_hand_computed_entropy_scaled_bounds():
    x, ends = hand_row([1.0, 1.0, 1.0, 2.0])
    r1, r2 = math.exp(0.1), math.exp(0.2)
    loss, g, m = grad_of(x, ends)
    # subsentence 1: bounds [0.9, 1.1], ρ₁ = 1.105 > 1.1 with A > 0: clipped at 1.1;
    # subsentence 2: bounds [0.7, 1.3], ρ₂ = 1.221: unclipped
    assert loss.item() == pytest.approx((-1.1 - 1.1 - r2 - 2 * r2) / 4)
    # ∂L/∂δ_t = ρ_s Σ_{t'∈s} (−A_t' w_t') / |s| on the unclipped subsentence, 0 on the clipped one
    assert torch.allclose(g, torch.tensor([[0.0, 0.0, -3 * r2 / 8, -3 * r2 / 8]], dtype=torch.float64))
    assert m[K.PG_CLIPFRAC_HIGH].item() == pytest.approx(0.5)
    assert m[K.RATIO_MEAN].item() == pytest.approx((2 * r1 + 2 * r2) / 4)
    assert m[K.CLIP_BIAS_NORM].item() == pytest.approx(math.sqrt(2 * r1 ** 2 / 4))  # κ ρ A
    assert m[K.SSPO_CLIP_SCALE_STD].item() == pytest.approx(0.5)  # w = [0.5, 0.5, 1.5, 1.5]
    assert m[K.SSPO_SUBSENTENCE_LENGTH].item() == pytest.approx(2.0)


def test_without_entropy_scaling_the_clip_moves_to_the_other_subsentence():
    x, ends = hand_row([1.0, 1.0, 1.0, 2.0])
    r1 = math.exp(0.1)
    loss, g, m = grad_of(x, ends, options={"entropy_alpha": 0.0})  # w ≡ 1: bounds [0.8, 1.2]
    # ρ₁ = 1.105 is now inside, ρ₂ = 1.221 > 1.2 with A > 0 is clipped at 1.2
    assert loss.item() == pytest.approx((-2 * r1 - 1.2 - 2 * 1.2) / 4)
    assert torch.allclose(g, torch.tensor([[-r1 / 4, -r1 / 4, 0.0, 0.0]], dtype=torch.float64))
    assert m[K.PG_CLIPFRAC_HIGH].item() == pytest.approx(0.5)
    assert m[K.SSPO_CLIP_SCALE_STD].item() == 0.0


def test_sspo_scale_bounds_clamp_the_entropy_ratio():
    x, ends = hand_row([1.0, 1.0, 1.0, 2.0])
    _, _, m = grad_of(x, ends, options={"scale_min": 0.8, "scale_max": 1.2})  # w = [0.8, 1.2]
    assert m[K.SSPO_CLIP_SCALE_STD].item() == pytest.approx(0.2)
    _, _, m = grad_of(x, ends, options={"entropy_alpha": 2.0, "scale_max": 10.0})  # w = 0.25→0.5, 2.25
    assert m[K.SSPO_CLIP_SCALE_STD].item() == pytest.approx((2.25 - 0.5) / 2)


# --- a plain-loop reference -----------------------------------------------------------------------
def loop_sspo(lp, old, adv, mask, turns, ends, agg, low=0.2, high=0.2, alpha=1.0, wmin=0.5,
              wmax=2.0, dual=None):
    ids = loop_subsentences(ends, mask, turns)
    n, t = mask.shape
    terms = {}  # (i, j) -> s_ij, stacked at the end (no in-place writes into the graph)
    for i in range(n):
        agent = [j for j in range(t) if mask[i, j]]
        if not agent:
            continue
        hbar = sum(-float(old[i, j]) for j in agent) / len(agent)
        for k in set(ids[i][mask[i]].tolist()):
            sub = [j for j in agent if ids[i, j] == k]
            rho = torch.exp(sum(torch.clamp(lp[i, j] - old[i, j], -20, 20) for j in sub) / len(sub))
            h = sum(-float(old[i, j]) for j in sub) / len(sub)
            w = min(max((h / hbar) ** alpha, wmin), wmax) if hbar > 0 else 1.0
            for j in sub:
                a = adv[i, j]
                clipped = torch.clamp(rho, 1 - low * w, 1 + high * w)
                v = torch.maximum(-a * rho, -a * clipped)
                if dual is not None and a < 0:
                    v = torch.minimum(v, -a * dual)
                terms[i, j] = v
    zero = torch.zeros((), dtype=lp.dtype)
    s = torch.stack([torch.stack([terms.get((i, j), zero) for j in range(t)]) for i in range(n)])
    return loop_agg(s, mask, agg)


@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("opts", [{}, {"entropy_alpha": 0.5, "scale_min": 0.3, "scale_max": 3.0}])
def test_vectorised_equals_the_plain_loop(agg, opts):
    x = make_inputs(6, 24, seed=3, spread=0.4, dtype=torch.float64)
    ends = delimiters(x, 3)
    lp = x["log_probs"].clone().requires_grad_(True)
    loss, m = run(x, ends, lp=lp, loss_agg=agg, options=opts, dual_clip=2.0)
    (g,) = torch.autograd.grad(loss, lp)
    lp2 = x["log_probs"].clone().requires_grad_(True)
    o = {"entropy_alpha": 1.0, "scale_min": 0.5, "scale_max": 2.0, **opts}
    ref = loop_sspo(lp2, x["old_log_probs"], x["advantages"], x["loss_mask"], x["turn_ids"], ends,
                    agg, alpha=o["entropy_alpha"], wmin=o["scale_min"], wmax=o["scale_max"], dual=2.0)
    (g_ref,) = torch.autograd.grad(ref, lp2)
    assert loss.item() == pytest.approx(ref.item(), rel=1e-12)
    assert torch.allclose(g, g_ref, atol=1e-14)
    assert 0 < m[K.PG_CLIPFRAC].item() < 1


# --- limiting cases against the clip path ---------------------------------------------------------
@pytest.mark.parametrize("agg", AGGS)
def test_every_token_a_subsentence_without_scaling_is_token_ppo(agg):
    x = make_inputs(5, 16, seed=4, spread=0.4, dtype=torch.float64)
    ends = torch.ones_like(x["loss_mask"])
    a, g_a, _ = grad_of(x, ends, loss_agg=agg, options={"entropy_alpha": 0.0}, dual_clip=3.0)
    lp = x["log_probs"].clone().requires_grad_(True)
    b, _ = policy_loss(lp, x["old_log_probs"], x["advantages"], x["loss_mask"], x["turn_ids"],
                       ratio_level="token", clip_low=0.2, clip_high=0.2, loss_agg=agg, dual_clip=3.0)
    b.backward()
    assert a.item() == pytest.approx(b.item(), rel=1e-12)
    assert torch.allclose(g_a, lp.grad, atol=1e-14)


@pytest.mark.parametrize("agg", AGGS)
def test_no_delimiter_without_scaling_is_turn_ppo(agg):
    x = make_inputs(5, 16, seed=5, spread=0.4, dtype=torch.float64)
    ends = torch.zeros_like(x["loss_mask"])
    a, g_a, _ = grad_of(x, ends, loss_agg=agg, options={"entropy_alpha": 0.0})
    lp = x["log_probs"].clone().requires_grad_(True)
    b, _ = policy_loss(lp, x["old_log_probs"], x["advantages"], x["loss_mask"], x["turn_ids"],
                       ratio_level="turn", clip_low=0.2, clip_high=0.2, loss_agg=agg)
    b.backward()
    assert a.item() == pytest.approx(b.item(), rel=1e-12)
    assert torch.allclose(g_a, lp.grad, atol=1e-14)


def test_at_ratio_one_the_loss_is_minus_agg_a_and_the_gradient_the_subsentence_mean():
    """ρ ≡ 1: L = −agg(A), and ∂L/∂δ_t = (1/|s|) Σ_{t'∈s} −A_t' w_t' — PPO's gradient averaged
    over the subsentence, as the turn ratio averages it over the turn."""
    from stppo.algos import agg_loss, agg_weights

    x = make_inputs(5, 12, seed=1, dtype=torch.float64)
    x["log_probs"] = x["old_log_probs"].clone()
    ends = delimiters(x, 1)
    loss, g, _ = grad_of(x, ends, loss_agg="seq-mean-token-mean")
    assert loss.item() == pytest.approx(-agg_loss(x["advantages"], x["loss_mask"],
                                                  "seq-mean-token-mean").item(), rel=1e-12)
    w = agg_weights(x["loss_mask"], "seq-mean-token-mean", dtype=torch.float64)
    coef = torch.where(x["loss_mask"], -x["advantages"] * w, 0.0)
    ids = subsentence_ids(ends, x["loss_mask"], x["turn_ids"])
    want = torch.zeros_like(coef)
    for i in range(5):
        for k in set(ids[i][x["loss_mask"][i]].tolist()):
            at = ids[i] == k
            want[i, at] = coef[i, at].mean()
    assert torch.allclose(g, want, atol=1e-15)


# --- invariances, split batches, gradients --------------------------------------------------------
def _with_ends(d: dict, **kw):
    """grad_of with the subsentence ends riding in the inputs (so a row split splits them too)."""
    return grad_of({k: v for k, v in d.items() if k != "ends"}, d["ends"], **kw)


@pytest.mark.parametrize("agg", AGGS)
def test_garbage_on_masked_positions_changes_neither_loss_nor_gradient(agg):
    x = make_inputs(6, 16, seed=6, dtype=torch.float64)
    x["ends"] = delimiters(x, 6)
    check_garbage_is_ignored(_with_ends, x, agg, extra={"turn_ids": torch.where(x["loss_mask"], x["turn_ids"], 99)})


@pytest.mark.parametrize("agg", AGGS)
def test_half_batches_with_global_denominators_sum_to_whole_batch(agg):
    x = make_inputs(8, 14, seed=7, dtype=torch.float64)
    x["ends"] = delimiters(x, 7)
    check_half_batches_sum_to_whole(_with_ends, x, agg)


def test_gradcheck_float64():
    x = make_inputs(3, 10, seed=8, dtype=torch.float64)
    ends = delimiters(x, 8)
    assert torch.autograd.gradcheck(lambda lp: run(x, ends, lp=lp, dual_clip=2.0)[0],
                                    (x["log_probs"].clone().requires_grad_(True),))


def test_empty_batch_gives_zero_loss_and_finite_metrics():
    x = make_inputs(3, 8, seed=9, dtype=torch.float64)
    x["loss_mask"] = torch.zeros_like(x["loss_mask"])
    loss, m = run(x, delimiters(x))
    assert loss.item() == 0.0 and all(torch.isfinite(v) for v in m.values())


# --- errors ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("options, match", [
    ({"entropy_alpha": -1.0}, "entropy_alpha must be >= 0"),
    ({"scale_min": 0.0}, "scale_min must be > 0"),
    ({"scale_min": 2.0, "scale_max": 1.0}, "scale_max must be >= scale_min"),
    ({"tau": 1.0}, "no option.s. tau; valid: entropy_alpha, scale_min, scale_max"),
])
def test_invalid_options_are_one_line_errors(options, match):
    x = make_inputs(2, 6, seed=0)
    with pytest.raises(ValueError, match=match) as e:
        run(x, delimiters(x), options=options)
    assert "\n" not in str(e.value)


def test_without_segment_ids_sspo_is_one_clear_error():
    x = make_inputs(2, 6, seed=0)
    with pytest.raises(ValueError, match="loss_mode='sspo' needs segment_ids") as e:
        policy_loss(x["log_probs"], x["old_log_probs"], x["advantages"], x["loss_mask"],
                    x["turn_ids"], loss_mode="sspo", clip_low=0.2, clip_high=0.2,
                    loss_agg="token-mean")
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="segment_ids has shape"):
        run_ids = torch.zeros(2, 5, dtype=torch.long)
        policy_loss(x["log_probs"], x["old_log_probs"], x["advantages"], x["loss_mask"],
                    x["turn_ids"], loss_mode="sspo", clip_low=0.2, clip_high=0.2,
                    loss_agg="token-mean", segment_ids=run_ids)
