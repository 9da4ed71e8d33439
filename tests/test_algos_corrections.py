"""Clipping-bias diagnostics and corrections (docs/design.md §2, "Clipping bias", "ClipBias")."""

import math
from dataclasses import dataclass

import pytest
import torch
from omegaconf import OmegaConf

from stppo import metric_names as K
from stppo.algos import (ClipBias, agg_loss, clip_bias_grad_norm, clip_bias_term,
                         clipped_surrogate, importance_ratio, resolve_clip_bias,
                         sequence_clip_bias_norm)
from keyword_loss import policy_loss

CLIP = dict(clip_low=0.2, clip_high=0.2)


def hand_batch():
    """Row 0: ρ = [1.5, 1.0, 1.0, 0.5], A = [1, 1, -1, -1] → κ = [1, 0, 0, 1]; row 1: no clip."""
    rho = torch.tensor([[1.5, 1.0, 1.0, 0.5], [1.1, 0.9, 1.0, 1.0]], dtype=torch.float64)
    return dict(log_probs=rho.log(), old_log_probs=torch.zeros_like(rho),
                advantages=torch.tensor([[1.0, 1.0, -1.0, -1.0], [1.0, -1.0, 2.0, 0.5]],
                                        dtype=torch.float64),
                loss_mask=torch.ones(2, 4, dtype=torch.bool),
                turn_ids=torch.tensor([[0, 0, 1, 1], [0, 0, 0, 0]]))


def run(x, correction, lp=None, agg="token-mean", **kw):
    return policy_loss(x["log_probs"] if lp is None else lp, x["old_log_probs"], x["advantages"],
                       x["loss_mask"], x["turn_ids"], ratio_level="token", loss_agg=agg,
                       clip_bias=correction, **CLIP, **kw)


def test_clip_bias_norm_batch_scale_hand_computed():
    x = hand_batch()
    base, m0 = run(x, None)
    norm = math.sqrt((1.5**2 + 0.5**2) / 8)  # token-mean over the 8 agent tokens
    assert m0[K.CLIP_BIAS_NORM].item() == pytest.approx(norm)
    tau = norm / 2
    loss, m = run(x, {"kind": "clip_bias_norm", "tau": tau})
    assert m[K.CLIP_BIAS_SCALE].item() == pytest.approx(0.5)
    assert m[K.CLIP_BIAS_TRIGGERED].item() == 1.0
    assert loss.item() == pytest.approx(0.5 * base.item())
    loss, m = run(x, {"kind": "clip_bias_norm", "tau": 2 * norm})  # bias below τ: λ = 1
    assert loss.item() == pytest.approx(base.item())
    assert m[K.CLIP_BIAS_SCALE].item() == 1.0 and m[K.CLIP_BIAS_TRIGGERED].item() == 0.0


def test_clip_bias_norm_sequence_scale_hand_computed():
    x = hand_batch()
    norm0 = math.sqrt((1.5**2 + 0.5**2) / 4)  # row 0's own norm; row 1 is unclipped
    bias_sq = torch.tensor([[2.25, 0.0, 0.0, 0.25], [0.0] * 4], dtype=torch.float64)  # κ(ρA)²
    assert torch.allclose(sequence_clip_bias_norm(bias_sq, x["loss_mask"]),
                          torch.tensor([norm0, 0.0], dtype=torch.float64))
    tau = norm0 / 4
    lp = x["log_probs"].clone().requires_grad_(True)
    loss, m = run(x, {"kind": "clip_bias_norm", "tau": tau, "granularity": "sequence"}, lp=lp,
                  agg="seq-mean-token-mean")
    lam = torch.tensor([0.25, 1.0], dtype=torch.float64)
    s = clipped_surrogate(lp.exp(), x["advantages"], **CLIP).loss
    ref = agg_loss(s * lam.unsqueeze(1), x["loss_mask"], "seq-mean-token-mean")
    assert loss.item() == pytest.approx(ref.item())
    assert m[K.CLIP_BIAS_SCALE].item() == pytest.approx(0.625)
    assert m[K.CLIP_BIAS_TRIGGERED].item() == 1.0
    g_loss, = torch.autograd.grad(loss, lp)
    g_ref, = torch.autograd.grad(ref, lp)
    assert torch.allclose(g_loss, g_ref)


def test_clip_triggered_hand_computed():
    x = hand_batch()
    x["loss_mask"][1] = False  # only row 0's tokens: RMS(ρA|κ) = sqrt(1.25), RMS(ρA|¬κ) = 1
    base, _ = run(x, None)
    r = math.sqrt(1.25) / (1.0 + 1e-8)
    loss, m = run(x, {"kind": "clip_triggered", "tau": 1.0})
    assert m[K.CLIP_BIAS_SCALE].item() == pytest.approx(1 / r)
    assert loss.item() == pytest.approx(base.item() / r)
    loss, m = run(x, {"kind": "clip_triggered", "tau": 1.2})  # r ≤ τ: λ = 1
    assert m[K.CLIP_BIAS_SCALE].item() == 1.0 and loss.item() == pytest.approx(base.item())


def test_corrections_at_turn_level_hand_computed():
    """Turn level (the per-turn statistics of stppo.algos.turn_clip) on the hand batch: row 0's turns
    have ρ = sqrt(1.5) (A = 1, 1: both clipped high) and sqrt(0.5) (A = −1, −1: both clipped low),
    row 1's one turn ρ = 0.99^(1/4) (nothing clipped)."""
    x = hand_batch()

    def turn(correction, agg="token-mean"):
        return policy_loss(x["log_probs"], x["old_log_probs"], x["advantages"], x["loss_mask"],
                           x["turn_ids"], ratio_level="turn", loss_agg=agg, clip_bias=correction, **CLIP)

    base, m0 = turn(None)
    assert m0[K.PG_CLIPFRAC_HIGH].item() == pytest.approx(2 / 8)
    assert m0[K.PG_CLIPFRAC_LOW].item() == pytest.approx(2 / 8)
    assert m0[K.CLIP_BIAS_NORM].item() == pytest.approx(math.sqrt((1.5 * 2 + 0.5 * 2) / 8))
    s_row0 = 2 * 1.2**2 + 2 * 0.8**2  # clipped: s² = A² β²
    s_row1 = 0.99**0.5 * (1 + 1 + 4 + 0.25)  # unclipped: s² = A² ρ²
    assert m0[K.PG_LOSS_NORM].item() == pytest.approx(math.sqrt((s_row0 + s_row1) / 8))
    _, m = turn({"kind": "clip_bias_norm", "tau": 0.25, "granularity": "sequence"}, "seq-mean-token-mean")
    assert m[K.CLIP_BIAS_SCALE].item() == pytest.approx((0.25 + 1.0) / 2)  # row 0's own norm is 1
    r = 1.0 / (math.sqrt(s_row1 / 4) + 1e-8)  # RMS(ρA | κ) = 1; the unclipped are row 1's four
    loss, m = turn({"kind": "clip_triggered", "tau": 0.5})
    assert m[K.CLIP_BIAS_SCALE].item() == pytest.approx(1 / r)
    assert loss.item() == pytest.approx(base.item() / r)


@pytest.mark.parametrize("corr", [
    {"kind": "clip_bias_norm", "tau": 1e-6},
    {"kind": "clip_bias_norm", "tau": 1e-6, "granularity": "sequence"},
    {"kind": "clip_triggered", "tau": 1e-6},
])
@pytest.mark.parametrize("level", ("token", "turn", "sequence"))
def test_no_clipping_means_no_correction(corr, level):
    x = hand_batch()
    x["log_probs"] = x["old_log_probs"] + 0.01  # ρ ≈ 1.01: nothing clipped
    base, _ = policy_loss(*x.values(), ratio_level=level, loss_agg="token-mean", **CLIP)
    loss, m = policy_loss(*x.values(), ratio_level=level, loss_agg="token-mean", clip_bias=corr,
                          **CLIP)
    assert m[K.PG_CLIPFRAC].item() == 0.0
    assert m[K.CLIP_BIAS_SCALE].item() == 1.0 and m[K.CLIP_BIAS_TRIGGERED].item() == 0.0
    assert loss.item() == base.item()


def linear_policy(seed=0, n=3, t=6, vocab=5):
    """A tiny nn.Linear producing per-token log-probs, and an off-policy batch for it."""
    g = torch.Generator().manual_seed(seed)
    net = torch.nn.Linear(4, vocab, dtype=torch.float64)
    with torch.no_grad():
        net.weight.copy_(torch.randn(vocab, 4, generator=g, dtype=torch.float64))
        net.bias.zero_()
    feats = torch.randn(n, t, 4, generator=g, dtype=torch.float64)
    ids = torch.randint(0, vocab, (n, t), generator=g)

    def log_probs():
        return torch.log_softmax(net(feats), -1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)

    mask = torch.ones(n, t, dtype=torch.bool)
    mask[:, 0] = False
    x = dict(old_log_probs=log_probs().detach() + 0.5 * torch.randn(n, t, generator=g,
                                                                    dtype=torch.float64),
             advantages=torch.randn(n, t, generator=g, dtype=torch.float64), loss_mask=mask,
             turn_ids=torch.where(mask, torch.arange(t) // 3, -1).expand(n, t))
    return net, log_probs, x


def explicit_clip_bias_grad_norm(net, log_probs, x, agg):
    """‖∇θ agg(κρA)‖ from a fresh forward and a plain .backward()."""
    net.zero_grad()
    rho, _ = importance_ratio(log_probs(), x["old_log_probs"], x["loss_mask"], x["turn_ids"],
                              "token")
    clipped = clipped_surrogate(rho.detach(), x["advantages"], **CLIP).clipped
    clip_bias_term(rho, x["advantages"], clipped, x["loss_mask"], agg).backward()
    norm = math.sqrt(sum((p.grad ** 2).sum().item() for p in net.parameters()))
    net.zero_grad()
    return norm


def test_clip_bias_grad_norm_equals_explicit_backward_and_keeps_the_graph():
    net, log_probs, x = linear_policy()
    lp = log_probs()
    rho, _ = importance_ratio(lp, x["old_log_probs"], x["loss_mask"], x["turn_ids"], "token")
    clipped = clipped_surrogate(rho.detach(), x["advantages"], **CLIP).clipped
    assert clipped.any()
    term = clip_bias_term(rho, x["advantages"], clipped, x["loss_mask"], "token-mean")
    g = clip_bias_grad_norm(term, net.parameters())
    assert g.item() > 0
    assert g.item() == pytest.approx(explicit_clip_bias_grad_norm(net, log_probs, x, "token-mean"))
    (rho.sum() + term).backward()  # the same graph is still usable


@pytest.mark.parametrize("agg", ("token-mean", "seq-mean-token-mean"))
def test_grad_estimator_scales_by_exact_norm(agg):
    net, log_probs, x = linear_policy(seed=1)
    g_ref = explicit_clip_bias_grad_norm(net, log_probs, x, agg)
    base, _ = run(x, None, lp=log_probs(), agg=agg)
    base.backward()
    base_grads = [p.grad.clone() for p in net.parameters()]
    net.zero_grad()
    tau = g_ref / 3
    loss, m = run(x, {"kind": "clip_bias_norm", "tau": tau, "estimator": "grad"}, lp=log_probs(),
                  agg=agg, params=net.parameters())
    assert m[K.CLIP_BIAS_GRAD_NORM].item() == pytest.approx(g_ref)
    assert m[K.CLIP_BIAS_SCALE].item() == pytest.approx(1 / 3)
    assert loss.item() == pytest.approx(base.item() / 3)
    loss.backward()
    for p, g0 in zip(net.parameters(), base_grads):
        assert torch.allclose(p.grad, g0 / 3)
    # no clipping: λ = 1
    x["old_log_probs"] = log_probs().detach()
    _, m = run(x, {"kind": "clip_bias_norm", "tau": 1e-9, "estimator": "grad"}, lp=log_probs(),
               agg=agg, params=net.parameters())
    assert m[K.CLIP_BIAS_SCALE].item() == 1.0 and m[K.CLIP_BIAS_GRAD_NORM].item() == 0.0


def test_grad_estimator_without_params_is_a_clear_error():
    net, log_probs, x = linear_policy()
    with pytest.raises(ValueError, match="params"):
        run(x, {"kind": "clip_bias_norm", "tau": 1.0, "estimator": "grad"}, lp=log_probs())


@dataclass
class CorrCfg:
    kind: str = "clip_bias_norm"
    tau: float = 0.3
    estimator: str = "token"
    granularity: str = "sequence"


def test_resolve_correction_accepts_mappings_dataclasses_and_fills_defaults():
    assert resolve_clip_bias(None) is None
    assert resolve_clip_bias({"kind": "none"}) is None
    c = resolve_clip_bias({"kind": "clip_bias_norm", "tau": 0.3})
    assert c == ClipBias("clip_bias_norm", 0.3, "token", "batch")
    assert resolve_clip_bias(CorrCfg()) == ClipBias("clip_bias_norm", 0.3, "token", "sequence")
    cfg = OmegaConf.create({"kind": "clip_triggered", "tau": 2.0})
    assert resolve_clip_bias(cfg) == ClipBias("clip_triggered", 2.0)
    assert resolve_clip_bias({"kind": "clip_bias_norm"}).tau == 0.5  # the kind's default τ


@pytest.mark.parametrize("spec, match", [
    ({"kind": "clipping"}, "valid: none, clip_bias_norm, clip_triggered"),
    ({"kind": "clip_bias_norm", "tau": 0.0}, "clip_bias.tau must be a number > 0"),
    ({"kind": "clip_bias_norm", "tau": -1}, "clip_bias.tau"),
    ({"kind": "clip_bias_norm", "estimator": "exact"}, "clip_bias.estimator='exact'.*token, grad"),
    ({"kind": "clip_bias_norm", "granularity": "token"}, "clip_bias.granularity"),
    ({"kind": "clip_bias_norm", "estimator": "grad", "granularity": "sequence"},
     "granularity='batch' only"),
    ({"kind": "clip_triggered", "granularity": "sequence"}, "allowed: batch"),
    ({"kind": "clip_bias_norm", "taus": 1.0}, "unknown fields \\['taus'\\]; expected: kind, tau"),
    ("clip_bias_norm", "mapping or an object"),
])
def test_invalid_corrections_are_one_line_errors(spec, match):
    with pytest.raises(ValueError, match=match):
        resolve_clip_bias(spec)
