"""policy_loss: hand cases, limiting cases, mask invariance, loop reference, gradcheck,
Lemma 4.1, split batches, argument validation (docs/design.md §2)."""

import math

import pytest
import torch

from stppo import metric_names as K
from stppo.algos import agg_denoms, agg_loss, clipped_surrogate, importance_ratio
from keyword_loss import policy_loss
from helpers.algos import loop_agg, loop_ratio, loop_surrogate, make_inputs, with_garbage

LEVELS = ("token", "turn", "sequence")
AGGS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")
CLIP = dict(clip_low=0.2, clip_high=0.28)


def run(x, lp=None, **kw):
    kw = {**CLIP, "ratio_level": "token", "loss_agg": "token-mean", **kw}
    return policy_loss(x["log_probs"] if lp is None else lp, x["old_log_probs"], x["advantages"],
                       x["loss_mask"], x["turn_ids"], **kw)


def test_hand_computed_token_level_loss_gradient_and_metrics():
    rho = torch.tensor([[1.5, 0.5, 1.1, 0.7]], dtype=torch.float64)
    x = dict(log_probs=rho.log().requires_grad_(True), old_log_probs=torch.zeros_like(rho),
             advantages=torch.tensor([[1.0, -1.0, -1.0, 2.0]], dtype=torch.float64),
             loss_mask=torch.ones(1, 4, dtype=torch.bool), turn_ids=torch.tensor([[0, 0, 1, 1]]))
    loss, m = run(x, clip_low=0.2, clip_high=0.2)
    # s = [-1.2 (κ_high), 0.8 (κ_low), 1.1, -1.4]
    assert loss.item() == pytest.approx((-1.2 + 0.8 + 1.1 - 1.4) / 4)
    loss.backward()
    # ∂s/∂log π = -A ρ on unclipped tokens, 0 on clipped ones; token-mean weight 1/4
    assert torch.allclose(x["log_probs"].grad,
                          torch.tensor([[0.0, 0.0, 1.1 / 4, -1.4 / 4]], dtype=torch.float64))
    assert m[K.PG_CLIPFRAC].item() == pytest.approx(0.5)
    assert m[K.PG_CLIPFRAC_HIGH].item() == pytest.approx(0.25)
    assert m[K.PG_CLIPFRAC_LOW].item() == pytest.approx(0.25)
    assert m[K.RATIO_MEAN].item() == pytest.approx(0.95)
    assert m[K.RATIO_MAX].item() == pytest.approx(1.5)
    assert m[K.PPO_KL].item() == pytest.approx(-rho.log().mean().item())
    assert m[K.CLIP_BIAS_NORM].item() == pytest.approx(math.sqrt((1.5**2 + 0.5**2) / 4))
    assert m[K.CLIP_BIAS_NORM_MAX].item() == m[K.CLIP_BIAS_NORM].item()
    assert m[K.PG_LOSS_NORM].item() == pytest.approx(math.sqrt((1.44 + 0.64 + 1.21 + 1.96) / 4))
    assert m[K.PG_LOSS].item() == pytest.approx(loss.item())
    assert m[K.CLIP_BIAS_SCALE].item() == 1.0 and m[K.CLIP_BIAS_TRIGGERED].item() == 0.0
    for v in m.values():
        assert v.dim() == 0 and not v.requires_grad


def test_dual_clip_caps_negative_advantage_terms():
    rho = torch.tensor([[4.0, 2.0, 4.0]], dtype=torch.float64)
    adv = torch.tensor([[-1.0, -1.0, 1.0]], dtype=torch.float64)
    s = clipped_surrogate(rho.requires_grad_(True), adv, 0.2, 0.2, dual_clip=3.0).loss
    assert torch.allclose(s, torch.tensor([[3.0, 2.0, -1.2]], dtype=torch.float64))
    s.sum().backward()
    assert torch.allclose(rho.grad, torch.tensor([[0.0, 1.0, 0.0]], dtype=torch.float64))


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("agg", AGGS)
def test_ratio_one_gives_minus_agg_of_advantages(level, agg):
    x = make_inputs(5, 12, seed=1, empty_row=True)
    x["log_probs"] = x["old_log_probs"].clone()
    loss, m = run(x, ratio_level=level, loss_agg=agg)
    expected = -agg_loss(x["advantages"], x["loss_mask"], agg)
    assert torch.allclose(loss, expected, atol=1e-6)
    assert m[K.PG_CLIPFRAC].item() == 0.0 and m[K.CLIP_BIAS_NORM].item() == 0.0


CLIP_BIAS_KINDS = (None, {"kind": "clip_bias_norm", "tau": 0.05},
               {"kind": "clip_bias_norm", "tau": 0.05, "granularity": "sequence"},
               {"kind": "clip_triggered", "tau": 0.5})


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("corr", CLIP_BIAS_KINDS)
def test_garbage_on_masked_positions_changes_neither_loss_nor_gradient(level, agg, corr):
    x = make_inputs(4, 12, seed=2, spread=0.6)
    mask = x["loss_mask"]
    out = []
    for garbage in (False, True):
        y = dict(x)
        if garbage:
            y["old_log_probs"] = with_garbage(x["old_log_probs"], mask, seed=3)
            y["advantages"] = with_garbage(x["advantages"], mask, seed=4)
            y["turn_ids"] = torch.where(mask, x["turn_ids"], 7)
        lp = (with_garbage(x["log_probs"], mask) if garbage else x["log_probs"].clone())
        lp.requires_grad_(True)
        loss, m = run(y, lp=lp, ratio_level=level, loss_agg=agg, clip_bias=corr)
        loss.backward()
        out.append((loss, m, lp.grad))
    (l0, m0, g0), (l1, m1, g1) = out
    assert torch.isfinite(l1) and torch.isfinite(g1).all()
    assert torch.equal(l0, l1) and torch.equal(g0, g1)
    assert all(torch.equal(m0[k], m1[k]) for k in m0)
    assert (g1[~mask] == 0).all()


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("agg", AGGS)
def test_vectorised_loss_equals_plain_loop_reference(level, agg):
    x = make_inputs(4, 12, seed=5, spread=0.5, dtype=torch.float64, empty_row=True)
    clip_low, clip_high, dual = 0.2, 0.25, 2.0
    lp1 = x["log_probs"].clone().requires_grad_(True)
    lp2 = x["log_probs"].clone().requires_grad_(True)
    loss, m = run(x, lp=lp1, ratio_level=level, loss_agg=agg, clip_low=clip_low,
                  clip_high=clip_high, dual_clip=dual)
    mask = x["loss_mask"]
    rho = loop_ratio(lp2, x["old_log_probs"], mask, x["turn_ids"], level)
    s, hi, lo = loop_surrogate(rho, x["advantages"], mask, clip_low, clip_high, dual)
    ref = loop_agg(s, mask, agg)
    assert torch.allclose(loss, ref)
    loss.backward()
    ref.backward()
    assert torch.allclose(lp1.grad, lp2.grad)
    n = mask.sum().item()
    assert m[K.PG_CLIPFRAC_HIGH].item() == pytest.approx(hi.sum().item() / n)
    assert m[K.PG_CLIPFRAC_LOW].item() == pytest.approx(lo.sum().item() / n)
    rho_d, adv = rho.detach(), x["advantages"]
    assert m[K.RATIO_MEAN].item() == pytest.approx(rho_d[mask].mean().item())
    assert m[K.RATIO_MAX].item() == pytest.approx(rho_d[mask].max().item())
    bias = torch.where(hi | lo, (rho_d * adv) ** 2, 0.0)
    assert m[K.CLIP_BIAS_NORM].item() == pytest.approx(loop_agg(bias, mask, agg).sqrt().item())
    s_norm = loop_agg(s.detach() ** 2, mask, agg).sqrt()
    assert m[K.PG_LOSS_NORM].item() == pytest.approx(s_norm.item())


@pytest.mark.parametrize("level", LEVELS)
def test_gradcheck_float64(level):
    x = make_inputs(3, 9, seed=8, spread=0.4, dtype=torch.float64)
    rho, _ = importance_ratio(x["log_probs"], x["old_log_probs"], x["loss_mask"],
                              x["turn_ids"], level)
    r = rho[x["loss_mask"]]
    for b in (0.8, 1.25, 3.0):  # no ratio within reach of a kink (clip bounds, dual clip)
        assert (r - b).abs().min() > 1e-3

    def f(lp):
        return run(x, lp=lp, ratio_level=level, loss_agg="seq-mean-token-mean",
                   clip_low=0.2, clip_high=0.25, dual_clip=3.0)[0]

    assert torch.autograd.gradcheck(f, (x["log_probs"].clone().requires_grad_(True),))


@pytest.mark.parametrize("agg", ("token-mean", "seq-mean-token-mean"))
def test_turn_level_gradient_is_lemma_4_1_closed_form(agg):
    # ∂L/∂log π(y_t) = -c_i w^k Â^k / |y^k| for t in turn k of row i, Â^k = Σ_{t∈k unclipped} A_t,
    # with c_i the aggregation weight: 1/Σm (token-mean) or 1/(|y_i| D_seq)
    x = make_inputs(4, 16, seed=9, spread=0.5, dtype=torch.float64)
    lp = x["log_probs"].clone().requires_grad_(True)
    loss, m = run(x, lp=lp, ratio_level="turn", loss_agg=agg, clip_low=0.1, clip_high=0.1)
    loss.backward()
    assert m[K.PG_CLIPFRAC].item() > 0  # some tokens clipped: Â^k is not just Σ A
    mask, turns, adv = x["loss_mask"], x["turn_ids"], x["advantages"]
    expected = torch.zeros_like(lp)
    d_seq = mask.any(dim=1).sum().item()
    for i in range(mask.shape[0]):
        for k in turns[i][mask[i]].unique().tolist():
            idx = (mask[i] & (turns[i] == k)).nonzero().flatten()
            w = torch.exp((lp[i, idx] - x["old_log_probs"][i, idx]).mean()).item()
            unclipped = [j for j in idx.tolist()
                         if not ((adv[i, j] > 0 and w > 1.1) or (adv[i, j] < 0 and w < 0.9))]
            a_hat = sum(adv[i, j].item() for j in unclipped)
            c = 1 / mask.sum().item() if agg == "token-mean" else 1 / (mask[i].sum().item() * d_seq)
            expected[i, idx] = -c * w * a_hat / len(idx)
    assert torch.allclose(lp.grad, expected)


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("agg", AGGS)
def test_half_batches_with_global_denominators_sum_to_whole_batch(level, agg):
    x = make_inputs(6, 12, seed=10, spread=0.5, empty_row=True)
    lp = x["log_probs"].clone().requires_grad_(True)
    loss, _ = run(x, lp=lp, ratio_level=level, loss_agg=agg)
    loss.backward()
    denoms = agg_denoms(x["loss_mask"])
    lp_half = x["log_probs"].clone().requires_grad_(True)
    total = 0.0
    for rows in (slice(0, 2), slice(2, 6)):
        part = {k: v[rows] for k, v in x.items()}
        half, _ = run(part, lp=lp_half[rows], ratio_level=level, loss_agg=agg,
                      global_denoms=denoms)
        half.backward()
        total = total + half.detach()
    assert torch.allclose(total, loss.detach(), atol=1e-6)
    assert torch.allclose(lp_half.grad, lp.grad, atol=1e-7)


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("shape", [(0, 5), (3, 0), (2, 4)])
def test_batches_without_agent_tokens_give_zero_loss_and_finite_metrics(level, shape):
    lp = torch.randn(*shape).requires_grad_(True)
    mask = torch.zeros(*shape, dtype=torch.bool)
    for corr in CLIP_BIAS_KINDS:
        loss, m = policy_loss(lp, with_garbage(lp.detach(), mask), lp.detach(), mask,
                              torch.full(shape, -1), ratio_level=level, loss_agg="token-mean",
                              clip_bias=corr, **CLIP)
        loss.backward()
        assert loss.item() == 0.0 and (lp.grad == 0).all()
        assert all(torch.isfinite(v) for v in m.values())


@pytest.mark.parametrize("kwargs, field", [
    (dict(clip_low=1.0), "clip_low"), (dict(clip_low=-0.1), "clip_low"),
    (dict(clip_high=0.0), "clip_high"), (dict(dual_clip=1.0), "dual_clip"),
    (dict(ratio_level="word"), "ratio_level"), (dict(loss_agg="mean"), "loss_agg"),
])
def test_invalid_arguments_name_the_argument(kwargs, field):
    x = make_inputs(2, 6)
    with pytest.raises(ValueError, match=field):
        run(x, **kwargs)


def test_invalid_tensors_name_the_tensor():
    x = make_inputs(2, 6)
    with pytest.raises(ValueError, match=r"old_log_probs has shape \(2, 5\)"):
        run({**x, "old_log_probs": x["old_log_probs"][:, :5]})
    with pytest.raises(ValueError, match=r"advantages must have shape \(N, T\)"):
        run({**x, "advantages": x["advantages"][0]})
    with pytest.raises(ValueError, match="loss_mask must be a bool tensor"):
        run({**x, "loss_mask": x["loss_mask"].float()})
    with pytest.raises(ValueError, match="turn_ids must be an integer tensor"):
        run({**x, "turn_ids": x["turn_ids"].float()})
    with pytest.raises(ValueError, match="unknown clip_bias.kind 'foo'; valid: none, clip_bias_norm, clip_triggered"):
        run(x, clip_bias={"kind": "foo", "tau": 1.0})
