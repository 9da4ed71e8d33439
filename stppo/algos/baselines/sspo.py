"""SSPO: subsentence-level policy optimisation (Yang et al., "SSPO: Subsentence-level Policy
Optimization", arXiv 2511.04256 v1/v2). Importance ratios per *subsentence* — between GRPO's
token ratio and GSPO's sequence ratio — and clip bounds adapted by the subsentence's entropy:
wider for high-entropy subsentences, narrower for low-entropy ones.

The paper's equations were not available to this project (its abstract, v1 and v2, is; docs/
design.md §2 says what was read where). This module is the best-documented reading, every choice
an option or a stated rule:

    subsentences: maximal runs of consecutive agent tokens of one turn, each ended by a delimiter
        token (`stppo.algos.segments.subsentence_ids`; the caller passes them as `segment_ids`,
        the trainer derives them from the token ids, stppo.train.prepare) — never across a turn
        boundary or an observation;
    ρ_s = exp( (1/|s|) Σ_{t∈s} δ_t )          the geometric mean of the subsentence's token
        ratios, GSPO's length-normalised form (arXiv 2507.18071 Eq. 7) on a subsentence, with no
        stop-gradient (as stppo's turn ratio);
    H_s = (1/|s|) Σ_{t∈s} −log π_old(y_t),  H̄_i = the same over trajectory i's agent tokens —
        the subsentence's entropy, estimated from the sampled tokens (E_{y∼π}[−log π(y)] is the
        token entropy): no extra forward, a pure function of the loss's inputs;
    w_s = clamp( (H_s / H̄_i)^α, w_min, w_max )     (w_s = 1 where H̄_i = 0), the clip scale;
    s_t = max(−A_t ρ_s, −A_t clip(ρ_s, 1 − ε_low w_s, 1 + ε_high w_s))  for t ∈ s
        (+ the dual clip when set), L = agg(s);
    κ_high = (A > 0) ∧ (ρ_s > 1 + ε_high w_s), κ_low = (A < 0) ∧ (ρ_s < 1 − ε_low w_s);
    clipping bias b_t = κ_t ρ_s A_t.

Limits (tested): α = 0 gives w ≡ 1, the clip path at a ratio level whose segments are the
subsentences — the token level when every token ends one, the turn level when none does.
Options: entropy_alpha (α ≥ 0, 1.0), scale_min (w_min > 0, 0.5), scale_max (w_max ≥ w_min, 2.0).
H̄_i is trajectory i's own, so the loss is separable (micro-batches backward their shares).
Extra metrics: actor/sspo_clip_scale_std (the token standard deviation of w; its token mean is 1
wherever no bound of the clamp binds, since Σ_t H_{s(t)} = Σ_t −log π_old(y_t)),
actor/sspo_subsentence_length_mean (agent tokens per subsentence).
"""

from __future__ import annotations

import torch

from stppo.algos.baselines.common import assemble, metrics, token_view, weighted
from stppo.algos.contract import LossInputs, loss_mode
from stppo.algos.segments import TurnRatio, TurnSegments, subsentence_runs
from stppo.algos.surrogate import surrogate_parts
from stppo.metric_names import SSPO_CLIP_SCALE_STD, SSPO_SUBSENTENCE_LENGTH

DEFAULTS = {"entropy_alpha": 1.0, "scale_min": 0.5, "scale_max": 2.0}


def check(opts: dict) -> None:
    if not opts["entropy_alpha"] >= 0:
        raise ValueError(f"loss_mode='sspo': entropy_alpha must be >= 0, got {opts['entropy_alpha']}")
    if not opts["scale_min"] > 0:
        raise ValueError(f"loss_mode='sspo': scale_min must be > 0, got {opts['scale_min']}")
    if not opts["scale_max"] >= opts["scale_min"]:
        raise ValueError(f"loss_mode='sspo': scale_max must be >= scale_min, got "
                         f"{opts['scale_max']} < {opts['scale_min']}")


@torch.no_grad()
def clip_scale(old_log_probs: torch.Tensor, loss_mask: torch.Tensor, segs: TurnSegments,
               opts: dict, dtype: torch.dtype) -> torch.Tensor:
    """w (N, T) of the module docstring on agent tokens, 1 elsewhere."""
    u = torch.where(loss_mask, -old_log_probs, 0.0).to(dtype)  # (N, T) −log π_old(y_t)
    u = u.clamp(min=0.0)  # a log-prob rounded above 0 is no negative entropy
    h_seg = segs.scatter(u) * segs.inv_count.to(dtype)  # (N, K) H_s
    lengths = loss_mask.sum(dim=1).to(dtype)  # (N,)
    h_row = u.sum(dim=1) / lengths.clamp(min=1.0)  # (N,) H̄_i
    rel = segs.gather(h_seg) / torch.where(h_row > 0, h_row, 1.0).unsqueeze(1)  # (N, T)
    w = rel.pow(opts["entropy_alpha"]).clamp(opts["scale_min"], opts["scale_max"])  # (N, T)
    return torch.where(loss_mask & (h_row > 0).unsqueeze(1), w, 1.0)


@loss_mode("sspo", options=DEFAULTS, ratio_levels=("token",), dual_clip=True, separable=True,
           segments=True, check=check, source="SSPO (arXiv 2511.04256)")
def sspo_loss(x: LossInputs, spec) -> tuple[torch.Tensor, dict]:
    """(loss, metrics) of SSPO (module docstring): `x.segment_ids` (N, T) int, the subsentence
    labels of the agent tokens."""
    old_log_probs, loss_mask, turn_ids, segment_ids = x.old_log_probs, x.loss_mask, x.turn_ids, x.segment_ids
    clip_low, clip_high, dual_clip, loss_agg = spec.clip_low, spec.clip_high, spec.dual_clip, spec.loss_agg
    reduce, opts = x.reduce, spec.options
    v = token_view(x, loss_agg)
    with torch.no_grad():
        sub = subsentence_runs(segment_ids, loss_mask, turn_ids)  # (N, T) 0.. per row, −1 off
        segs = TurnSegments.build(loss_mask, sub, v.mf)
        w = clip_scale(old_log_probs, loss_mask, segs, opts, v.delta.dtype)  # (N, T)
    rho = TurnRatio.apply(v.delta, segs)  # (N, T) ρ_s, with graph; 1 off agent tokens
    with torch.no_grad():
        parts = surrogate_parts(rho.detach(), v.adv, clip_low * w, clip_high * w, dual_clip)
        n_sub = (segs.count[:, 1:] > 0).sum()
    s = weighted(v, parts.coef * rho + parts.const)  # (N, T)
    loss = assemble(v, s)
    bias = weighted(v, parts.clipped * rho.detach() * v.adv)
    m = metrics(v, loss, s, parts.clipped_high, parts.clipped_low, bias, reduce, ratio=rho)
    n_tok = v.lengths.sum()
    w_mean = (w * v.mf).sum() / n_tok.clamp(min=1)
    m[SSPO_CLIP_SCALE_STD] = (((w - w_mean) * v.mf).square().sum() / n_tok.clamp(min=1)).sqrt()
    m[SSPO_SUBSENTENCE_LENGTH] = n_tok / n_sub.clamp(min=1).to(n_tok.dtype)
    return loss, m
