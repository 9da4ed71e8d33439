"""The clip path of `policy_loss`: ratio → clipped surrogate → correction → aggregation
(docs/design.md §2).

    L = λ · agg(s)        (batch granularity)      L = agg(λ_i s_{i,t})   (sequence granularity)

with s the clipped surrogate of `stppo.algos.surrogate` at the ratio level of `stppo.algos.ratios`
(token / turn / sequence) and λ the detached scale of `stppo.algos.clip_bias`. Every aggregation
weight is w = m c_i (`stppo.algos.aggregation`), so with s = a ρ + b the loss is one dot product
in ρ: Σ (λ w a) ρ + Σ λ w b.

This module computes it token by token (token and sequence ratios). At the turn level ρ is
constant on a turn and `stppo.algos.turn_clip` computes the same loss, gradient (the closed form
of ST-PPO, arXiv 2511.20718 v1, Lemma 4.1) and metrics from per-turn statistics instead.
"""

from __future__ import annotations

from typing import Any, Iterable, NamedTuple, Optional

import torch

from stppo.algos.aggregation import LOSS_AGGS, GlobalDenoms, agg_row_weights, mask_float, weighted_sum
from stppo.algos.clip_bias import (CORRECTIONS, ClipContext, Reduce, clip_bias_sq, clip_bias_term,
                                   clip_rms_sums, resolve_correction)
from stppo.algos.clip_metrics import clip_metrics
from stppo.algos.ratios import RATIO_LEVELS, log_ratio
from stppo.algos.surrogate import surrogate_parts
from stppo.algos.turn_clip import turn_clip_policy_loss

TOKEN_TENSORS = ("log_probs", "old_log_probs", "advantages", "loss_mask", "turn_ids")


def check_token_tensors(**tensors: torch.Tensor) -> None:
    """Every argument is a (N, T) tensor of the first one's shape; else one-line ValueError."""
    shape = None
    for name, x in tensors.items():
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor of shape (N, T), "
                             f"got {type(x).__name__}")
        if x.dim() != 2:
            raise ValueError(f"{name} must have shape (N, T), got {tuple(x.shape)}")
        if shape is None:
            shape, first = x.shape, name
        elif x.shape != shape:
            raise ValueError(f"{name} has shape {tuple(x.shape)}, expected {tuple(shape)} "
                             f"(the shape of {first})")


def _check_args(log_probs, loss_mask, turn_ids, ratio_level, clip_low, clip_high, loss_agg,
                dual_clip) -> None:
    if not log_probs.is_floating_point():
        raise ValueError(f"log_probs must be a floating tensor, got {log_probs.dtype}")
    if loss_mask.dtype != torch.bool:
        raise ValueError(f"loss_mask must be a bool tensor, got {loss_mask.dtype}")
    if turn_ids.is_floating_point() or turn_ids.dtype == torch.bool:
        raise ValueError(f"turn_ids must be an integer tensor, got {turn_ids.dtype}")
    if ratio_level not in RATIO_LEVELS:
        raise ValueError(f"ratio_level={ratio_level!r} is not valid; allowed: "
                         f"{', '.join(RATIO_LEVELS)}")
    if loss_agg not in LOSS_AGGS:
        raise ValueError(f"loss_agg={loss_agg!r} is not valid; allowed: {', '.join(LOSS_AGGS)}")
    if not 0.0 <= clip_low < 1.0:
        raise ValueError(f"clip_low must be in [0, 1), got {clip_low}")
    if not clip_high > 0.0:
        raise ValueError(f"clip_high must be > 0, got {clip_high}")
    if dual_clip is not None and not dual_clip > 1.0:
        raise ValueError(f"dual_clip must be None or > 1, got {dual_clip}")


def clip_policy_loss(log_probs: torch.Tensor, old_log_probs: torch.Tensor,
                     advantages: torch.Tensor, loss_mask: torch.Tensor, turn_ids: torch.Tensor, *,
                     ratio_level: str, clip_low: float, clip_high: float, loss_agg: str,
                     correction: Any = None, dual_clip: Optional[float] = None,
                     global_denoms: GlobalDenoms = None,
                     params: Optional[Iterable[torch.Tensor]] = None, reduce: Reduce = None,
                     correction_grad_norm: Optional[torch.Tensor] = None,
                     ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The clipped policy loss of every clip-path preset and its diagnostics (`policy_loss`
    with loss_mode='clip', no options, no rollout IS weights comes here).

    Args:
      log_probs (N, T): log π_θ of each token (with graph). old_log_probs (N, T): log π_old.
      advantages (N, T). loss_mask (N, T) bool: agent tokens. turn_ids (N, T) long: turn of each
        agent token (used by ratio_level='turn'). Non-agent positions may hold anything (nan/inf).
      ratio_level: 'token' | 'turn' | 'sequence'. clip_low, clip_high: ε_low ∈ [0, 1), ε_high > 0.
      loss_agg: see `agg_loss`. correction: None or a mapping/dataclass with kind, tau,
        estimator, granularity (see `stppo.algos.clip_bias`). dual_clip: None or c > 1.
      global_denoms: (D_tok, D_seq) summed over shards, or None. params: the policy parameters,
        needed by correction estimator 'grad' only. reduce: data parallelism — an all-reduce
        sum over the shards (needs global_denoms); clip_bias/norm and the correction's λ are then
        those of the whole batch, identical on every shard. The other metrics stay per shard.
      correction_grad_norm: 0-d ‖C‖ of estimator 'grad' computed by the caller, in place of
        `params` (the trainer's micro-batches sum C over several backward passes).
    Returns:
      loss (0-d, with graph) and metrics: detached 0-d tensors keyed by `stppo.metric_names`
      constants. Fractions, ratio statistics and PPO_KL (mean −δ) are token-weighted over agent
      tokens; CLIP_BIAS_SCALE is the mean λ (over trajectories with agent tokens when per
      sequence); CLIP_BIAS_TRIGGERED is 1.0 if any λ < 1. PG_LOSS is the returned loss.
    """
    check_token_tensors(log_probs=log_probs, old_log_probs=old_log_probs, advantages=advantages,
                        loss_mask=loss_mask, turn_ids=turn_ids)
    _check_args(log_probs, loss_mask, turn_ids, ratio_level, clip_low, clip_high, loss_agg,
                dual_clip)
    spec = resolve_correction(correction)
    params = list(params) if params is not None else None
    if reduce is not None and global_denoms is None:
        raise ValueError("policy_loss: reduce (data parallelism) needs global_denoms")

    if ratio_level == "turn":
        return turn_clip_policy_loss(log_probs, old_log_probs, advantages, loss_mask, turn_ids,
                                     clip_low=clip_low, clip_high=clip_high, loss_agg=loss_agg,
                                     spec=spec, dual_clip=dual_clip, global_denoms=global_denoms,
                                     params=params, reduce=reduce,
                                     correction_grad_norm=correction_grad_norm)
    delta = log_ratio(log_probs, old_log_probs, loss_mask)  # (N, T) with graph
    rho = RATIO_LEVELS[ratio_level](delta, loss_mask, turn_ids)  # (N, T) with graph
    t = _token_terms(rho, advantages, loss_mask, clip_low=clip_low, clip_high=clip_high,
                     loss_agg=loss_agg, dual_clip=dual_clip, global_denoms=global_denoms,
                     reduce=reduce)
    scale, extra = None, {}
    if spec is not None:
        ctx = ClipContext(
            t.bias_norm, t.bias_sq.sum(dim=1), t.lengths,
            rms_sums=lambda: clip_rms_sums(t.ratio, t.adv, t.parts.clipped, loss_mask),
            bias_term=lambda: clip_bias_term(rho, t.adv, t.parts.clipped, loss_mask, loss_agg,
                                             weights=t.w_corr),
            params=params, reduce=reduce, grad_norm=correction_grad_norm)
        scale, extra = CORRECTIONS[spec.kind].apply(ctx, spec)
    loss = _assemble(rho, t.parts, t.w_loss, scale)
    metrics = _token_metrics(loss, t, delta, scale)
    metrics.update(extra)
    return loss, metrics


class _TokenTerms(NamedTuple):
    """The detached per-token quantities of the token and sequence paths, all (N, T) but
    `lengths` (N,) and `bias_norm` (0-d)."""
    ratio: torch.Tensor  # ρ
    mf: torch.Tensor  # agent-token mask as floats
    lengths: torch.Tensor  # |y_i|
    w: torch.Tensor  # this shard's aggregation weights w = m c_i (diagnostics, corrections)
    w_loss: torch.Tensor  # the loss's weights (over the whole batch under global_denoms)
    w_corr: torch.Tensor  # the corrections' weights: shares of the whole batch under `reduce`
    adv: torch.Tensor  # A on agent tokens, 0 elsewhere
    parts: Any  # `surrogate_parts`: s = coef ρ + const, and which tokens are clipped
    bias_sq: torch.Tensor  # κ (ρA)²
    bias_norm: torch.Tensor  # ‖clip bias‖ = sqrt(Σ w κ (ρA)²), over every shard under `reduce`


@torch.no_grad()
def _token_terms(rho: torch.Tensor, advantages: torch.Tensor, loss_mask: torch.Tensor, *,
                 clip_low: float, clip_high: float, loss_agg: str, dual_clip: Optional[float],
                 global_denoms: GlobalDenoms, reduce: Reduce) -> _TokenTerms:
    ratio = rho.detach()
    mf = mask_float(loss_mask, ratio.dtype)  # (N, T)
    lengths = mf.sum(dim=1)  # (N,) |y_i|
    w = mf * agg_row_weights(mf, loss_agg, lengths=lengths).unsqueeze(1)  # (N, T) local: w = m c
    w_loss = w if global_denoms is None else mf * agg_row_weights(
        mf, loss_agg, global_denoms, lengths=lengths).unsqueeze(1)  # (N, T)
    adv = torch.where(loss_mask, advantages, 0.0).to(ratio.dtype)  # (N, T)
    parts = surrogate_parts(ratio, adv, clip_low, clip_high, dual_clip)
    bias_sq = clip_bias_sq(ratio, adv, parts.clipped)  # (N, T); clipped is False where A = 0
    w_corr = w if reduce is None else w_loss
    bias_sq_sum = weighted_sum(bias_sq, w_corr)
    bias_norm = (bias_sq_sum if reduce is None else reduce(bias_sq_sum)).sqrt()
    return _TokenTerms(ratio, mf, lengths, w, w_loss, w_corr, adv, parts, bias_sq, bias_norm)


@torch.no_grad()
def _token_metrics(loss: torch.Tensor, t: _TokenTerms, delta: torch.Tensor,
                   scale) -> dict[str, torch.Tensor]:
    """`clip_metrics` of the token and sequence paths (token-weighted over agent tokens)."""
    n_tok = t.lengths.sum().clamp(min=1)
    s = t.parts.coef * t.ratio + t.parts.const  # (N, T) surrogate, 0 off agent tokens
    ratio_m = t.ratio * t.mf  # (N, T) ρ > 0 and finite: its max is the max over agent tokens
    return clip_metrics(
        loss, loss_norm=weighted_sum(s * s, t.w).sqrt(),
        clipfrac_high=torch.count_nonzero(t.parts.clipped_high) / n_tok,
        clipfrac_low=torch.count_nonzero(t.parts.clipped_low) / n_tok,
        ppo_kl=-delta.detach().sum() / n_tok, ratio_mean=ratio_m.sum() / n_tok,
        ratio_max=ratio_m.max() if ratio_m.numel() else torch.zeros_like(n_tok),
        bias_norm=t.bias_norm, scale=scale, lengths=t.lengths)


def _assemble(rho: torch.Tensor, parts, w_loss: torch.Tensor, scale) -> torch.Tensor:
    """loss = agg(λ s) with s = a ρ + b: Σ (λ w a) ρ + Σ λ w b — one dot product in ρ."""
    seq_scale = scale is not None and scale.dim() > 0  # λ_i per trajectory, else a scalar or None
    with torch.no_grad():
        w_l = w_loss * scale.unsqueeze(1) if seq_scale else w_loss  # (N, T)
        const = weighted_sum(parts.const, w_l)
        grad_coef = parts.coef * w_l  # (N, T)
    loss = weighted_sum(rho, grad_coef)
    if scale is not None and not seq_scale:
        return (loss + const) * scale
    return loss + const
