"""Importance ratios at token, turn and sequence level (docs/design.md §2).

With m the loss mask (agent tokens) and δ_t = clamp(log π_θ(y_t) − log π_old(y_t), −20, 20):

    token:    ρ_t = exp(δ_t)
    turn:     ρ_t = exp( (1/|y^k|) Σ_{t'∈k} δ_t' )      for t in turn k   (Turn-PPO / ST-PPO)
    sequence: ρ_t = exp( (1/|y_i|) Σ_{t'∈i} δ_t' )      for t in trajectory i   (GSPO)

The turn ratio is the geometric mean of the turn's token ratios, shared by its tokens, with *no*
stop-gradient: by Lemma 4.1 of ST-PPO (arXiv 2511.20718 v1) its policy gradient is
w^k Â^k / |y^k| ∇ log π(y^k), with w^k the turn ratio and Â^k = Σ_{t∈k} 1[(k,t) unclipped] A_t.

Masking is done with `torch.where` *before* any nonlinearity, so garbage (nan/inf) on prompt,
observation and padding positions never reaches a result or a gradient. Every ratio function
returns ρ = 1 on non-agent positions. Turns are (row, turn id) segments (`stppo.algos.segments`):
a segment mean is one `scatter_add_` and its broadcast one `gather` (no loop over samples, turns
or time).
"""

from __future__ import annotations

import torch

from stppo.algos.aggregation import mask_float
from stppo.registry import Registry
from stppo.algos.segments import TurnRatio, TurnSegments

LOG_RATIO_CLAMP = 20.0


def log_ratio(log_probs: torch.Tensor, old_log_probs: torch.Tensor,
              loss_mask: torch.Tensor) -> torch.Tensor:
    """δ = clamp(log_probs − old_log_probs, −20, 20) on agent tokens, exactly 0 elsewhere. (N, T)

    Half-precision inputs are computed in float32 (ratios and segment sums need the range)."""
    if log_probs.dtype in (torch.float16, torch.bfloat16):
        log_probs = log_probs.float()
    diff = torch.where(loss_mask, log_probs - old_log_probs, 0.0)  # (N, T) garbage → 0 first
    return diff.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def clamped_log_ratio(log_probs: torch.Tensor, old_log_probs: torch.Tensor) -> torch.Tensor:
    """clamp(log_probs − old_log_probs, −20, 20) everywhere, garbage included (N, T): for
    callers that mask it themselves; `torch.where(loss_mask, ·, 0)` of it equals `log_ratio`."""
    if log_probs.dtype in (torch.float16, torch.bfloat16):
        log_probs = log_probs.float()
    return (log_probs - old_log_probs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


RATIO_LEVELS: Registry = Registry("ratio_level")


@RATIO_LEVELS.register("token")
def token_ratio(delta: torch.Tensor, loss_mask: torch.Tensor,
                turn_ids: torch.Tensor | None = None) -> torch.Tensor:
    """ρ_t = exp(δ_t). (N, T); 1 where δ = 0, i.e. on non-agent positions."""
    return delta.exp()


@RATIO_LEVELS.register("turn")
def turn_ratio(delta: torch.Tensor, loss_mask: torch.Tensor,
               turn_ids: torch.Tensor) -> torch.Tensor:
    """ρ_t = exp(mean of δ over the (row, turn) segment of t); no stop-gradient. (N, T)

    exp is taken per turn (S values), then broadcast; non-agent segments have mean 0 → ρ = 1.
    """
    segs = TurnSegments.build(loss_mask, turn_ids, mask_float(loss_mask, delta.dtype))
    return TurnRatio.apply(delta, segs)


@RATIO_LEVELS.register("sequence")
def sequence_ratio(delta: torch.Tensor, loss_mask: torch.Tensor,
                   turn_ids: torch.Tensor | None = None) -> torch.Tensor:
    """ρ_t = exp(mean of δ over the agent tokens of t's trajectory) — GSPO. (N, T)"""
    count = loss_mask.sum(dim=1, keepdim=True).clamp(min=1).to(delta.dtype)  # (N, 1)
    rho_seq = (delta.sum(dim=1, keepdim=True) / count).exp()  # (N, 1)
    return torch.where(loss_mask, rho_seq, 1.0)  # (N, T)


def importance_ratio(log_probs: torch.Tensor, old_log_probs: torch.Tensor,
                     loss_mask: torch.Tensor, turn_ids: torch.Tensor,
                     ratio_level: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(ρ, δ) at `ratio_level` ∈ RATIO_LEVELS; both (N, T), ρ = 1 and δ = 0 off agent tokens."""
    fn = RATIO_LEVELS[ratio_level]
    delta = log_ratio(log_probs, old_log_probs, loss_mask)  # (N, T)
    return fn(delta, loss_mask, turn_ids), delta
