"""Critic loss (PPO-style value clipping) and explained variance (docs/design.md §2, §4).

    e1 = (V − R)²,  e2 = (clip(V, V_old − ε_v, V_old + ε_v) − R)²
    L_V = ½ agg(max(e1, e2))           (½ agg(e1) when clip_range is None)
    critic/vf_clipfrac = token-mean over agent tokens of 1[e2 > e1]   (as verl)
"""

from __future__ import annotations

from typing import Optional

import torch

from stppo.algos.aggregation import GlobalDenoms, agg_loss
from stppo.metric_names import VF_CLIPFRAC, VF_LOSS


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
               loss_mask: torch.Tensor, *, clip_range: Optional[float],
               loss_agg: str = "token-mean", global_denoms: GlobalDenoms = None,
               ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped value loss (loss, {critic/vf_loss, critic/vf_clipfrac}); all tensors (N, T)."""
    if clip_range is not None and not clip_range > 0:
        raise ValueError(f"clip_range must be None or > 0, got {clip_range}")
    v = torch.where(loss_mask, values, 0.0)  # (N, T)
    ret = torch.where(loss_mask, returns.detach(), 0.0).to(v.dtype)
    err = (v - ret).square()  # (N, T) e1
    if clip_range is None:
        frac = torch.zeros((), device=v.device)
    else:
        old = torch.where(loss_mask, old_values.detach(), 0.0).to(v.dtype)
        v_clip = old + (v - old).clamp(-clip_range, clip_range)
        err_clip = (v_clip - ret).square()  # (N, T) e2
        with torch.no_grad():
            frac = ((err_clip > err) & loss_mask).sum() / loss_mask.sum().clamp(min=1)
        err = torch.maximum(err, err_clip)
    loss = 0.5 * agg_loss(err, loss_mask, loss_agg, global_denoms)
    return loss, {VF_LOSS: loss.detach(), VF_CLIPFRAC: frac.float()}


@torch.no_grad()
def explained_variance(values: torch.Tensor, returns: torch.Tensor,
                       loss_mask: torch.Tensor) -> torch.Tensor:
    """1 − Var(R − V) / Var(R) over agent tokens (detached 0-d; 0 when Var(R) ≈ 0, e.g. a batch
    whose rewards are all equal: the ratio is then float noise, not a statistic)."""
    n = loss_mask.sum().clamp(min=1)
    r = torch.where(loss_mask, returns, 0.0)
    d = torch.where(loss_mask, returns - values, 0.0)

    def var(x: torch.Tensor) -> torch.Tensor:
        mean = x.sum() / n
        return torch.where(loss_mask, (x - mean).square(), 0.0).sum() / n

    var_r = var(r)
    return torch.where(var_r > 1e-8, 1.0 - var(d) / var_r.clamp(min=1e-8), torch.zeros_like(var_r))
