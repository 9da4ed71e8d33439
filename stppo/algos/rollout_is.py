"""Truncated importance sampling between the sampler and the trainer (TIS; verl 0.9.1
`rollout_corr_helper.compute_rollout_correction_weights` with rollout_is='token', a single
threshold; verl PR #2953). docs/design.md §2, "Rollout correction".

The rollout's sampling log-probs (the sampler: vLLM, or stppo's KV-cached generation) and the
trainer's recomputed π_old differ (kernels, precision, batching). Per agent token

    ω_t = min( exp(clamp(log π_old(y_t) − log π_rollout(y_t), −20, 20)), C )

(C = `threshold`, verl's rollout_is_threshold, default 2), detached; the policy loss of every
mode multiplies its per-token term by ω (`policy_loss(..., rollout_is_weights=ω)`).
Metrics (verl's names and definitions, token level): rollout_is_mean = mean ω, rollout_is_max,
the fractions of raw weights above C and below 1/C, and the effective sample size
ESS = 1 / mean((ω / (mean ω + 1e-8))²), all over agent tokens.
"""

from __future__ import annotations

import torch

from stppo.metric_names import (ROLLOUT_IS_ESS, ROLLOUT_IS_FRACTION_HIGH, ROLLOUT_IS_FRACTION_LOW,
                            ROLLOUT_IS_MAX, ROLLOUT_IS_MEAN)

SAFETY_BOUND = 20.0
ROLLOUT_IS_KINDS = ("none", "token")


@torch.no_grad()
def truncated_is_weights(old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor,
                         loss_mask: torch.Tensor, threshold: float = 2.0,
                         ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(ω (N, T): the TIS weights on agent tokens, 0 elsewhere; metrics: detached 0-d tensors).

    old_log_probs, rollout_log_probs (N, T) floats (anything off agent tokens), loss_mask (N, T)
    bool; threshold C > 0."""
    if old_log_probs.shape != rollout_log_probs.shape or old_log_probs.shape != loss_mask.shape:
        raise ValueError(f"old_log_probs, rollout_log_probs and loss_mask must have one shape "
                         f"(N, T); got {tuple(old_log_probs.shape)}, "
                         f"{tuple(rollout_log_probs.shape)}, {tuple(loss_mask.shape)}")
    if not threshold > 0:
        raise ValueError(f"rollout IS threshold must be > 0, got {threshold}")
    diff = torch.where(loss_mask, old_log_probs - rollout_log_probs.to(old_log_probs.dtype), 0.0)
    raw = torch.where(loss_mask, diff.clamp(-SAFETY_BOUND, SAFETY_BOUND).exp(), 0.0)  # (N, T)
    w = raw.clamp(max=threshold)  # (N, T)
    mf = loss_mask.to(w.dtype)
    n = mf.sum().clamp(min=1)
    mean = w.sum() / n
    norm = w / (mean + 1e-8)
    return w, {
        ROLLOUT_IS_MEAN: mean,
        ROLLOUT_IS_MAX: torch.where(loss_mask, w, 0.0).max() if w.numel() else mean,
        ROLLOUT_IS_FRACTION_HIGH: ((raw > threshold) & loss_mask).sum() / n,
        ROLLOUT_IS_FRACTION_LOW: ((raw < 1.0 / threshold) & loss_mask).sum() / n,
        ROLLOUT_IS_ESS: 1.0 / ((norm.square() * mf).sum() / n).clamp(min=1e-30),
    }
