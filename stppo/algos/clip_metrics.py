"""The metrics of the clip path of `policy_loss`, shared by the token path (`stppo.algos.loss`)
and the turn path (`stppo.algos.turn_clip`), which compute their inputs differently."""

from __future__ import annotations

from typing import Optional

import torch

from stppo.algos.ratios import importance_ratio
from stppo.algos.surrogate import surrogate_parts
from stppo.metric_names import (CLIP_BIAS_NORM, CLIP_BIAS_NORM_MAX, CLIP_BIAS_SCALE,
                            CLIP_BIAS_TRIGGERED, PG_CLIPFRAC, PG_CLIPFRAC_HIGH, PG_CLIPFRAC_LOW,
                            PG_LOSS, PG_LOSS_NORM, PPO_KL, RATIO_MAX, RATIO_MEAN)


@torch.no_grad()
def clip_metrics(loss: torch.Tensor, *, loss_norm: torch.Tensor, clipfrac_high: torch.Tensor,
                 clipfrac_low: torch.Tensor, ppo_kl: torch.Tensor, ratio_mean: torch.Tensor,
                 ratio_max: torch.Tensor, bias_norm: torch.Tensor, scale: Optional[torch.Tensor],
                 lengths: torch.Tensor) -> dict[str, torch.Tensor]:
    """Detached 0-d metrics keyed by `stppo.metric_names` constants. CLIP_BIAS_SCALE is the mean λ
    (over trajectories with agent tokens when λ is per trajectory, `lengths` (N,) > 0),
    CLIP_BIAS_TRIGGERED 1.0 if any λ < 1; λ None means no clip-bias scale (1, 0)."""
    one = torch.ones((), device=ratio_mean.device, dtype=ratio_mean.dtype)
    if scale is None:
        mean_scale, triggered = one, torch.zeros_like(one)
    elif scale.dim() == 0:
        mean_scale, triggered = scale, (scale < 1.0).to(one.dtype)
    else:  # per trajectory: over trajectories with agent tokens
        has_tok = lengths > 0  # (N,)
        mean_scale = torch.where(has_tok, scale, 0.0).sum() / has_tok.sum().clamp(min=1)
        triggered = (has_tok & (scale < 1.0)).any().to(one.dtype)
    return {
        PG_LOSS: loss.detach(),
        PG_LOSS_NORM: loss_norm,
        PG_CLIPFRAC: clipfrac_high + clipfrac_low,
        PG_CLIPFRAC_HIGH: clipfrac_high,
        PG_CLIPFRAC_LOW: clipfrac_low,
        PPO_KL: ppo_kl,
        RATIO_MEAN: ratio_mean,
        RATIO_MAX: ratio_max,
        CLIP_BIAS_NORM: bias_norm,
        CLIP_BIAS_NORM_MAX: bias_norm.clone(),
        CLIP_BIAS_SCALE: mean_scale.detach().to(one.dtype),
        CLIP_BIAS_TRIGGERED: triggered,
    }


@torch.no_grad()
def clip_fractions(log_probs: torch.Tensor, old_log_probs: torch.Tensor, advantages: torch.Tensor,
                   loss_mask: torch.Tensor, turn_ids: torch.Tensor, *, ratio_level: str,
                   clip_low: float, clip_high: float) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """({PG_CLIPFRAC (= _HIGH + _LOW)}, κ (N, T) bool): where the clip binds, from ρ at
    `ratio_level` and the sign of the *unweighted* advantage, and its shares of the agent tokens,
    as verl counts them (`compute_policy_loss_vanilla` takes its clip fraction before it
    multiplies the loss by the rollout IS weights): a token with weight 0 outside the clip range
    counts as clipped. (N, T) inputs; detached."""
    ratio, _ = importance_ratio(log_probs.detach(), old_log_probs, loss_mask, turn_ids, ratio_level)
    adv = torch.where(loss_mask, advantages, 0.0).to(ratio.dtype)
    parts = surrogate_parts(ratio, adv, clip_low, clip_high)
    n = loss_mask.sum().clamp(min=1)
    high, low = (parts.clipped_high & loss_mask).sum() / n, (parts.clipped_low & loss_mask).sum() / n
    return {PG_CLIPFRAC: high + low, PG_CLIPFRAC_HIGH: high, PG_CLIPFRAC_LOW: low}, parts.clipped
