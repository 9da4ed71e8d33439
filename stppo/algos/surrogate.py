"""The clipped PPO surrogate with decoupled clip range and optional dual clip (docs/design.md §2).

    s_t = max(−A_t ρ_t, −A_t clip(ρ_t, 1 − ε_low, 1 + ε_high))
    dual clip (c > 1, A_t < 0):  s_t = min(s_t, −c A_t)

The clipped indicator κ_t = 1[the clip binds] splits into
    κ_high = (A_t > 0) ∧ (ρ_t > 1 + ε_high),   κ_low = (A_t < 0) ∧ (ρ_t < 1 − ε_low).
Dual-clip binding (A_t < 0 ∧ ρ_t > c) is *not* part of κ: κ is the clipping of the trust region
whose bias docs/design.md §2 measures.

Every case is affine in ρ with constant coefficients: s_t = a_t ρ_t + b_t where
    a_t = −A_t, b_t = 0                 when no clip binds,
    a_t = 0,    b_t = −A_t β_t          when one binds, β_t ∈ {1 + ε_high, 1 − ε_low, c} —
identical to the max/min form above (at ties both branches have the same value), with the
gradient ∂s/∂ρ = a. `policy_loss` uses (a, b) directly: loss = Σ w a ρ + Σ w b.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch


class SurrogateParts(NamedTuple):
    coef: torch.Tensor  # (N, T) a = ∂s/∂ρ, no grad
    const: torch.Tensor  # (N, T) b, no grad
    clipped_high: torch.Tensor  # (N, T) bool κ_high
    clipped_low: torch.Tensor  # (N, T) bool κ_low

    @property
    def clipped(self) -> torch.Tensor:  # (N, T) bool κ
        return self.clipped_high | self.clipped_low


class Surrogate(NamedTuple):
    loss: torch.Tensor  # (N, T) s_t
    clipped_high: torch.Tensor  # (N, T) bool κ_high
    clipped_low: torch.Tensor  # (N, T) bool κ_low

    @property
    def clipped(self) -> torch.Tensor:  # (N, T) bool κ
        return self.clipped_high | self.clipped_low


@torch.no_grad()
def surrogate_parts(ratio: torch.Tensor, advantages: torch.Tensor, clip_low: float,
                    clip_high: float, dual_clip: Optional[float] = None) -> SurrogateParts:
    """(a, b, κ_high, κ_low) with s = a ρ + b; `ratio`, `advantages` (N, T) finite. `clip_low`,
    `clip_high`: floats, or tensors broadcasting to (N, T) (per-token bounds: SSPO)."""
    adv = advantages.to(ratio.dtype)
    pos, neg = adv > 0, adv < 0  # (N, T)
    clipped_high = pos & (ratio > 1.0 + clip_high)  # (N, T)
    clipped_low = neg & (ratio < 1.0 - clip_low)  # (N, T)
    fixed = clipped_high | clipped_low
    hi = torch.as_tensor(1.0 + clip_high, dtype=ratio.dtype, device=ratio.device)  # not float32
    bound = torch.where(clipped_high, hi, 1.0 - clip_low)  # (N, T) β in ρ's dtype
    if dual_clip is not None:
        dual = neg & (ratio > dual_clip)  # (N, T); never κ_low since 1 − ε_low < 1 < c
        bound = torch.where(dual, float(dual_clip), bound)
        fixed = fixed | dual
    neg_adv = -adv
    coef = torch.where(fixed, 0.0, neg_adv)  # (N, T)
    const = torch.where(fixed, neg_adv * bound, 0.0)  # (N, T)
    return SurrogateParts(coef, const, clipped_high, clipped_low)


def clipped_surrogate(ratio: torch.Tensor, advantages: torch.Tensor, clip_low: float,
                      clip_high: float, dual_clip: Optional[float] = None) -> Surrogate:
    """s (N, T), differentiable in `ratio`, and κ_high, κ_low — inputs finite (mask first)."""
    p = surrogate_parts(ratio.detach(), advantages, clip_low, clip_high, dual_clip)
    return Surrogate(p.coef * ratio + p.const, p.clipped_high, p.clipped_low)
