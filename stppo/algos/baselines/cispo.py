"""CISPO: clipped importance-sampling-weight policy optimisation (MiniMax-M1, arXiv 2506.13585
v1, Eq. 4; verl 0.9.1 `compute_policy_loss_cispo`, loss_mode 'cispo').

    s_t = −sg(ρ̂_t) A_t log π_θ(y_t),   ρ̂_t = clip(ρ_t, 1 − ε_low, 1 + ε_high),   L = agg(s)

The weight, not the token, is clipped: every token keeps a gradient, −ρ̂_t A_t ∇log π_t.
Clipping bias b_t = (ρ_t − ρ̂_t) A_t. κ_high = ρ > 1 + ε_high, κ_low = ρ < 1 − ε_low, whatever the
sign of A (verl's pg_clipfrac is their sum; its pg_clipfrac_lower is always 0 here).
"""

from __future__ import annotations

import torch

from stppo.algos.baselines.common import assemble, metrics, token_view, weighted
from stppo.algos.contract import LossInputs, loss_mode


@loss_mode("cispo", ratio_levels=("token",), separable=True,
           source="MiniMax-M1 (arXiv 2506.13585); verl 'cispo'")
def cispo_loss(x: LossInputs, spec) -> tuple[torch.Tensor, dict]:
    """(loss, metrics) of CISPO (module docstring)."""
    log_probs, loss_mask = x.log_probs, x.loss_mask
    clip_low, clip_high, loss_agg, reduce = spec.clip_low, spec.clip_high, spec.loss_agg, x.reduce
    v = token_view(x, loss_agg)
    with torch.no_grad():
        rho = v.ratio.detach()  # (N, T)
        rho_hat = rho.clamp(1.0 - clip_low, 1.0 + clip_high)  # (N, T) sg(ρ̂)
        hi, lo = rho > 1.0 + clip_high, rho < 1.0 - clip_low  # (N, T)
    lp = torch.where(loss_mask, log_probs, 0.0).to(v.delta.dtype)  # (N, T) garbage → 0 first
    s = weighted(v, -rho_hat * v.adv * lp)  # (N, T)
    loss = assemble(v, s)
    bias = weighted(v, (rho - rho_hat) * v.adv)
    return loss, metrics(v, loss, s, hi, lo, bias, reduce)
