"""Importance-sampling weights between the trainer and the sampler, and their statistics: verl
0.9.1's `compute_rollout_correction_weights` and `compute_is_metrics` (rollout_corr_helper), on
the same tensors to float64 rounding (tests/verl/test_rollout_correction_vs_verl.py).
docs/design.md §2, "Rollout correction".

With r_t = log π_train(y_t) − log π_rollout(y_t) on agent tokens (π_train: the recomputed π_old
in decoupled mode, the current π_θ in bypass mode), m the agent-token mask, S = 20:

    token     w_t = exp(clamp(r_t, −S, S))
    sequence  w_t = exp(clamp(Σ_{t'∈i} r_t', −S, S))          for every token t of trajectory i

then, with the threshold C (a number) or [l, u] ('l_u'):

    truncation (TIS)  ω_t = min(w_t, C)
    IcePop            ω_t = w_t · 1[l ≤ w_t ≤ u]                (the mask stays; ω = 0 outside)
    batch normalise   ω_t ← ω_t / ω̄,  ω̄ = Σ m ω / Σ m (token) or the mean over trajectories of
                      their mean ω (sequence); unchanged when ω̄ ≤ 1e-8

ω is detached: it re-weights the measure, not the objective. Means are verl's masked means
(`masked_mean`: Σ m x / Σ m on agent tokens). Metrics (verl's names, `rollout_corr/rollout_is_*`): mean ω, max, min,
std of min(ω, C) over agent tokens, ESS = 1 / mean((ω̃ / (mean ω̃ + 1e-8))²) with ω̃ = min(ω, C),
the shares of raw weights above C and below its lower bound (1/C without IcePop), and the
statistics of the per-trajectory mean weights. Tensors (N, T); anything off agent tokens
(nan/inf included) reaches no result.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from stppo import metric_names as K
from stppo.algos.rollout_corr.presets import IS_LEVELS, SAFETY_BOUND, parse_is_threshold

Reduce = Optional[Callable[[torch.Tensor], torch.Tensor]]
EPS = 1e-8  # verl's guards (masked means, the ESS, the batch normaliser)


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: Optional[int] = None) -> torch.Tensor:
    """Σ of x over mask (bool, x's shape); garbage off the mask never enters."""
    s = torch.where(mask, x, torch.zeros((), dtype=x.dtype, device=x.device))
    return s.sum() if dim is None else s.sum(dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: Optional[int] = None) -> torch.Tensor:
    """verl's `masked_mean` on a bool mask (verl's masks are integer or bool): Σ m x / (Σ m + 1e-8)
    with the count in float32, as torch forms it from an integer count — so Σ m x / Σ m for a
    non-empty mask, 0 for an empty one."""
    count = mask.sum() if dim is None else mask.sum(dim)
    return masked_sum(x, mask, dim) / (count + EPS)


def _float32_log(x: float) -> torch.Tensor:
    # verl compares log-ratios with torch.log(torch.tensor(threshold)): a float32 constant
    return torch.log(torch.tensor(x, dtype=torch.float32))


@torch.no_grad()
def is_weights(log_ratio: torch.Tensor, loss_mask: torch.Tensor, level: str, threshold: Any = 2.0,
               batch_normalize: bool = False, reduce: Reduce = None,
               ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(ω (N, T) detached, 0 off agent tokens; metrics: detached 0-d tensors) — see the module
    docstring. log_ratio (N, T) float: log π_train − log π_rollout; loss_mask (N, T) bool;
    level 'token' | 'sequence'; threshold a number C or 'lower_upper'. `reduce` (a sum over
    data-parallel ranks) makes the batch normaliser global, as verl's `distributed_masked_mean`
    (Σ m ω / Σ m over ranks, no 1e-8)."""
    _check(log_ratio, loss_mask)
    if level not in IS_LEVELS:
        raise ValueError(f"IS level {level!r} is not valid; allowed: {', '.join(IS_LEVELS)}")
    upper, lower = parse_is_threshold(threshold)
    zero = torch.zeros((), dtype=log_ratio.dtype, device=log_ratio.device)
    if level == "token":
        for_metrics = log_ratio
        raw = log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND).exp()  # (N, T)
    else:
        for_metrics = masked_sum(log_ratio, loss_mask, dim=-1).unsqueeze(-1)  # (N, 1) Σ_t r_t
        raw = for_metrics.clamp(-SAFETY_BOUND, SAFETY_BOUND).exp().expand_as(log_ratio)  # (N, T)
    raw = torch.where(loss_mask, raw, zero)  # (N, T)
    if lower is None:  # TIS
        w = raw.clamp(max=upper)
    else:  # IcePop: zero outside [lower, upper]
        w = torch.where((raw >= lower) & (raw <= upper), raw, zero)
    metrics = is_metrics(w, raw, for_metrics, loss_mask, level, upper, lower)
    if lower is not None:
        oob = (raw < lower) | (raw > upper)
        metrics[K.ROLLOUT_IS_OOB_RATIO] = masked_mean(oob.float(), loss_mask)
    if batch_normalize:
        mean = _weights_mean(w, loss_mask, level, reduce)
        ok = mean > 1e-8
        w = torch.where(ok, w / torch.where(ok, mean, 1.0), w)
        metrics[K.ROLLOUT_IS_BATCH_NORM_FACTOR] = torch.where(ok, mean, torch.ones_like(mean))
    return w, metrics


def _weights_mean(w: torch.Tensor, loss_mask: torch.Tensor, level: str, reduce: Reduce) -> torch.Tensor:
    """ω̄ of the module docstring: the token mean, or the mean over trajectories of their mean."""
    if level == "token":
        if reduce is None:
            return masked_mean(w, loss_mask)
        num, den = masked_sum(w, loss_mask), loss_mask.to(w.dtype).sum()
    else:
        seq_w = masked_mean(w, loss_mask, dim=-1)  # (N,)
        seq_mask = loss_mask.any(dim=-1).to(w.dtype)  # (N,)
        num, den = (seq_w * seq_mask).sum(), seq_mask.sum()
        if reduce is None:
            return num / den.clamp_min(1e-8)
    return reduce(num) / reduce(den)


@torch.no_grad()
def is_metrics(w: torch.Tensor, raw: torch.Tensor, log_ratio_for_metrics: torch.Tensor,
               loss_mask: torch.Tensor, level: str, upper: float,
               lower: Optional[float] = None) -> dict[str, torch.Tensor]:
    """verl's `compute_is_metrics`: w the applied weights, raw the weights before truncation /
    IcePop (N, T; 0 off agent tokens), log_ratio_for_metrics (N, T) token or (N, 1) sequence log
    ratios; upper C, lower l (None: 1/C)."""
    m = loss_mask
    low = 1.0 / upper if lower is None else lower
    if level == "sequence":  # over every row (verl's): a row without agent tokens has Σ r = 0
        lr = log_ratio_for_metrics
        out = {K.ROLLOUT_IS_MAX: lr.max().clamp(max=SAFETY_BOUND).exp(), K.ROLLOUT_IS_MIN: lr.min().exp(),
               K.ROLLOUT_IS_MEAN: masked_mean(w, m),
               K.ROLLOUT_IS_FRACTION_HIGH: (lr > _float32_log(upper)).float().mean(),
               K.ROLLOUT_IS_FRACTION_LOW: (lr < _float32_log(low)).float().mean()}
    else:
        out = {K.ROLLOUT_IS_MEAN: masked_mean(w, m),
               K.ROLLOUT_IS_FRACTION_HIGH: masked_mean((raw > upper).float(), m),  # float32: verl's
               K.ROLLOUT_IS_FRACTION_LOW: masked_mean((raw < low).float(), m),
               K.ROLLOUT_IS_MAX: w.masked_fill(~m, float("-inf")).max(),
               K.ROLLOUT_IS_MIN: w.masked_fill(~m, float("inf")).min()}
    clamped = w.clamp(min=0.0, max=upper)  # (N, T)
    mean_c = masked_mean(clamped, m)
    var = masked_mean(clamped.square(), m) - mean_c.square()
    out[K.ROLLOUT_IS_STD] = torch.where(m.sum() > 1, var.clamp(min=0.0).sqrt(), torch.zeros_like(var))
    out[K.ROLLOUT_IS_ESS] = 1.0 / masked_mean((clamped / (mean_c + EPS)).square(), m)
    seq = masked_mean(w, m, dim=-1)  # (N,) per-trajectory mean weight (0 for an empty row)
    raw_seq = masked_mean(raw, m, dim=-1)  # (N,)
    out.update({K.ROLLOUT_IS_SEQ_MEAN: seq.mean(),
                K.ROLLOUT_IS_SEQ_STD: seq.std() if seq.numel() > 1 else torch.zeros_like(seq.sum()),
                K.ROLLOUT_IS_SEQ_MAX: seq.max(), K.ROLLOUT_IS_SEQ_MIN: seq.min(),
                K.ROLLOUT_IS_SEQ_MAX_DEVIATION: (seq - 1.0).abs().max(),
                K.ROLLOUT_IS_SEQ_FRACTION_HIGH: (raw_seq > upper).float().mean(),
                K.ROLLOUT_IS_SEQ_FRACTION_LOW: (raw_seq < low).float().mean()})
    return {k: v.detach().to(torch.float64) for k, v in out.items()}


def _check(log_ratio: torch.Tensor, loss_mask: torch.Tensor) -> None:
    if log_ratio.dim() != 2 or loss_mask.shape != log_ratio.shape:
        raise ValueError(f"log_ratio and loss_mask must have one shape (N, T); got "
                         f"{tuple(log_ratio.shape)} and {tuple(loss_mask.shape)}")
    if loss_mask.dtype != torch.bool:
        raise ValueError(f"loss_mask must be a bool tensor, got {loss_mask.dtype}")
    if not log_ratio.is_floating_point():
        raise ValueError(f"log_ratio must be a floating tensor, got {log_ratio.dtype}")
