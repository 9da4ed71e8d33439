"""What every baseline loss shares: the token view of a batch and the metric set (docs/design.md §2).

Masking comes first, as in `policy_loss`: δ = clamp(log π_θ − log π_old, −20, 20) on agent tokens
and exactly 0 elsewhere, so garbage (nan/inf) on prompt, observation and padding positions reaches
neither a result nor a gradient. (verl's clip_cov, kl_cov and geo_mean do not clamp δ; the two
agree wherever |δ| ≤ 20.)

Metrics: the keys of the clip path, with one generalised definition of the clipping bias. Every
loss here has a per-token policy-gradient coefficient g_t (∇L = Σ w_t g_t ∇log π_t); the unclipped
importance-weighted objective has g_t = −ρ_t A_t. The bias b_t = g_t + ρ_t A_t is what the loss's
trust-region mechanism removes from (or adds to) that gradient, and

    clip_bias/norm = sqrt( Σ_t w_t b_t² )

with w the aggregation weights. For the clipped surrogate b_t = κ_t ρ_t A_t (up to sign), i.e. the
paper's definition; each loss states its b in its docstring.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from stppo.algos.aggregation import agg_row_weights, mask_float, weighted_sum
from stppo.algos.clip_bias import Reduce
from stppo.algos.contract import LossInputs
from stppo.algos.ratios import log_ratio
from stppo.metric_names import (CLIP_BIAS_NORM, CLIP_BIAS_NORM_MAX, CLIP_BIAS_SCALE,
                            CLIP_BIAS_TRIGGERED, PG_CLIPFRAC, PG_CLIPFRAC_HIGH, PG_CLIPFRAC_LOW,
                            PG_LOSS, PG_LOSS_NORM, PPO_KL, RATIO_MAX, RATIO_MEAN)


class TokenView(NamedTuple):
    delta: torch.Tensor  # (N, T) δ with graph; 0 off agent tokens
    ratio: torch.Tensor  # (N, T) ρ = exp(δ) with graph; 1 off agent tokens
    adv: torch.Tensor  # (N, T) A on agent tokens, 0 elsewhere; detached, ρ's dtype
    mf: torch.Tensor  # (N, T) 0/1 mask in ρ's dtype
    lengths: torch.Tensor  # (N,) |y_i|
    w: torch.Tensor  # (N, T) aggregation weights of this call's own denominators (diagnostics)
    w_loss: torch.Tensor  # (N, T) weights of the loss (global denominators when given)
    w_corr: torch.Tensor  # (N, T) weights of batch statistics: w, or w_loss under `reduce`
    is_w: Optional[torch.Tensor]  # (N, T) rollout IS weights on agent tokens, 1 elsewhere


def token_view(x: LossInputs, loss_agg: str) -> TokenView:
    """The masked token-level quantities of one `policy_loss` call `x` (see the module docstring)."""
    log_probs, old_log_probs, advantages, loss_mask = x.log_probs, x.old_log_probs, x.advantages, x.loss_mask
    global_denoms, reduce, rollout_is_weights = x.global_denoms, x.reduce, x.rollout_is_weights
    delta = log_ratio(log_probs, old_log_probs, loss_mask)  # (N, T) with graph
    ratio = delta.exp()  # (N, T)
    with torch.no_grad():
        mf = mask_float(loss_mask, delta.dtype)  # (N, T)
        lengths = mf.sum(dim=1)  # (N,)
        rows = agg_row_weights(mf, loss_agg, lengths=lengths)  # (N,)
        w = mf * rows.unsqueeze(1)  # (N, T)
        w_loss = w if global_denoms is None else mf * agg_row_weights(
            mf, loss_agg, global_denoms, lengths=lengths).unsqueeze(1)
        adv = torch.where(loss_mask, advantages, 0.0).to(delta.dtype)  # (N, T)
        is_w = None if rollout_is_weights is None else torch.where(
            loss_mask, rollout_is_weights.detach(), 1.0).to(delta.dtype)  # (N, T)
    return TokenView(delta, ratio, adv, mf, lengths, w, w_loss, w if reduce is None else w_loss,
                     is_w)


def weighted(view: TokenView, x: torch.Tensor) -> torch.Tensor:
    """x · ω: a per-token loss (or bias) times the rollout IS weights, when there are any."""
    return x if view.is_w is None else x * view.is_w


def assemble(view: TokenView, s: torch.Tensor) -> torch.Tensor:
    """The loss agg(s) = Σ w s from the per-token loss s (N, T) (with graph, finite everywhere)."""
    return weighted_sum(s, view.w_loss)


def metrics(view: TokenView, loss: torch.Tensor, s: torch.Tensor, clipped_high: torch.Tensor,
            clipped_low: torch.Tensor, bias: torch.Tensor, reduce: Reduce = None,
            ratio: Optional[torch.Tensor] = None) -> dict[str, torch.Tensor]:
    """The clip path's metric set: s (N, T) the per-token loss, κ_high/κ_low (N, T) bool, b (N, T)
    the clipping bias of the module docstring, `ratio` the ρ to report (default: the token ρ).
    Fractions, ratio statistics and PPO_KL are token-weighted over agent tokens."""
    with torch.no_grad():
        n_tok = view.lengths.sum().clamp(min=1)
        rho = (view.ratio if ratio is None else ratio).detach() * view.mf  # (N, T)
        hi = torch.count_nonzero(clipped_high & (view.mf > 0)) / n_tok
        lo = torch.count_nonzero(clipped_low & (view.mf > 0)) / n_tok
        s = s.detach()
        bias_sq = weighted_sum(bias.detach().square(), view.w_corr)
        bias_norm = (bias_sq if reduce is None else reduce(bias_sq)).sqrt()
        one = torch.ones((), dtype=s.dtype, device=s.device)
        return {
            PG_LOSS: loss.detach(),
            PG_LOSS_NORM: weighted_sum(s * s, view.w).sqrt(),
            PG_CLIPFRAC: hi + lo,
            PG_CLIPFRAC_HIGH: hi,
            PG_CLIPFRAC_LOW: lo,
            PPO_KL: -view.delta.detach().sum() / n_tok,
            RATIO_MEAN: rho.sum() / n_tok,
            RATIO_MAX: rho.max() if rho.numel() else torch.zeros_like(one),
            CLIP_BIAS_NORM: bias_norm,
            CLIP_BIAS_NORM_MAX: bias_norm.clone(),
            CLIP_BIAS_SCALE: one,
            CLIP_BIAS_TRIGGERED: torch.zeros_like(one),
        }
