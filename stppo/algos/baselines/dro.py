"""DRO: direct reward optimisation — the policy-gradient term of the sampled tokens with a
quadratic penalty on the log-ratio instead of a clip (Richemond et al., "Offline Regularised
Reinforcement Learning for Large Language Models Alignment", arXiv 2405.19107; the gradient of
Kimi k1.5's policy optimisation, arXiv 2501.12599, has this form; verl 0.9.1
`compute_policy_loss_dro`, loss mode 'dro', added by verl PR #7245, which cites no paper; Tinker's
'dro' loss is the same per-token objective and cites both):

    s_t = −( A_t log π_θ(y_t) − (β/2) δ_t² ),   L = agg(s),   δ_t = log π_θ(y_t) − log π_old(y_t)

so ∂s_t/∂log π_t = −A_t + β δ_t: every token keeps the plain policy gradient −A, pulled back
towards π_old in proportion to how far it moved. Nothing is clipped (κ = ∅); the clipping bias,
against the unclipped importance-weighted gradient −ρA, is b_t = (ρ_t − 1) A_t + β δ_t.
Option: beta (β > 0; verl's `policy_loss.dro_beta` has no default and must be set — 0.05 here,
the value of verl PR #7245's usage example and of Tinker's documentation). verl's δ is not
clamped; stppo's is clamped to ±20 (every mode), so the two agree wherever |δ| ≤ 20. verl returns
only actor/ppo_kl (mean −δ); the other metrics are the clip path's keys (`baselines.common`).
"""

from __future__ import annotations

import torch

from stppo.algos.baselines.common import assemble, metrics, token_view, weighted
from stppo.algos.contract import LossInputs, loss_mode

DEFAULTS = {"beta": 0.05}


def check(opts: dict) -> None:
    if not opts["beta"] > 0:
        raise ValueError(f"loss_mode='dro': beta must be > 0, got {opts['beta']}")


@loss_mode("dro", options=DEFAULTS, ratio_levels=("token",), separable=True, check=check,
           source="DRO (arXiv 2405.19107); verl 'dro'")
def dro_loss(x: LossInputs, spec) -> tuple[torch.Tensor, dict]:
    """(loss, metrics) of DRO (module docstring)."""
    log_probs, loss_mask = x.log_probs, x.loss_mask
    loss_agg, reduce, opts = spec.loss_agg, x.reduce, spec.options
    v = token_view(x, loss_agg)
    beta = opts["beta"]
    lp = torch.where(loss_mask, log_probs, 0.0).to(v.delta.dtype)  # (N, T) garbage → 0 first
    s = weighted(v, -(v.adv * lp - 0.5 * beta * v.delta.square()))  # (N, T)
    loss = assemble(v, s)
    with torch.no_grad():
        rho, delta = v.ratio.detach(), v.delta.detach()
        bias = weighted(v, (rho - 1.0) * v.adv + beta * delta)
        none = torch.zeros_like(loss_mask)
    return loss, metrics(v, loss, s, none, none, bias, reduce)
