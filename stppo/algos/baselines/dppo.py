"""DPPO: divergence proximal policy optimisation — a trust region from a direct estimate of the
policy divergence instead of PPO's ratio clip (Qi et al., "Rethinking the Trust Region in LLM
Reinforcement Learning", arXiv 2602.04879 v1, the Binary-TV and Binary-KL approximations; verl
0.9.1 `compute_policy_loss_dppo_tv` / `compute_policy_loss_dppo_kl`, loss modes 'dppo_tv',
'dppo_kl'; the authors' code: github sail-sg/Stable-RL).

With p_t = π_θ(y_t) and p̂_t = π_old(y_t) the probabilities of the sampled token, the divergence
of the binary distribution {y_t, not y_t} decides whether token t is inside the trust region:

    Binary-TV:  D_t = p_t − p̂_t (signed),  m_t = 1[D_t ≤ δ_high] if A_t > 0 else 1[D_t ≥ −δ_low]
    Binary-KL:  D_t = p̂ log(p̂/p) + (1 − p̂) log((1 − p̂ + 10⁻⁸)/(1 − p + 10⁻⁸)),
                m_t = 1[D_t ≤ δ_high ∨ p_t ≤ p̂_t] if A_t > 0 else 1[D_t ≤ δ_low ∨ p_t ≥ p̂_t]

(a token leaves the region only by moving the way its advantage pushes it), and

    s_t = −m_t A_t sg(min(ρ_t, C)) log π_θ(y_t),   L = agg(s),   ρ_t = exp(δ_t)

so ∇L = Σ w (−m A min(ρ, C)) ∇log π: the importance-sampling policy gradient, truncated at C
(§5.4 of the paper: truncated IS instead of the dual clip, with a large C), on the tokens inside
the region; m is detached. δ_low = clip_low, δ_high = clip_high (verl reads its clip_ratio_low /
clip_ratio_high as these thresholds; the paper's 0.15 for TV and 0.05 for KL, per TRL's
`DPPOConfig` that cites it); C = option `clip_ratio_c` (default 20: verl's and TRL's code default;
verl's own loss reads `ActorConfig.clip_ratio_c`, default 3.0, which stppo's launcher sets to C;
the authors' repository uses 10).

Metrics, as verl's: κ_high = (A > 0) ∧ ¬m, κ_low = (A ≤ 0) ∧ ¬m (A = 0 counts as low, as verl
does), so actor/pg_clipfrac = mean(1 − m); actor/pg_clipfrac_lower = the share of agent tokens
inside the region whose ratio the truncation caps (ρ > C ∧ m). Clipping bias b_t = ρ_t A_t −
m_t A_t min(ρ_t, C).
"""

from __future__ import annotations

import torch

from stppo.algos.baselines.common import assemble, metrics, token_view, weighted
from stppo.algos.contract import LossInputs, loss_mode
from stppo.metric_names import PG_CLIPFRAC_LOWER

DEFAULTS = {"clip_ratio_c": 20.0}
KL_EPS = 1e-8  # verl's, inside the binary KL's second log


def check(opts: dict) -> None:
    if not opts["clip_ratio_c"] > 0:
        raise ValueError(f"loss_mode='dppo_*': clip_ratio_c must be > 0, got {opts['clip_ratio_c']}")


@torch.no_grad()
def binary_tv_mask(log_probs: torch.Tensor, old_log_probs: torch.Tensor, advantages: torch.Tensor,
                   clip_low: float, clip_high: float) -> torch.Tensor:
    """m (N, T) bool of Binary-TV (module docstring); inputs finite (masked first)."""
    diff = log_probs.exp() - old_log_probs.exp()  # (N, T) p − p̂
    return torch.where(advantages > 0, diff <= clip_high, diff >= -clip_low)


@torch.no_grad()
def binary_kl_mask(log_probs: torch.Tensor, old_log_probs: torch.Tensor, advantages: torch.Tensor,
                   clip_low: float, clip_high: float) -> torch.Tensor:
    """m (N, T) bool of Binary-KL (module docstring); inputs finite (masked first)."""
    p, p_old = log_probs.exp(), old_log_probs.exp()  # (N, T)
    kl = p_old * (old_log_probs - log_probs) + (1 - p_old) * torch.log(
        (1.0 - p_old + KL_EPS) / (1.0 - p + KL_EPS))  # (N, T)
    return torch.where(advantages > 0, (kl <= clip_high) | (p <= p_old),
                       (kl <= clip_low) | (p >= p_old))


def _dppo_loss(mask_fn, x: LossInputs, spec):
    log_probs, old_log_probs, loss_mask = x.log_probs, x.old_log_probs, x.loss_mask
    clip_low, clip_high, reduce = spec.clip_low, spec.clip_high, x.reduce
    v = token_view(x, spec.loss_agg)
    cap = spec.options["clip_ratio_c"]
    lp = torch.where(loss_mask, log_probs, 0.0).to(v.delta.dtype)  # (N, T) garbage → 0 first
    with torch.no_grad():
        old = torch.where(loss_mask, old_log_probs, 0.0).to(v.delta.dtype)  # (N, T)
        inside = mask_fn(lp.detach(), old, v.adv, clip_low, clip_high) & loss_mask  # (N, T) m
        rho = v.ratio.detach()
        coef = inside * v.adv * rho.clamp(max=cap)  # (N, T) m A min(ρ, C)
        out = loss_mask & ~inside
        hi, lo = out & (v.adv > 0), out & (v.adv <= 0)
    s = weighted(v, -coef * lp)  # (N, T)
    loss = assemble(v, s)
    bias = weighted(v, rho * v.adv - coef)
    m = metrics(v, loss, s, hi, lo, bias, reduce)
    m[PG_CLIPFRAC_LOWER] = (inside & (rho > cap)).sum() / v.lengths.sum().clamp(min=1)
    return loss, m


@loss_mode("dppo_tv", options=DEFAULTS, ratio_levels=("token",), separable=True, check=check,
           source="DPPO Binary-TV (arXiv 2602.04879); verl 'dppo_tv'")
def dppo_tv_loss(x: LossInputs, spec) -> tuple[torch.Tensor, dict]:
    """(loss, metrics) of DPPO-Binary-TV (module docstring)."""
    return _dppo_loss(binary_tv_mask, x, spec)


@loss_mode("dppo_kl", options=DEFAULTS, ratio_levels=("token",), separable=True, check=check,
           source="DPPO Binary-KL (arXiv 2602.04879); verl 'dppo_kl'")
def dppo_kl_loss(x: LossInputs, spec) -> tuple[torch.Tensor, dict]:
    """(loss, metrics) of DPPO-Binary-KL (module docstring)."""
    return _dppo_loss(binary_kl_mask, x, spec)
