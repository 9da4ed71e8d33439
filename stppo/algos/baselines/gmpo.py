"""GMPO: geometric-mean policy optimisation (arXiv 2507.20673 v1; verl 0.9.1
`compute_policy_loss_geo_mean`, loss_mode 'geo_mean').

Token log-ratios are clipped in log space by the sign of the advantage, then averaged:

    δ̃_t = sgn(A_t) · min(sgn(A_t) δ_t, sgn(A_t) clip(δ_t, −ε_low, ε_high))
    ρ̄_i = exp( (1/|y_i|) Σ_t δ̃_t ),   Ā_i = (1/|y_i|) Σ_t A_t,   s_i = −Ā_i ρ̄_i

i.e. the geometric mean of the clipped token ratios (ε in log space: the paper's (e^−0.4, e^0.4)
is clip_low = clip_high = 0.4). The loss aggregates the per-trajectory s_i with `loss_agg`
(broadcast to the trajectory's tokens): 'seq-mean-token-mean' gives (1/D_seq) Σ_i s_i, verl's
form, except that verl divides by all rows (torch.mean) — rows without agent tokens included —
and by |y_i| + 1e-8. κ_high = (A > 0) ∧ (δ > ε_high), κ_low = (A < 0) ∧ (δ < −ε_low): the tokens
whose clip binds (verl's pg_clipfrac / pg_clipfrac_lower also count out-of-range tokens whose
clip does not bind). Clipping bias b_t = κ_t ρ̄_i Ā_i, as for sequence ratios in the clip path.
Rollout IS weights ω enter per trajectory as verl's: exp(mean_t log ω_t).
"""

from __future__ import annotations

import torch

from stppo.algos.baselines.common import assemble, metrics, token_view
from stppo.algos.contract import LossInputs, loss_mode


@loss_mode("gmpo", ratio_levels=("sequence",), separable=True,
           source="GMPO (arXiv 2507.20673); verl 'geo_mean'")
def gmpo_loss(x: LossInputs, spec) -> tuple[torch.Tensor, dict]:
    """(loss, metrics) of GMPO (module docstring)."""
    loss_mask = x.loss_mask
    clip_low, clip_high, loss_agg, reduce = spec.clip_low, spec.clip_high, spec.loss_agg, x.reduce
    v = token_view(x, loss_agg)
    with torch.no_grad():
        pos, neg = v.adv > 0, v.adv < 0  # (N, T)
        hi = pos & (v.delta > clip_high)  # (N, T) the clip binds
        lo = neg & (v.delta < -clip_low)
        eps = torch.tensor([clip_high, -clip_low], dtype=v.delta.dtype, device=v.delta.device)
        bound = torch.where(hi, eps[0], eps[1])  # (N, T) (tensors: two floats give float32)
        n = v.lengths.clamp(min=1.0)  # (N,)
        adv_seq = v.adv.sum(dim=1) / n  # (N,) Ā_i
    d = torch.where(hi | lo, bound, v.delta) * (v.adv != 0)  # (N, T) δ̃, 0 where A = 0 (sgn 0)
    rho_seq = (d.sum(dim=1) / n).exp()  # (N,) ρ̄_i with graph
    with torch.no_grad():  # verl: the geometric mean of the trajectory's rollout IS weights
        omega = torch.ones_like(n) if v.is_w is None else (
            torch.where(loss_mask, v.is_w.log(), 0.0).sum(dim=1) / n).exp()  # (N,)
    s = (-adv_seq * omega * rho_seq).unsqueeze(1) * v.mf  # (N, T) s_i on the agent tokens
    loss = assemble(v, s)
    with torch.no_grad():
        ratio = rho_seq.detach().unsqueeze(1) * v.mf + (1.0 - v.mf)  # (N, T)
        bias = (hi | lo) * (rho_seq.detach() * adv_seq * omega).unsqueeze(1)  # (N, T) κ ρ̄ Ā
    return loss, metrics(v, loss, s, hi, lo, bias, reduce, ratio=ratio)
