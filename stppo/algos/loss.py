"""`policy_loss`: ratio → clipped surrogate → correction → aggregation (DESIGN.md §2).

    L = λ · agg(s)        (batch granularity)      L = agg(λ_i s_{i,t})   (sequence granularity)

with s the clipped surrogate of `stppo.algos.surrogate` at the ratio level of `stppo.algos.ratios`
(token / turn / sequence) and λ the detached scale of `stppo.algos.clip_bias`. At the turn level
the gradient of a token t in turn k is the closed form of ST-PPO (arXiv 2511.20718 v1) Lemma 4.1,
w^k Â^k / |y^k| ∇ log π(y_t), times the aggregation weight, with Â^k = Σ_{t∈k} 1[unclipped] A_t.
"""

from __future__ import annotations

from typing import Any, Iterable, Optional

import torch

from stppo.algos.aggregation import (LOSS_AGGS, GlobalDenoms, agg_weights, mask_float,
                                     weighted_sum)
from stppo.algos.clip_bias import CORRECTIONS, ClipContext, clip_bias_sq, resolve_correction
from stppo.algos.ratios import RATIO_LEVELS, importance_ratio
from stppo.algos.surrogate import surrogate_parts
from stppo.tracking import (CLIP_BIAS_NORM, CLIP_BIAS_NORM_MAX, CLIP_BIAS_SCALE,
                            CLIP_BIAS_TRIGGERED, PG_CLIPFRAC, PG_CLIPFRAC_HIGH, PG_CLIPFRAC_LOW,
                            PG_LOSS, PG_LOSS_NORM, PPO_KL, RATIO_MAX, RATIO_MEAN)

TOKEN_TENSORS = ("log_probs", "old_log_probs", "advantages", "loss_mask", "turn_ids")


def check_token_tensors(**tensors: torch.Tensor) -> None:
    """Every argument is a (N, T) tensor of the first one's shape; else one-line ValueError."""
    shape = None
    for name, x in tensors.items():
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor of shape (N, T), "
                             f"got {type(x).__name__}")
        if x.dim() != 2:
            raise ValueError(f"{name} must have shape (N, T), got {tuple(x.shape)}")
        if shape is None:
            shape, first = x.shape, name
        elif x.shape != shape:
            raise ValueError(f"{name} has shape {tuple(x.shape)}, expected {tuple(shape)} "
                             f"(the shape of {first})")


def _check_args(log_probs, loss_mask, turn_ids, ratio_level, clip_low, clip_high, loss_agg,
                dual_clip) -> None:
    if not log_probs.is_floating_point():
        raise ValueError(f"log_probs must be a floating tensor, got {log_probs.dtype}")
    if loss_mask.dtype != torch.bool:
        raise ValueError(f"loss_mask must be a bool tensor, got {loss_mask.dtype}")
    if turn_ids.is_floating_point() or turn_ids.dtype == torch.bool:
        raise ValueError(f"turn_ids must be an integer tensor, got {turn_ids.dtype}")
    if ratio_level not in RATIO_LEVELS:
        raise ValueError(f"ratio_level={ratio_level!r} is not valid; allowed: "
                         f"{', '.join(RATIO_LEVELS)}")
    if loss_agg not in LOSS_AGGS:
        raise ValueError(f"loss_agg={loss_agg!r} is not valid; allowed: {', '.join(LOSS_AGGS)}")
    if not 0.0 <= clip_low < 1.0:
        raise ValueError(f"clip_low must be in [0, 1), got {clip_low}")
    if not clip_high > 0.0:
        raise ValueError(f"clip_high must be > 0, got {clip_high}")
    if dual_clip is not None and not dual_clip > 1.0:
        raise ValueError(f"dual_clip must be None or > 1, got {dual_clip}")


def policy_loss(log_probs: torch.Tensor, old_log_probs: torch.Tensor, advantages: torch.Tensor,
                loss_mask: torch.Tensor, turn_ids: torch.Tensor, *, ratio_level: str,
                clip_low: float, clip_high: float, loss_agg: str, correction: Any = None,
                dual_clip: Optional[float] = None, global_denoms: GlobalDenoms = None,
                params: Optional[Iterable[torch.Tensor]] = None,
                ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The clipped policy loss of every preset and its diagnostics.

    Args:
      log_probs (N, T): log π_θ of each token (with graph). old_log_probs (N, T): log π_old.
      advantages (N, T). loss_mask (N, T) bool: agent tokens. turn_ids (N, T) long: turn of each
        agent token (used by ratio_level='turn'). Non-agent positions may hold anything (nan/inf).
      ratio_level: 'token' | 'turn' | 'sequence'. clip_low, clip_high: ε_low ∈ [0, 1), ε_high > 0.
      loss_agg: see `agg_loss`. correction: None or a mapping/dataclass with kind, tau,
        estimator, granularity (see `stppo.algos.clip_bias`). dual_clip: None or c > 1.
      global_denoms: (D_tok, D_seq) summed over shards, or None. params: the policy parameters,
        needed by correction estimator 'grad' only.
    Returns:
      loss (0-d, with graph) and metrics: detached 0-d tensors keyed by `stppo.tracking`
      constants. Fractions, ratio statistics and PPO_KL (mean −δ) are token-weighted over agent
      tokens; CLIP_BIAS_SCALE is the mean λ (over trajectories with agent tokens when per
      sequence); CLIP_BIAS_TRIGGERED is 1.0 if any λ < 1. PG_LOSS is the returned loss.
    """
    check_token_tensors(log_probs=log_probs, old_log_probs=old_log_probs, advantages=advantages,
                        loss_mask=loss_mask, turn_ids=turn_ids)
    _check_args(log_probs, loss_mask, turn_ids, ratio_level, clip_low, clip_high, loss_agg,
                dual_clip)
    spec = resolve_correction(correction)
    params = list(params) if params is not None else None

    ratio, delta = importance_ratio(log_probs, old_log_probs, loss_mask, turn_ids, ratio_level)
    with torch.no_grad():
        mf = mask_float(loss_mask, ratio.dtype)  # (N, T) 0/1
        w = agg_weights(loss_mask, loss_agg, None, ratio.dtype, mf=mf)  # (N, T) local weights
        w_loss = w if global_denoms is None else agg_weights(
            loss_mask, loss_agg, global_denoms, ratio.dtype, mf=mf)
        adv = torch.where(loss_mask, advantages, 0.0).to(ratio.dtype)  # (N, T)
        parts = surrogate_parts(ratio.detach(), adv, clip_low, clip_high, dual_clip)
        clipped = parts.clipped  # (N, T) bool; False off agent tokens since A = 0 there
        bias_sq = clip_bias_sq(ratio, adv, clipped)  # (N, T)
        bias_norm = weighted_sum(bias_sq, w).sqrt()

    lam, extra = None, {}
    if spec is not None:
        ctx = ClipContext(ratio, adv, clipped, loss_mask, loss_agg, w, bias_sq, bias_norm, params)
        lam, extra = CORRECTIONS[spec.kind].apply(ctx, spec)
    # loss = agg(λ s) with s = a ρ + b: Σ (λ w a) ρ + Σ λ w b — one dot product in ρ
    with torch.no_grad():
        w_l = w_loss * lam.unsqueeze(1) if lam is not None and lam.dim() else w_loss
        const = weighted_sum(parts.const, w_l)
        grad_coef = parts.coef * w_l  # (N, T)
    loss = weighted_sum(ratio, grad_coef) + const
    if lam is not None and not lam.dim():
        loss = loss * lam  # batch λ: a scalar factor

    metrics = _metrics(loss, ratio, delta, parts, mf, w, bias_norm, lam)
    metrics.update(extra)
    return loss, metrics


def _metrics(loss, ratio, delta, parts, mf, w, bias_norm, lam) -> dict:
    with torch.no_grad():
        n_tok = mf.sum().clamp(min=1)
        ratio = ratio.detach()
        s = parts.coef * ratio + parts.const  # (N, T) surrogate, 0 off agent tokens
        hi = torch.count_nonzero(parts.clipped_high) / n_tok
        lo = torch.count_nonzero(parts.clipped_low) / n_tok
        one = torch.ones((), device=ratio.device, dtype=ratio.dtype)
        if lam is None:
            scale, triggered = one, torch.zeros_like(one)
        elif lam.dim() == 0:
            scale, triggered = lam, (lam < 1.0).to(one.dtype)
        else:  # per trajectory: over trajectories with agent tokens
            has_tok = mf.sum(dim=1) > 0  # (N,)
            scale = torch.where(has_tok, lam, 0.0).sum() / has_tok.sum().clamp(min=1)
            triggered = (has_tok & (lam < 1.0)).any().to(one.dtype)
        ratio_m = ratio * mf  # (N, T) ρ > 0 and finite, so max over agent tokens is max of this
        return {
            PG_LOSS: loss.detach(),
            PG_LOSS_NORM: weighted_sum(s * s, w).sqrt(),
            PG_CLIPFRAC: hi + lo,
            PG_CLIPFRAC_HIGH: hi,
            PG_CLIPFRAC_LOW: lo,
            PPO_KL: -delta.detach().sum() / n_tok,
            RATIO_MEAN: ratio_m.sum() / n_tok,
            RATIO_MAX: ratio_m.max() if ratio_m.numel() else torch.zeros_like(one),
            CLIP_BIAS_NORM: bias_norm,
            CLIP_BIAS_NORM_MAX: bias_norm.clone(),
            CLIP_BIAS_SCALE: scale.detach().to(one.dtype),
            CLIP_BIAS_TRIGGERED: triggered,
        }
