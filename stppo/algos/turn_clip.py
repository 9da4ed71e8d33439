"""The clip path of `policy_loss` at turn level, computed on turn statistics (docs/design.md §2).

At turn level ρ_t = ρ^k is constant on a turn k, and every per-token term of the clipped loss —
the coefficient a_t and constant b_t of s_t = a_t ρ_t + b_t, the clip indicators κ, s_t² and the
clip bias κ(ρA)² — depends on t only through ρ^k, A_t and the sign of A_t
(`stppo.algos.surrogate`). Split each (row, turn) segment by the sign of the advantage,
c ∈ {−, 0, +}; four sums per part are sufficient statistics:

    n_{k,c} = Σ 1,   S_{k,c} = Σ A_t,   Q_{k,c} = Σ A_t²   over the tokens of part (k, c),
    D_k = Σ_{t∈k} δ_t,   ρ^k = exp(D_k / |y^k|),   |y^k| = Σ_c n_{k,c}.

With β_{k,c} the bound of a binding clip (1 + ε_high for c = +, 1 − ε_low or the dual clip for
c = −) and r_{k,c} = β_{k,c} when it binds, ρ^k otherwise:

    C^k = −Σ_{c unclipped} S_{k,c},   B^k = −Σ_{c clipped} β_{k,c} S_{k,c}
    loss = Σ_i c_i λ_i Σ_k (ρ^k C^k + B^k)                        (w = m c, λ the clip-bias scale)
    Σ_{t∈k} s_t² = Σ_c r_{k,c}² Q_{k,c}      Σ_{t∈k} κ(ρA)² = (ρ^k)² (κ_high^k Q_{k,+} + κ_low^k Q_{k,−})
    #κ_high = Σ_k κ_high^k n_{k,+}           #κ_low = Σ_k κ_low^k n_{k,−}

The loss is one autograd node (`SegmentDot`) whose backward is one gather of the closed form of
Lemma 4.1 (ST-PPO, arXiv 2511.20718 v1), ∂L/∂δ_t = ρ^k C^k / |y^k| per token of turn k. Per token
there is only the clamped log-ratio, the part index and the four scatters (no autograd graph:
the backward is that one gather); the rest is (N, K) work. The token path (`stppo.algos.loss`) computes the same numbers token by token.
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import torch

from stppo.algos.aggregation import GlobalDenoms, agg_row_weights, mask_float
from stppo.algos.clip_bias import CLIP_BIAS_KINDS, ClipContext, ClipBias, Reduce
from stppo.algos.clip_metrics import clip_metrics
from stppo.algos.ratios import LOG_RATIO_CLAMP
from stppo.algos.segments import INTERLEAVE as B, _segment_sum, segment_ids

HALF = (torch.float16, torch.bfloat16)  # log-ratios of these are taken in float32
NEG, ZERO, POS = 0, 1, 2  # part of a segment: the sign of A (+1 shifts sign() to an index)
PARTS = 3


@functools.lru_cache(maxsize=16)
def _part_ramp(length: int, device: torch.device) -> torch.Tensor:
    """(t mod B) + B·(PARTS + 1), int64, cached read-only (T,): the slot of a token of turn id 0
    and sign 0 less B·sign, see `TurnStats.build`."""
    return torch.arange(length, device=device) % B + B * (PARTS + ZERO)


class TurnStats(NamedTuple):
    """The (row, turn, sign of A) statistics of a batch. Segment k = turn id + 1 (k < K = max turn
    id + 2); segment 0 holds every non-agent token and is discarded (its sums are set to 0)."""

    slot: torch.Tensor  # (N, T) int64 accumulator of each token: B·(PARTS·k + sign + 1) + t mod B
    n: torch.Tensor  # (N, K, 3) tokens per part
    s: torch.Tensor  # (N, K, 3) Σ A per part
    q: torch.Tensor  # (N, K, 3) Σ A² per part
    count: torch.Tensor  # (N, K) |y^k|, 0 for segment 0
    inv_count: torch.Tensor  # (N, K) 1/max(|y^k|, 1), 0 for segment 0
    delta_sum: torch.Tensor  # (N, K) D_k, 0 for segment 0
    rho: torch.Tensor  # (N, K) ρ^k, 1 for segment 0 and empty segments

    @staticmethod
    @torch.no_grad()
    def build(diff: torch.Tensor, adv: torch.Tensor, loss_mask: torch.Tensor,
              turn_ids: torch.Tensor) -> "TurnStats":
        """From the clamped log-ratio `diff` (N, T) (anything finite or not off agent tokens), the
        advantages `adv` (N, T) (0 off agent tokens, finite), `loss_mask` and `turn_ids` (N, T).

        One host sync: the range of the turn ids sizes the accumulators (see
        `stppo.algos.segments.TurnSegments.build`)."""
        n_rows, t = loss_mask.shape
        ids, k = segment_ids(loss_mask, turn_ids)  # (N, T), K
        out = ids if ids.dtype == torch.int64 else None  # in place: one (N, T) buffer fewer
        slot = torch.add(_part_ramp(t, ids.device), ids, alpha=B * PARTS, out=out)  # (N, T)
        slot.add_(adv.sign().to(torch.int64), alpha=B)  # B·(3(id + 1) + sign + 1) + t mod B
        mf = mask_float(loss_mask, diff.dtype)  # (N, T)

        def sums(x: torch.Tensor) -> torch.Tensor:  # (N, T) → (N, K, 3), segment 0 discarded
            out = _segment_sum(x, slot, k * PARTS).view(n_rows, k, PARTS)
            out[:, 0] = 0.0
            return out

        n, s, q = sums(mf), sums(adv), sums(adv * adv)
        delta_sum = sums(diff).sum(2)  # (N, K)
        count = n.sum(2)  # (N, K)
        inv = count.clamp(min=1.0).reciprocal_()
        inv[:, 0] = 0.0
        return TurnStats(slot, n, s, q, count, inv, delta_sum, (delta_sum * inv).exp())

    def gather(self, v: torch.Tensor) -> torch.Tensor:
        """(N, K) → (N, T): each token's segment value."""
        return v.repeat_interleave(B * PARTS, dim=1).gather(1, self.slot)


class SegmentDot(torch.autograd.Function):
    """`SegmentDot.apply(log_probs, stats, coef, live)` → Σ_{i,k} ρ^k C^k (0-d) with C = `coef`
    (N, K) constant, differentiable in `log_probs` (N, T), whose clamped log-ratios gave ρ^k:
    ∂/∂log π(y_t) = ρ^k C^k / |y^k| · 1[δ_t not clamped] (one gather; `live` (N, T) bool is that
    indicator), 0 off agent tokens (segment 0). π_old is a constant."""

    @staticmethod
    def forward(ctx, log_probs: torch.Tensor, stats: TurnStats, coef: torch.Tensor,
                live: torch.Tensor) -> torch.Tensor:
        term = stats.rho * coef  # (N, K)
        ctx.stats, ctx.dtype = stats, log_probs.dtype
        ctx.save_for_backward(term * stats.inv_count, live)
        return term.sum()  # in the dtype of the ratios (float32 for half log-probs)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        g_seg, live = ctx.saved_tensors
        g = ctx.stats.gather(g_seg * grad).mul_(live)  # (N, T)
        return g.to(ctx.dtype), None, None, None


class _Clip(NamedTuple):
    """Per segment: where each sign's clip binds, its bound, and the ratio the surrogate uses."""

    high: torch.Tensor  # (N, K) bool κ_high^k (A > 0 part)
    low: torch.Tensor  # (N, K) bool κ_low^k (A < 0 part)
    r_pos: torch.Tensor  # (N, K) r_{k,+}
    r_neg: torch.Tensor  # (N, K) r_{k,−}
    fixed_neg: torch.Tensor  # (N, K) bool: a clip binds on the A < 0 part (κ_low or dual)


def _clip(rho: torch.Tensor, clip_low: float, clip_high: float,
          dual_clip: Optional[float]) -> _Clip:
    high = rho > 1.0 + clip_high
    low = rho < 1.0 - clip_low
    r_pos = torch.where(high, 1.0 + clip_high, rho)
    r_neg = torch.where(low, 1.0 - clip_low, rho)
    fixed_neg = low
    if dual_clip is not None:
        dual = rho > dual_clip  # never κ_low: 1 − ε_low < 1 < c
        r_neg = torch.where(dual, float(dual_clip), r_neg)
        fixed_neg = low | dual
    return _Clip(high, low, r_pos, r_neg, fixed_neg)


def turn_clip_policy_loss(log_probs: torch.Tensor, old_log_probs: torch.Tensor,
                          advantages: torch.Tensor, loss_mask: torch.Tensor,
                          turn_ids: torch.Tensor, *, clip_low: float, clip_high: float,
                          loss_agg: str, spec: Optional[ClipBias],
                          dual_clip: Optional[float], global_denoms: GlobalDenoms,
                          params: Optional[list[torch.Tensor]], reduce: Reduce,
                          clip_bias_grad_norm: Optional[torch.Tensor] = None,
                          ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The loss mode `clip` (`stppo.algos.loss`) at ratio_level='turn' (the tensors checked by
    `policy_loss`); the same loss, gradient and metrics as the token-by-token computation, up to
    float rounding."""
    with torch.no_grad():
        raw = (log_probs.float() if log_probs.dtype in HALF else log_probs) - old_log_probs
        diff = raw.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)  # (N, T), garbage off agent tokens
        live = diff == raw  # (N, T) where the clamp passes the gradient (False on nan)
        adv = torch.where(loss_mask, advantages, 0.0).to(diff.dtype)  # (N, T)
        st = TurnStats.build(diff, adv, loss_mask, turn_ids)
        lengths = st.count.sum(1)  # (N,)
        rows = agg_row_weights(None, loss_agg, lengths=lengths)  # (N,) local: w = m c
        rows_loss = rows if global_denoms is None else agg_row_weights(
            None, loss_agg, global_denoms, lengths=lengths)
        rows_corr = rows if reduce is None else rows_loss  # shares of the whole batch
        cl = _clip(st.rho, clip_low, clip_high, dual_clip)
        s_pos, s_neg = st.s[..., POS], st.s[..., NEG]  # (N, K)
        q_pos, q_neg = st.q[..., POS], st.q[..., NEG]
        # Σ A over the A = 0 part is 0, or nan where an advantage is nan (sign(nan) = 0): kept in
        # C^k so that a nan advantage makes the loss nan, as token by token
        coef = -(torch.where(cl.high, 0.0, s_pos) + torch.where(cl.fixed_neg, 0.0, s_neg)
                 + st.s[..., ZERO])
        const = -(torch.where(cl.high, s_pos * cl.r_pos, 0.0)
                  + torch.where(cl.fixed_neg, s_neg * cl.r_neg, 0.0))  # (N, K) B^k
        rho_sq = st.rho.square()
        bias_seg = rho_sq * (torch.where(cl.high, q_pos, 0.0) + torch.where(cl.low, q_neg, 0.0))
        bias_rows = bias_seg.sum(1)  # (N,) Σ_{t∈i} κ(ρA)²
        bias_sq_sum = (bias_rows * rows_corr).sum()
        bias_norm = (bias_sq_sum if reduce is None else reduce(bias_sq_sum)).sqrt()
        n_high = torch.where(cl.high, st.n[..., POS], 0.0).sum()
        n_low = torch.where(cl.low, st.n[..., NEG], 0.0).sum()

    def rms_sums() -> torch.Tensor:  # (4,) Σ κ(ρA)², Σ (ρA)², #κ, #agent tokens
        with torch.no_grad():
            return torch.stack([bias_rows.sum(), (rho_sq * (q_pos + q_neg)).sum(), n_high + n_low,
                                lengths.sum()])

    def bias_term() -> torch.Tensor:  # agg(κρA) with graph: Σ_i c_i Σ_k ρ^k (κ_h S_+ + κ_l S_−)
        kappa_s = torch.where(cl.high, s_pos, 0.0) + torch.where(cl.low, s_neg, 0.0)
        return SegmentDot.apply(log_probs, st, kappa_s * rows_corr.unsqueeze(1), live)

    scale, extra = None, {}
    if spec is not None:
        ctx = ClipContext(bias_norm, bias_rows, lengths, rms_sums, bias_term, params, reduce,
                          clip_bias_grad_norm)
        scale, extra = CLIP_BIAS_KINDS[spec.kind].apply(ctx, spec)
    with torch.no_grad():
        row_l = rows_loss if scale is None else rows_loss * scale  # (N,) λ folds in per row
        const_sum = (const.sum(1) * row_l).sum()
    loss = SegmentDot.apply(log_probs, st, coef * row_l.unsqueeze(1), live) + const_sum
    metrics = _turn_metrics(loss, st, cl, rows, (n_high, n_low), bias_norm, scale)
    metrics.update(extra)
    return loss, metrics


@torch.no_grad()
def _turn_metrics(loss: torch.Tensor, st: TurnStats, cl: _Clip, rows: torch.Tensor,
                  clipped: tuple[torch.Tensor, torch.Tensor], bias_norm: torch.Tensor,
                  scale: Optional[torch.Tensor]) -> dict[str, torch.Tensor]:
    """`clip_metrics` from the turn statistics (token-weighted over agent tokens, as token by
    token); `rows` (N,) the local aggregation factors, `clipped` the counts #κ_high, #κ_low."""
    lengths = st.count.sum(1)  # (N,)
    n_tok = lengths.sum().clamp(min=1)
    q_pos, q_neg = st.q[..., POS], st.q[..., NEG]
    s_sq_rows = (cl.r_pos.square() * q_pos + cl.r_neg.square() * q_neg).sum(1)  # (N,) Σ s²
    rho_agent = torch.where(st.count > 0, st.rho, 0.0)  # (N, K)
    return clip_metrics(
        loss, loss_norm=(s_sq_rows * rows).sum().sqrt(), clipfrac_high=clipped[0] / n_tok,
        clipfrac_low=clipped[1] / n_tok, ppo_kl=-st.delta_sum.sum() / n_tok,
        ratio_mean=(st.rho * st.count).sum() / n_tok,
        ratio_max=rho_agent.max() if rho_agent.numel() else torch.zeros_like(n_tok),
        bias_norm=bias_norm, scale=scale, lengths=lengths)
