"""BAPO: balanced policy optimisation with adaptive clipping (Xi et al., arXiv 2510.18927 v1,
§4.2, Eq. 8 and Algorithm 1; no verl reference).

The PPO surrogate with ratio bounds [c_low, c_high] chosen per call so that positive-advantage
tokens' share of the loss reaches ρ₀. With r̄_t the ratio as the clipped objective uses it,

    r̄_t = min(ρ_t, c_high) if A_t > 0,   max(ρ_t, c_low) if A_t < 0
    P = Σ_{A_t>0} w_t r̄_t A_t,   N = Σ_{A_t<0} w_t r̄_t |A_t|,   ρ = P / (P + N)   (Eq. 8)

(ρ = 1 when P + N = 0), w the aggregation weights (the paper's sum over tokens; equal to it for
token-mean; with rollout IS weights, A_t ω_t in place of A_t). Algorithm 1: start at
c_low = a⁻ = 1 − clip_low, c_high = a⁺ = 1 + clip_high; while ρ < ρ₀ and c_low + δ₂ ≤ b⁻:
raise c_high by δ₁ if c_high + δ₁ ≤ b⁺, else raise c_low by δ₂. The states it visits are a fixed list — c_high = a⁺ + jδ₁ (j = 0..J), then c_low = a⁻ + iδ₂
(i = 1..I) at c_high = a⁺ + Jδ₁ — so ρ is evaluated for all of them at once and the first state
with ρ ≥ ρ₀ is taken (the last if none; the first alone if a⁻ + δ₂ > b⁻). No host sync; under
data parallelism (`reduce`) P and N are summed over the shards, so every shard picks the same
bounds (as the authors' code does since Jan 2026). The loss is then the clip path's surrogate
with clip_low = 1 − c_low, clip_high = c_high − 1 and the caller's dual clip; clipping bias
b_t = κ_t ρ_t A_t.

Defaults are the paper's (§5.1, implementation details): ρ₀ = 0.4, [a⁻, b⁻] = [0.6, 0.9],
[a⁺, b⁺] = [1.2, 3.0], δ₁ = 0.05, δ₂ = 0.02 — the bapo preset sets clip_low = 0.4, clip_high = 0.2
for a⁻, a⁺. (The authors' verl recipe raises c_low first, then c_high, and uses ρ₀ = 0.5 as a
positive/negative ratio of 1; this module follows the paper.) Options: rho0, lower_max (b⁻),
upper_max (b⁺), lower_step (δ₂), upper_step (δ₁).
"""

from __future__ import annotations

import math

import torch

from stppo.algos.baselines.common import assemble, metrics, token_view, weighted
from stppo.algos.contract import LossInputs, loss_mode
from stppo.algos.clip_bias import Reduce
from stppo.algos.surrogate import surrogate_parts
from stppo.metric_names import BAPO_CLIP_HIGH, BAPO_CLIP_LOW, BAPO_POS_SHARE

DEFAULTS = {"rho0": 0.4, "lower_max": 0.9, "upper_max": 3.0, "lower_step": 0.02,
            "upper_step": 0.05}
_TOL = 1e-9  # float slack in "c + δ ≤ b"


def check(opts: dict) -> None:
    if not 0.0 < opts["rho0"] < 1.0:
        raise ValueError(f"loss_mode='bapo': rho0 must be in (0, 1), got {opts['rho0']}")
    for k in ("lower_step", "upper_step", "lower_max", "upper_max"):
        if not opts[k] > 0:
            raise ValueError(f"loss_mode='bapo': {k} must be > 0, got {opts[k]}")


def bapo_schedule(c_low: float, c_high: float, opts: dict) -> list[tuple[float, float]]:
    """The (c_low, c_high) states Algorithm 1 visits, in order, from (a⁻, a⁺) = (c_low, c_high)."""
    lo_step, hi_step = opts["lower_step"], opts["upper_step"]
    n_lo = max(0, math.floor((opts["lower_max"] - c_low) / lo_step + _TOL))
    if n_lo == 0:  # the while condition fails at once: the bounds never move
        return [(c_low, c_high)]
    n_hi = max(0, math.floor((opts["upper_max"] - c_high) / hi_step + _TOL))
    states = [(c_low, c_high + j * hi_step) for j in range(n_hi + 1)]
    top = states[-1][1]
    return states + [(c_low + i * lo_step, top) for i in range(1, n_lo + 1)]


@torch.no_grad()
def positive_share(ratio: torch.Tensor, advantages: torch.Tensor, weights: torch.Tensor,
                   c_low: torch.Tensor, c_high: torch.Tensor,
                   reduce: Reduce = None) -> torch.Tensor:
    """ρ of Eq. 8 for each candidate pair (c_low[k], c_high[k]) (K,): P / (P + N), 1 if P + N = 0.

    ratio, advantages, weights (N, T) (advantages 0 and weights 0 off agent tokens)."""
    sel = weights > 0
    r, a, w = ratio[sel], advantages[sel], weights[sel]  # (M,)
    pos, neg = a > 0, a < 0
    r_pos = torch.minimum(r.unsqueeze(0), c_high.unsqueeze(1))  # (K, M)
    r_neg = torch.maximum(r.unsqueeze(0), c_low.unsqueeze(1))  # (K, M)
    p = (r_pos * torch.where(pos, w * a, 0.0)).sum(dim=1)  # (K,)
    n = (r_neg * torch.where(neg, -w * a, 0.0)).sum(dim=1)  # (K,)
    pn = torch.stack([p, n])  # (2, K)
    if reduce is not None:
        pn = reduce(pn)
    total = pn.sum(dim=0)
    return torch.where(total > 0, pn[0] / total.clamp(min=1e-30), 1.0)


@loss_mode("bapo", options=DEFAULTS, ratio_levels=("token",), dual_clip=True, separable=False,
           check=check, source="BAPO (arXiv 2510.18927)")
def bapo_loss(x: LossInputs, spec) -> tuple[torch.Tensor, dict]:
    """(loss, metrics) of BAPO (module docstring)."""
    clip_low, clip_high, dual_clip, loss_agg = spec.clip_low, spec.clip_high, spec.dual_clip, spec.loss_agg
    reduce, opts = x.reduce, spec.options
    v = token_view(x, loss_agg)
    states = torch.tensor(bapo_schedule(1.0 - clip_low, 1.0 + clip_high, opts),
                          dtype=v.delta.dtype, device=v.delta.device)  # (K, 2)
    with torch.no_grad():
        rho = v.ratio.detach()
        share = positive_share(rho, weighted(v, v.adv), v.w_corr, states[:, 0], states[:, 1],
                               reduce)  # (K,)
        met = share >= opts["rho0"]
        k = torch.where(met.any(), met.to(torch.uint8).argmax(), len(states) - 1)
        c_low, c_high = states[k, 0], states[k, 1]  # 0-d
        parts = surrogate_parts(rho, v.adv, 1.0 - c_low, c_high - 1.0, dual_clip)
    s = weighted(v, parts.coef * v.ratio + parts.const)  # (N, T)
    loss = assemble(v, s)
    bias = weighted(v, parts.clipped * rho * v.adv)
    m = metrics(v, loss, s, parts.clipped_high, parts.clipped_low, bias, reduce)
    m.update({BAPO_CLIP_LOW: c_low, BAPO_CLIP_HIGH: c_high, BAPO_POS_SHARE: share[k]})
    return loss, m

