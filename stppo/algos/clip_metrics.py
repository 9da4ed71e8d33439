"""The metrics of the clip path of `policy_loss`, shared by the token path (`stppo.algos.loss`)
and the turn path (`stppo.algos.turn_clip`), which compute their inputs differently."""

from __future__ import annotations

from typing import Optional

import torch

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
    CLIP_BIAS_TRIGGERED 1.0 if any λ < 1; λ None means no correction (1, 0)."""
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
