"""The clip path of `policy_loss`, the loss mode `clip`: ratio → clipped surrogate → clip-bias
scale → aggregation (docs/design.md §2).

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

from typing import Any, NamedTuple, Optional

import torch

from stppo.algos.aggregation import GlobalDenoms, agg_row_weights, mask_float, weighted_sum
from stppo.algos.clip_bias import (CLIP_BIAS_KINDS, ClipContext, Reduce, clip_bias_sq, clip_bias_term,
                                   clip_rms_sums)
from stppo.algos.clip_metrics import clip_fractions, clip_metrics
from stppo.algos.contract import LossInputs, loss_mode
from stppo.algos.ratios import RATIO_LEVELS, importance_ratio, log_ratio
from stppo.algos.surrogate import clipped_surrogate, surrogate_parts
from stppo.algos.turn_clip import turn_clip_policy_loss

@loss_mode("clip", ratio_levels=RATIO_LEVELS, dual_clip=True, separable=True, clip_bias=True,
           source="PPO clipped surrogate (arXiv 1707.06347); ST-PPO's turn ratios and clip-bias scales "
                  "(arXiv 2511.20718)")
def clip(x: LossInputs, spec) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
    """The clipped policy loss of every clip-path preset, its metrics and κ (module docstring).

    At the spec's ratio level (token / turn / sequence) and clip range (with its dual clip), the
    clip-bias scale λ of `spec.clip_bias` (`stppo.algos.clip_bias`; its `grad` estimator reads
    `x.params` or `x.clip_bias_grad_norm`), aggregated by `spec.loss_agg` over the agent tokens
    with `x.global_denoms`; under data parallelism (`x.reduce`) clip_bias/norm and λ are those of
    the whole batch, identical on every shard, the other metrics this shard's. Rollout IS weights
    ω (`x.rollout_is_weights`) enter as advantages ωA: the surrogate is positively homogeneous in
    A — clipping reads A's sign only and ω ≥ 0 — so s(ρ, ωA) = ω s(ρ, A) exactly; the clip
    fractions and κ are then counted with the unweighted A, as verl counts them
    (`clip_metrics.clip_fractions`). Metrics: fractions, ratio statistics and PPO_KL (mean −δ)
    token-weighted over agent tokens; CLIP_BIAS_SCALE the mean λ (over trajectories with agent
    tokens when per sequence); CLIP_BIAS_TRIGGERED 1.0 if any λ < 1; PG_LOSS the loss."""
    if x.rollout_is_weights is None:
        return _clip(x, spec, x.advantages)
    weighted = torch.where(x.loss_mask, x.advantages * x.rollout_is_weights, x.advantages)
    loss, metrics, _ = _clip(x, spec, weighted)
    counts, clipped = clip_fractions(x.log_probs, x.old_log_probs, x.advantages, x.loss_mask, x.turn_ids,
                                     ratio_level=spec.ratio_level, clip_low=spec.clip_low,
                                     clip_high=spec.clip_high)
    return loss, {**metrics, **counts}, clipped


def _clip(x: LossInputs, spec, advantages: torch.Tensor):
    params = list(x.params) if x.params is not None else None
    if spec.ratio_level == "turn":
        loss, metrics = turn_clip_policy_loss(
            x.log_probs, x.old_log_probs, advantages, x.loss_mask, x.turn_ids, clip_low=spec.clip_low,
            clip_high=spec.clip_high, loss_agg=spec.loss_agg, spec=spec.clip_bias, dual_clip=spec.dual_clip,
            global_denoms=x.global_denoms, params=params, reduce=x.reduce,
            clip_bias_grad_norm=x.clip_bias_grad_norm)
        return loss, metrics, None  # κ on first use (`LossOutput.clipped`): most calls never read it
    loss_mask, turn_ids = x.loss_mask, x.turn_ids
    delta = log_ratio(x.log_probs, x.old_log_probs, loss_mask)  # (N, T) with graph
    rho = RATIO_LEVELS[spec.ratio_level](delta, loss_mask, turn_ids)  # (N, T) with graph
    t = _token_terms(rho, advantages, loss_mask, clip_low=spec.clip_low, clip_high=spec.clip_high,
                     loss_agg=spec.loss_agg, dual_clip=spec.dual_clip, global_denoms=x.global_denoms,
                     reduce=x.reduce)
    scale, extra = None, {}
    if spec.clip_bias is not None:
        ctx = ClipContext(
            t.bias_norm, t.bias_sq.sum(dim=1), t.lengths,
            rms_sums=lambda: clip_rms_sums(t.ratio, t.adv, t.parts.clipped, loss_mask),
            bias_term=lambda: clip_bias_term(rho, t.adv, t.parts.clipped, loss_mask, spec.loss_agg,
                                             weights=t.w_corr),
            params=params, reduce=x.reduce, grad_norm=x.clip_bias_grad_norm)
        scale, extra = CLIP_BIAS_KINDS[spec.clip_bias.kind].apply(ctx, spec.clip_bias)
    loss = _assemble(rho, t.parts, t.w_loss, scale)
    metrics = _token_metrics(loss, t, delta, scale)
    metrics.update(extra)
    return loss, metrics, t.parts.clipped


def ratio_and_clip(log_probs: torch.Tensor, old_log_probs: torch.Tensor, advantages: torch.Tensor,
                   loss_mask: torch.Tensor, turn_ids: torch.Tensor,
                   spec) -> tuple[torch.Tensor, torch.Tensor]:
    """(ρ at the spec's ratio level, κ the clip path's clip indicator) (N, T), detached: what
    callers read per token (`policy.LossOutput`) when the loss mode does not give κ itself."""
    ratio, _ = importance_ratio(log_probs.detach(), old_log_probs, loss_mask, turn_ids,
                                spec.ratio_level)
    adv = torch.where(loss_mask, advantages, 0.0)
    clipped = clipped_surrogate(ratio, adv, spec.clip_low, spec.clip_high, spec.dual_clip).clipped
    return ratio, clipped


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
