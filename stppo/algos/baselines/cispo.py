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


def cispo_loss(log_probs, old_log_probs, advantages, loss_mask, turn_ids, *, clip_low, clip_high,
               loss_agg, global_denoms=None, reduce=None, rollout_is_weights=None, opts=None,
               **_):
    """(loss, metrics) of CISPO; tensors (N, T) as `policy_loss`."""
    v = token_view(log_probs, old_log_probs, advantages, loss_mask, loss_agg, global_denoms,
                   reduce, rollout_is_weights)
    with torch.no_grad():
        rho = v.ratio.detach()  # (N, T)
        rho_hat = rho.clamp(1.0 - clip_low, 1.0 + clip_high)  # (N, T) sg(ρ̂)
        hi, lo = rho > 1.0 + clip_high, rho < 1.0 - clip_low  # (N, T)
    lp = torch.where(loss_mask, log_probs, 0.0).to(v.delta.dtype)  # (N, T) garbage → 0 first
    s = weighted(v, -rho_hat * v.adv * lp)  # (N, T)
    loss = assemble(v, s)
    bias = weighted(v, (rho - rho_hat) * v.adv)
    return loss, metrics(v, loss, s, hi, lo, bias, reduce)
