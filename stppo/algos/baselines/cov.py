"""Clip-Cov and KL-Cov: covariance-based token selection (arXiv 2505.22617 v1 §4; verl 0.9.1
`compute_policy_loss_clip_cov` / `compute_policy_loss_kl_cov`, loss modes of the same names).

Over the agent tokens of the call, the centred covariance of each token between its advantage and
its log-probability:

    Cov_t = (A_t − mean A) · (log π_θ(y_t) − mean log π_θ)

Clip-Cov: the PPO clipped surrogate s_t (`stppo.algos.surrogate`, no dual clip); among the tokens
the clip leaves alone with clip_cov_lb < Cov_t < clip_cov_ub, max(1, ⌊r · n⌋) tokens (r =
clip_cov_ratio, n the agent tokens) drawn uniformly at random lose their gradient (s_t → 0).
The draw is verl's: `torch.randperm` over the candidates in row-major order, from torch's global
generator (seed it for reproducible runs). Clipping bias b_t = ρ_t A_t on clipped or detached tokens.

KL-Cov: the unclipped surrogate −ρ_t A_t; the max(1, ⌊r · n⌋) tokens of largest Cov_t
(r = kl_cov_ratio) get the penalty ppo_kl_coef · |δ_t| added. Clipping bias b_t = ppo_kl_coef ·
sign(δ_t) on the penalised tokens; nothing is clipped.

Both report `actor/cov_selected_frac` (verl's pg_clipfrac for clip_cov). verl's kl_cov reports
mean |δ| as actor/ppo_kl; here PPO_KL is mean −δ as in every loss. Both need the token count on
the host (one sync per call, as verl's `.item()`). Defaults are verl's PolicyLossConfig's.
"""

from __future__ import annotations

import torch

from stppo.algos.baselines.common import assemble, metrics, token_view, weighted
from stppo.algos.contract import LossInputs, loss_mode
from stppo.algos.surrogate import surrogate_parts
from stppo.metric_names import COV_SELECTED_FRAC

CLIP_COV_DEFAULTS = {"clip_cov_ratio": 2e-4, "clip_cov_lb": 1.0, "clip_cov_ub": 5.0}
KL_COV_DEFAULTS = {"kl_cov_ratio": 2e-4, "ppo_kl_coef": 0.1}


def check_clip_cov(opts: dict) -> None:
    if not 0 < opts["clip_cov_ratio"] <= 1:
        raise ValueError(f"loss_mode='clip_cov': clip_cov_ratio must be in (0, 1], "
                         f"got {opts['clip_cov_ratio']}")
    if not opts["clip_cov_lb"] < opts["clip_cov_ub"]:
        raise ValueError("loss_mode='clip_cov': clip_cov_lb must be < clip_cov_ub, got "
                         f"{opts['clip_cov_lb']} and {opts['clip_cov_ub']}")


def check_kl_cov(opts: dict) -> None:
    if not 0 < opts["kl_cov_ratio"] <= 1:
        raise ValueError(f"loss_mode='kl_cov': kl_cov_ratio must be in (0, 1], "
                         f"got {opts['kl_cov_ratio']}")
    if not opts["ppo_kl_coef"] >= 0:
        raise ValueError(f"loss_mode='kl_cov': ppo_kl_coef must be >= 0, got {opts['ppo_kl_coef']}")


@torch.no_grad()
def token_covariance(advantages: torch.Tensor, log_probs: torch.Tensor,
                     loss_mask: torch.Tensor) -> torch.Tensor:
    """Cov_t of the module docstring on agent tokens, 0 elsewhere. (N, T)"""
    mf = loss_mask.to(log_probs.dtype)
    n = mf.sum().clamp(min=1)
    a = torch.where(loss_mask, advantages, 0.0).to(log_probs.dtype)
    lp = torch.where(loss_mask, log_probs, 0.0)
    return torch.where(loss_mask, (a - a.sum() / n) * (lp - lp.sum() / n), 0.0)


def n_selected(ratio: float, loss_mask: torch.Tensor) -> int:
    """max(1, ⌊ratio · n⌋), n = agent tokens (verl's count; a host sync)."""
    return max(int(ratio * int(loss_mask.sum())), 1)


@loss_mode("clip_cov", options=CLIP_COV_DEFAULTS, ratio_levels=("token",), separable=False,
           check=check_clip_cov, source="Clip-Cov (arXiv 2505.22617); verl 'clip_cov'")
def clip_cov_loss(x: LossInputs, spec) -> tuple[torch.Tensor, dict]:
    """(loss, metrics) of Clip-Cov (module docstring)."""
    log_probs, advantages, loss_mask = x.log_probs, x.advantages, x.loss_mask
    clip_low, clip_high, loss_agg = spec.clip_low, spec.clip_high, spec.loss_agg
    reduce, opts = x.reduce, spec.options
    v = token_view(x, loss_agg)
    with torch.no_grad():
        rho = v.ratio.detach()
        eps = torch.tensor([clip_low, clip_high], dtype=rho.dtype, device=rho.device)  # bounds
        parts = surrogate_parts(rho, v.adv, eps[0], eps[1])  # in ρ's dtype, not float32
        cov = token_covariance(advantages, log_probs.detach(), loss_mask)  # (N, T)
        cand = (loss_mask & ~parts.clipped & (cov > opts["clip_cov_lb"])
                & (cov < opts["clip_cov_ub"]))  # (N, T)
        idx = torch.nonzero(cand)  # (M, 2) row-major, as verl
        sel = torch.zeros_like(loss_mask)
        if len(idx) > 0:
            perm = torch.randperm(len(idx))  # global generator, as verl
            idx = idx[perm[:min(n_selected(opts["clip_cov_ratio"], loss_mask), len(idx))]]
            sel[idx[:, 0], idx[:, 1]] = True
    s = weighted(v, torch.where(sel, 0.0, parts.coef * v.ratio + parts.const))  # (N, T)
    loss = assemble(v, s)
    bias = weighted(v, (parts.clipped | sel) * rho * v.adv)
    m = metrics(v, loss, s, parts.clipped_high, parts.clipped_low, bias, reduce)
    m[COV_SELECTED_FRAC] = sel.sum() / v.lengths.sum().clamp(min=1)
    return loss, m


@loss_mode("kl_cov", options=KL_COV_DEFAULTS, ratio_levels=("token",), separable=False,
           check=check_kl_cov, source="KL-Cov (arXiv 2505.22617); verl 'kl_cov'")
def kl_cov_loss(x: LossInputs, spec) -> tuple[torch.Tensor, dict]:
    """(loss, metrics) of KL-Cov (module docstring)."""
    log_probs, advantages, loss_mask = x.log_probs, x.advantages, x.loss_mask
    loss_agg, reduce, opts = spec.loss_agg, x.reduce, spec.options
    v = token_view(x, loss_agg)
    coef = opts["ppo_kl_coef"]
    with torch.no_grad():
        valid = torch.nonzero(loss_mask.reshape(-1), as_tuple=True)[0]  # (M,) row-major
        a = advantages.reshape(-1)[valid].to(v.delta.dtype)  # (M,)
        lp = log_probs.detach().reshape(-1)[valid]  # (M,)
        sel = torch.zeros_like(loss_mask)
        if len(valid) > 0:
            cov = (a - a.mean()) * (lp - lp.mean())  # (M,)
            k = n_selected(opts["kl_cov_ratio"], loss_mask)
            sel.view(-1)[valid[torch.topk(cov, k, largest=True).indices]] = True
    s = weighted(v, -v.adv * v.ratio + coef * v.delta.abs() * sel)  # (N, T)
    loss = assemble(v, s)
    bias = weighted(v, coef * v.delta.detach().sign() * sel)
    none = torch.zeros_like(loss_mask)
    m = metrics(v, loss, s, none, none, bias, reduce)
    m[COV_SELECTED_FRAC] = sel.sum() / v.lengths.sum().clamp(min=1)
    return loss, m
