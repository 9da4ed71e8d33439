"""Rejection sampling between the trainer and the sampler: verl 0.9.1's
`compute_rollout_rejection_mask` and `compute_rs_metrics` (rollout_corr_helper), on the same
tensors to float64 rounding. docs/design.md §2, "Rollout correction".

With r_t = clamp(log π_train(y_t) − log π_rollout(y_t), −20, 20) on agent tokens, three
per-token divergence estimates (KL(π_rollout ‖ π_train) when r is small):

    k1_t = −r_t          k2_t = r_t² / 2          k3_t = e^{r_t} − 1 − r_t

and an option per level and aggregation (REJECTION_OPTIONS):

    token_k{1,2,3}     the token's k
    seq_sum_k{1,2,3}   Σ_{t∈i} k_t             seq_mean_k{1,2,3}   mean_{t∈i} k_t
    seq_max_k{2,3}     max_{t∈i} k_t

A k1 option keeps a token (a trajectory) when log l ≤ stat ≤ log u (threshold 'l_u'; a number u
means [1/u, u]): its statistic is a log ratio, 0 ideally — seq_mean_k1 is the log of the
geometric-mean ratio (Geo-RS), seq_sum_k1 of the sequence ratio. A k2/k3 option keeps stat ≤ u.
Sequence options reject whole trajectories. Several options (comma-separated) must all pass.
The mask only shrinks: rejected agent tokens leave the loss (and, in decoupled mode, the
advantages and the critic's loss, as in verl). Metrics: verl's `rollout_corr/rollout_rs_*`
(`stppo.metric_names.rollout_rs_key`), per option and for the combined mask.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch

from stppo import metric_names as K
from stppo.algos.rollout_corr.presets import (SAFETY_BOUND, TOKEN_REJECTION, parse_rs_thresholds,
                                              rejection_options)
from stppo.algos.rollout_corr.weights import _check, masked_mean, masked_sum


def _sequence_stat(x: torch.Tensor, mask: torch.Tensor, how: str) -> torch.Tensor:
    """(N,) per-trajectory sum / mean / max of x over its agent tokens (max: 0 without one)."""
    if how == "sum":
        return masked_sum(x, mask, dim=-1)
    if how == "mean":
        return masked_mean(x, mask, dim=-1)
    top = x.masked_fill(~mask, float("-inf")).max(dim=-1).values
    return torch.where(top == float("-inf"), torch.zeros_like(top), top)


@torch.no_grad()
def rejection_mask(log_ratio: torch.Tensor, loss_mask: torch.Tensor, rs: str, rs_threshold: Any,
                   ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(the kept agent tokens (N, T) bool ⊆ loss_mask; metrics: detached 0-d tensors) of the
    rejection options `rs` (comma-separated) with `rs_threshold` — see the module docstring.
    log_ratio (N, T) float: log π_train − log π_rollout; loss_mask (N, T) bool."""
    _check(log_ratio, loss_mask)
    options = rejection_options(rs)
    bounds = parse_rs_thresholds(options, rs_threshold)
    m = loss_mask
    r = log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)  # (N, T)
    per_token = {"k1": -r, "k2": 0.5 * r.square(), "k3": r.exp() - 1.0 - r}  # (N, T) each
    seq_valid = m.any(dim=-1)  # (N,)
    combined = torch.ones_like(log_ratio)  # (N, T) 1 kept, 0 rejected
    metrics: dict[str, torch.Tensor] = {}
    for opt in options:
        lower, upper = bounds[opt]
        k1 = opt.endswith("k1")
        lo, hi = (math.log(lower), math.log(upper)) if k1 else (None, upper)
        x = per_token[opt[-2:]]
        if opt in TOKEN_REJECTION:
            stat, seq_stat = x, None
            keep = x <= hi if lo is None else (x >= lo) & (x <= hi)  # (N, T)
        else:
            seq_stat = _sequence_stat(x, m, opt.split("_")[1])  # (N,)
            keep_seq = seq_stat <= hi if lo is None else (seq_stat >= lo) & (seq_stat <= hi)
            keep = keep_seq.unsqueeze(-1).expand_as(m)
            stat = seq_stat.unsqueeze(-1).expand_as(log_ratio)
        keep_f = keep.to(log_ratio.dtype)
        combined = combined * keep_f
        metrics.update(rs_metrics(opt, stat, m, seq_valid, seq_stat, hi, 0.0 if lo is None else lo, k1))
        seq_keep = (~((~keep) & m)).all(dim=-1)  # (N,)
        valid = seq_valid.to(log_ratio.dtype)
        metrics[K.rollout_rs_key(opt, "masked_fraction")] = masked_mean(1.0 - keep_f, m)
        metrics[K.rollout_rs_key(opt, "seq_masked_fraction")] = torch.where(
            valid.sum() > 0, ((1.0 - seq_keep.to(valid.dtype)) * valid).sum() / valid.sum().clamp(min=1.0),
            torch.zeros_like(valid.sum()))
    metrics[K.ROLLOUT_RS_MASKED_FRACTION] = masked_mean(1.0 - combined, m)
    kept = (combined > 0.5) & m  # (N, T)
    metrics[K.ROLLOUT_RS_SEQ_MASKED_FRACTION] = (~kept & m).any(dim=-1).float().mean()
    return kept, {k: v.detach().to(torch.float64) for k, v in metrics.items()}


def rs_metrics(option: str, stat: torch.Tensor, loss_mask: torch.Tensor, seq_valid: torch.Tensor,
               seq_stat: Optional[torch.Tensor], upper: float, lower: float,
               with_lower: bool) -> dict[str, torch.Tensor]:
    """verl's `compute_rs_metrics` of one option: stat (N, T) the per-token statistic (a sequence
    option's broadcast), seq_stat (N,) a sequence option's statistic (None: token level, the
    trajectories' means), upper / lower the bounds the statistic is compared with (log bounds
    for k1; lower used only `with_lower`)."""
    key = lambda s: K.rollout_rs_key(option, s)  # noqa: E731
    m = loss_mask
    seq = (masked_mean(stat, m, dim=-1) if seq_stat is None else seq_stat)[seq_valid]  # (V,)
    sequence = seq_stat is not None and seq.numel() > 0
    out = {key("mean"): masked_mean(stat, m)}
    if sequence:
        out.update({key("max"): seq.max(), key("min"): seq.min(),
                    key("fraction_high"): (seq > upper).float().mean(),
                    key("fraction_low"): (seq < lower).float().mean() if with_lower else stat.new_zeros(())})
    else:
        out.update({key("max"): stat.masked_fill(~m, float("-inf")).max(),
                    key("min"): stat.masked_fill(~m, float("inf")).min(),
                    key("fraction_high"): masked_mean((stat > upper).float(), m),  # float32: verl's
                    key("fraction_low"): masked_mean((stat < lower).float(), m) if with_lower
                    else stat.new_zeros(())})
    clamped = stat.clamp(min=lower if with_lower else 0.0, max=upper)
    mean_c = masked_mean(clamped, m)
    var = masked_mean(clamped.square(), m) - mean_c.square()
    out[key("std")] = torch.where(m.sum() > 1, var.clamp(min=0.0).sqrt(), torch.zeros_like(var))
    if seq.numel() > 0:
        out.update({key("seq_mean"): seq.mean(),
                    key("seq_std"): seq.std() if seq.numel() > 1 else seq.new_zeros(()),
                    key("seq_max"): seq.max(), key("seq_min"): seq.min(),
                    key("seq_max_deviation"): seq.abs().max(),
                    key("seq_fraction_high"): (seq > upper).float().mean()})
        if with_lower:
            out[key("seq_fraction_low")] = (seq < lower).float().mean()
    else:
        zero = stat.new_zeros(())
        out.update({key(s): zero for s in ("seq_mean", "seq_std", "seq_max", "seq_min",
                                           "seq_max_deviation", "seq_fraction_high", "seq_fraction_low")})
    return out
