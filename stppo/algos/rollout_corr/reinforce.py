"""The bypass-mode REINFORCE loss, the loss mode `reinforce` (verl 0.9.1
`compute_policy_loss_reinforce`, reached through `compute_policy_loss_bypass_mode` with loss_type
'reinforce'). docs/design.md §2, "Rollout correction".

In bypass mode π_old is the sampler's π_rollout and the loss is a plain policy gradient with
explicit importance weights instead of PPO's clipped ratio:

    s_t = −ω_t A_t log π_θ(y_t),   L = agg(s)          ∇L = −agg(ω A ∇log π_θ)

ω (detached) are the correction's IS weights between π_θ and π_rollout (truncated or IcePop,
token or sequence level), 1 without any. Metrics: the clip path's keys of the ratio
ρ = π_θ / π_rollout (what a clipped surrogate at the spec's range would clip: κ, its fractions,
ρ's mean and max, −δ as actor/ppo_kl — verl's only metric here), with the clipping bias of the
generalised definition (`stppo.algos.baselines.common`): g_t = −ω_t A_t, so b_t = (ρ_t − ω_t) A_t.

A registered loss mode like any other. A spec runs it when its rollout correction is a bypass
one with loss_type 'reinforce' (`RolloutCorrection.reinforce`): `LossSpec` then names this mode
in place of the preset's clip path, which it replaces; it runs with no other correction.
"""

from __future__ import annotations

import torch

from stppo.algos.baselines.common import assemble, metrics, token_view, weighted
from stppo.algos.contract import LossInputs, loss_mode
from stppo.algos.surrogate import clipped_surrogate


@loss_mode("reinforce", ratio_levels=("token",), dual_clip=True, separable=True,
           source="verl 'reinforce' (compute_policy_loss_bypass_mode, loss_type reinforce)")
def reinforce_loss(x: LossInputs, spec) -> tuple[torch.Tensor, dict]:
    """(loss, metrics) of the bypass REINFORCE loss, with the contract of a loss mode
    (`stppo.algos.contract`): `x.old_log_probs` are π_rollout's; the spec's clip range and dual
    clip only say what a clipped surrogate would clip (the metrics)."""
    log_probs, loss_mask = x.log_probs, x.loss_mask
    v = token_view(x, spec.loss_agg)
    lp = torch.where(loss_mask, log_probs, 0.0).to(v.delta.dtype)  # (N, T) garbage → 0 first
    s = weighted(v, -v.adv * lp)  # (N, T) −ω A log π
    loss = assemble(v, s)
    with torch.no_grad():
        rho = v.ratio.detach()  # (N, T)
        omega = torch.ones_like(rho) if v.is_w is None else v.is_w
        sur = clipped_surrogate(rho, v.adv, spec.clip_low, spec.clip_high, spec.dual_clip)
        bias = (rho - omega) * v.adv  # (N, T)
    return loss, metrics(v, loss, s, sur.clipped_high, sur.clipped_low, bias, x.reduce)
