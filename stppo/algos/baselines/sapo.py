"""SAPO: soft adaptive policy optimisation — a sigmoid gate instead of the hard clip (arXiv
2511.20347 v1; verl 0.9.1 `compute_policy_loss_sapo`, loss_mode 'sapo').

    f_τ(ρ) = σ(τ (ρ − 1)) · 4/τ,   τ_t = τ_pos if A_t > 0 else τ_neg,   s_t = −f_{τ_t}(ρ_t) A_t

so ∂s_t/∂log π_t = −4 σ(1 − σ) ρ_t A_t: the PPO gradient −ρA damped smoothly as ρ leaves 1
(weight 1 at ρ = 1). Limits: τ → 0 gives the unclipped gradient −ρA (f_τ(ρ) = 2/τ + (ρ − 1) +
O(τ²)); τ → ∞ gives zero gradient wherever ρ ≠ 1 — a trust region of width 0, not PPO's hard clip.
Clipping bias b_t = ρ_t A_t (1 − 4 σ(1 − σ)); nothing is clipped (κ = ∅). verl aggregates SAPO
with 'seq-mean-token-mean' whatever loss_agg_mode says; here `loss_agg` is used (the sapo preset
fixes seq-mean-token-mean). Options: tau_pos (verl default 1.0), tau_neg (1.05).
"""

from __future__ import annotations

import torch

from stppo.algos.baselines.common import assemble, metrics, token_view, weighted
from stppo.algos.contract import LossInputs, loss_mode

DEFAULTS = {"tau_pos": 1.0, "tau_neg": 1.05}


def check(opts: dict) -> None:
    for k in DEFAULTS:
        if not opts[k] > 0:
            raise ValueError(f"loss_mode='sapo': option {k} must be > 0, got {opts[k]}")


def sapo_gate(ratio: torch.Tensor, tau: torch.Tensor) -> torch.Tensor:
    """f_τ(ρ) = σ(τ (ρ − 1)) · 4/τ, elementwise."""
    return torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)


@loss_mode("sapo", options=DEFAULTS, ratio_levels=("token",), separable=True, check=check,
           source="SAPO (arXiv 2511.20347); verl 'sapo'")
def sapo_loss(x: LossInputs, spec) -> tuple[torch.Tensor, dict]:
    """(loss, metrics) of SAPO (module docstring)."""
    loss_mask, loss_agg, reduce, opts = x.loss_mask, spec.loss_agg, x.reduce, spec.options
    v = token_view(x, loss_agg)
    with torch.no_grad():
        taus = torch.tensor([opts["tau_pos"], opts["tau_neg"]], dtype=v.adv.dtype,
                            device=v.adv.device)  # tensors: torch.where of two floats is float32
        tau = torch.where(v.adv > 0, taus[0], taus[1])  # (N, T)
    s = weighted(v, -sapo_gate(v.ratio, tau) * v.adv)  # (N, T)
    loss = assemble(v, s)
    with torch.no_grad():
        rho = v.ratio.detach()
        sig = torch.sigmoid(tau * (rho - 1.0))
        bias = weighted(v, rho * v.adv * (1.0 - 4.0 * sig * (1.0 - sig)))
        none = torch.zeros_like(loss_mask)
    return loss, metrics(v, loss, s, none, none, bias, reduce)
