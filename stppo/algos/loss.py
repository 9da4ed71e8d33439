"""The clip path of `policy_loss`: ratio → clipped surrogate → correction → aggregation
(DESIGN.md §2).

    L = λ · agg(s)        (batch granularity)      L = agg(λ_i s_{i,t})   (sequence granularity)

with s the clipped surrogate of `stppo.algos.surrogate` at the ratio level of `stppo.algos.ratios`
(token / turn / sequence) and λ the detached scale of `stppo.algos.clip_bias`. At the turn level
the gradient of a token t in turn k is the closed form of ST-PPO (arXiv 2511.20718 v1) Lemma 4.1,
w^k Â^k / |y^k| ∇ log π(y_t), times the aggregation weight, with Â^k = Σ_{t∈k} 1[unclipped] A_t.

Turn level, per segment (`stppo.algos.segments`): every aggregation weight is w = m c_i, so with
s = a ρ + b the loss is Σ_{i,k} λ_i c_i ρ^k C^k + Σ λ w b, C^k = Σ_{t∈k} a_t — one node
(`TurnDot`) whose backward is a single gather of that closed form. Ratio statistics and PPO_KL
come from the (N, K) segment sums; token-level work is only what the clipped surrogate and the
diagnostics need (the same as at token level).
"""

from __future__ import annotations

from typing import Any, Iterable, NamedTuple, Optional

import torch

from stppo.algos.aggregation import (LOSS_AGGS, GlobalDenoms, agg_row_weights, mask_float,
                                     weighted_sum)
from stppo.algos.clip_bias import (CORRECTIONS, ClipContext, Reduce, clip_bias_sq,
                                   resolve_correction)
from stppo.algos.ratios import RATIO_LEVELS, clamped_log_ratio, log_ratio
from stppo.algos.segments import TurnDot, TurnRatio, TurnSegments
from stppo.algos.surrogate import surrogate_parts
from stppo.tracking import (CLIP_BIAS_NORM, CLIP_BIAS_NORM_MAX, CLIP_BIAS_SCALE,
                            CLIP_BIAS_TRIGGERED, PG_CLIPFRAC, PG_CLIPFRAC_HIGH, PG_CLIPFRAC_LOW,
                            PG_LOSS, PG_LOSS_NORM, PPO_KL, RATIO_MAX, RATIO_MEAN)

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
    Returns:
      loss (0-d, with graph) and metrics: detached 0-d tensors keyed by `stppo.tracking`
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

    rs = _ratio_stage(log_probs, old_log_probs, loss_mask, turn_ids, ratio_level,
                      live=spec is not None and spec.estimator == "grad")
    ratio, mf = rs.ratio, rs.mask_float
    with torch.no_grad():
        lengths = rs.lengths  # (N,) |y_i|
        rows = agg_row_weights(mf, loss_agg, lengths=lengths)  # (N,) local: w = m c
        w = mf * rows.unsqueeze(1)  # (N, T) local weights (diagnostics, corrections)
        rows_loss = rows if global_denoms is None else agg_row_weights(
            mf, loss_agg, global_denoms, lengths=lengths)
        w_loss = w if global_denoms is None else mf * rows_loss.unsqueeze(1)  # (N, T)
        adv = torch.where(loss_mask, advantages, 0.0).to(ratio.dtype)  # (N, T)
        parts = surrogate_parts(ratio, adv, clip_low, clip_high, dual_clip)
        clipped = parts.clipped  # (N, T) bool; False off agent tokens since A = 0 there
        bias_sq = clip_bias_sq(ratio, adv, clipped)  # (N, T)
        w_corr = w if reduce is None else w_loss  # shares of the whole batch under `reduce`
        bias_sq_sum = weighted_sum(bias_sq, w_corr)
        bias_norm = (bias_sq_sum if reduce is None else reduce(bias_sq_sum)).sqrt()

    lam, extra = None, {}
    if spec is not None:
        ctx = ClipContext(ratio if rs.live is None else rs.live, adv, clipped, loss_mask,
                          loss_agg, w_corr, bias_sq, bias_norm, params, reduce)
        lam, extra = CORRECTIONS[spec.kind].apply(ctx, spec)
    loss = _assemble(rs, parts, rows_loss, w_loss, lam)
    metrics = _metrics(loss, ratio, rs.delta, parts, mf, lengths, w, bias_norm, lam, rs.turn)
    metrics.update(extra)
    return loss, metrics


def _assemble(rs: "_Ratios", parts, rows_loss, w_loss, lam) -> torch.Tensor:
    """loss = agg(λ s) with s = a ρ + b: Σ (λ w a) ρ + Σ λ w b — one dot product in ρ, or at
    turn level Σ_k ρ^k C^k with C^k = Σ_{t∈k} λ_i c_i a_t (`TurnDot`; w = m c per row)."""
    seq_lam = lam is not None and lam.dim() > 0  # λ_i per trajectory, else a scalar or None
    with torch.no_grad():
        w_l = w_loss * lam.unsqueeze(1) if seq_lam else w_loss  # (N, T)
        const = weighted_sum(parts.const, w_l)
        if lam is not None and not seq_lam:
            const = const * lam
    if rs.turn is not None:
        segs, rho_seg, _ = rs.turn
        row_l = rows_loss if lam is None else rows_loss * lam  # (N,) λ folds in per row
        return TurnDot.apply(rs.graph, rho_seg, parts.coef, segs, row_l.unsqueeze(1)) + const
    with torch.no_grad():
        grad_coef = parts.coef * w_l  # (N, T)
    loss = weighted_sum(rs.graph, grad_coef)
    if lam is not None and not seq_lam:
        return loss * lam + const
    return loss + const


class _Ratios(NamedTuple):
    ratio: torch.Tensor  # (N, T) ρ, detached; 1 off agent tokens
    delta: Optional[torch.Tensor]  # (N, T) δ with graph; None at turn level (not formed)
    mask_float: torch.Tensor  # (N, T) 0/1 in ρ's dtype
    lengths: torch.Tensor  # (N,) agent tokens per trajectory, in ρ's dtype
    graph: torch.Tensor  # (N, T) what the loss differentiates: ρ, or clamp(lp − old) (turn)
    live: Optional[torch.Tensor]  # (N, T) ρ with graph, when needed (grad estimator)
    turn: Optional[tuple]  # (TurnSegments, ρ^k (N, K), Σ_{t∈k} δ_t (N, K)) at turn level


def _ratio_stage(log_probs, old_log_probs, loss_mask, turn_ids, ratio_level, live) -> _Ratios:
    """ρ at `ratio_level`. Turn level: the segment sums discard segment 0 and the loss
    Σ_k ρ^k C^k (`TurnDot`) has a backward that is 0 off agent tokens, so the clamped log-ratio
    is never masked (δ (N, T) is not formed); ρ (N, T) is a detached gather of ρ^k."""
    if ratio_level != "turn":
        delta = log_ratio(log_probs, old_log_probs, loss_mask)  # (N, T) with graph
        with torch.no_grad():
            mf = mask_float(loss_mask, delta.dtype)  # (N, T)
            lengths = mf.sum(dim=1)  # (N,)
        rho = RATIO_LEVELS[ratio_level](delta, loss_mask, turn_ids)  # (N, T) with graph
        return _Ratios(rho.detach(), delta, mf, lengths, rho, rho, None)
    diff = clamped_log_ratio(log_probs, old_log_probs)  # (N, T) with graph, garbage off mask
    with torch.no_grad():
        mf = mask_float(loss_mask, diff.dtype)  # (N, T)
        segs = TurnSegments.build(loss_mask, turn_ids, mf)
        rho_seg, delta_seg = segs.ratio(diff)  # (N, K) each; segment 0 (garbage) discarded
        ratio = segs.gather(rho_seg)  # (N, T)
        lengths = segs.count.sum(dim=1)  # (N,) from the (N, K) counts, no (N, T) pass
    rho = TurnRatio.apply(torch.where(loss_mask, diff, 0.0), segs) if live else None
    return _Ratios(ratio, None, mf, lengths, diff, rho, (segs, rho_seg, delta_seg))


def _metrics(loss, ratio, delta, parts, mf, lengths, w, bias_norm, lam, turn) -> dict:
    with torch.no_grad():
        n_tok = lengths.sum().clamp(min=1)
        one = torch.ones((), device=ratio.device, dtype=ratio.dtype)
        ratio = ratio.detach()
        s = parts.coef * ratio + parts.const  # (N, T) surrogate, 0 off agent tokens
        hi = torch.count_nonzero(parts.clipped_high) / n_tok
        lo = torch.count_nonzero(parts.clipped_low) / n_tok
        if lam is None:
            scale, triggered = one, torch.zeros_like(one)
        elif lam.dim() == 0:
            scale, triggered = lam, (lam < 1.0).to(one.dtype)
        else:  # per trajectory: over trajectories with agent tokens
            has_tok = lengths > 0  # (N,)
            scale = torch.where(has_tok, lam, 0.0).sum() / has_tok.sum().clamp(min=1)
            triggered = (has_tok & (lam < 1.0)).any().to(one.dtype)
        if turn is not None:  # ρ and δ are constant / summed per segment: (N, K) work only
            segs, rho_seg, delta_seg = turn
            kl = -delta_seg.sum() / n_tok
            ratio_mean = weighted_sum(rho_seg, segs.count) / n_tok  # Σ_k ρ^k |y^k| / n
            rho_agent = torch.where(segs.count > 0, rho_seg, 0.0)  # (N, K)
            ratio_max = rho_agent.max() if rho_agent.numel() else torch.zeros_like(one)
        else:
            ratio_m = ratio * mf  # (N, T) ρ > 0 and finite: its max is the max over agent tokens
            kl = -delta.detach().sum() / n_tok
            ratio_mean = ratio_m.sum() / n_tok
            ratio_max = ratio_m.max() if ratio_m.numel() else torch.zeros_like(one)
        return {
            PG_LOSS: loss.detach(),
            PG_LOSS_NORM: weighted_sum(s * s, w).sqrt(),
            PG_CLIPFRAC: hi + lo,
            PG_CLIPFRAC_HIGH: hi,
            PG_CLIPFRAC_LOW: lo,
            PPO_KL: kl,
            RATIO_MEAN: ratio_mean,
            RATIO_MAX: ratio_max,
            CLIP_BIAS_NORM: bias_norm,
            CLIP_BIAS_NORM_MAX: bias_norm.clone(),
            CLIP_BIAS_SCALE: scale.detach().to(one.dtype),
            CLIP_BIAS_TRIGGERED: triggered,
        }
