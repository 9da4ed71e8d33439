"""Step diagnostics as pure functions (docs/design.md §4): the per-turn breakdown of the policy loss,
the groups without reward signal, and the sampler-vs-trainer log-prob mismatch.

Per turn k (the k-th generation call, `turn_ids == k` on agent tokens), over a minibatch with n
trajectories, with δ_t = clamp(log π_θ − log π_old, −20, 20), ρ the preset's importance ratio,
κ the clipped indicator of `stppo.algos.surrogate`, A the advantage and H the entropy:

    pg_clipfrac_k = mean_{t∈k} κ_t        ratio_mean_k = mean_{t∈k} ρ_t     ratio_max_k = max_{t∈k} ρ_t
    adv_mean_k    = mean_{t∈k} A_t        ppo_kl_k     = mean_{t∈k} −δ_t    entropy_k   = mean_{t∈k} H_t
    tokens_k      = |{t ∈ k}| / n         (agent tokens of turn k per trajectory)

Turns without a token in the minibatch are left out (no value, not 0). One `index_add_` per
quantity over the flattened agent tokens: no loop over rows or turns.

Groups without signal (group presets; `group_ids` = the prompt): with G groups,

    zero_std_group_frac = |{g : all scores of g equal}| / G,  all_zero = … all 0,  all_one = … all 1

Sampler vs trainer (verl's `rollout_corr/*`, `compute_offpolicy_metrics` and the token-level
`rollout_is` statistics; r_t = log π_old − log π_rollout on agent tokens):

    kl = mean(−r)        k3_kl = mean(e^r − r − 1)       log_ppl_diff = mean_i(mean_{t∈i}(−r))
    abs_diff_mean = mean |r|,  abs_diff_max = max |r|  (stppo's), and the statistics of the
    truncated IS weights ω = min(e^r, C) of `stppo.algos.rollout_is` (mean, max, ESS, fractions).
"""

from __future__ import annotations

import torch

from stppo.algos.ratios import LOG_RATIO_CLAMP
from stppo.algos.rollout_is import truncated_is_weights
from stppo.metric_names import (ALL_ONE_GROUP_FRAC, ALL_ZERO_GROUP_FRAC, ROLLOUT_CORR_ABS_DIFF_MAX,
                            ROLLOUT_CORR_ABS_DIFF_MEAN, ROLLOUT_CORR_K3_KL, ROLLOUT_CORR_KL,
                            ROLLOUT_CORR_LOG_PPL_DIFF, ZERO_STD_GROUP_FRAC, turn_key)


@torch.no_grad()
def turn_breakdown(ratio: torch.Tensor, log_probs: torch.Tensor, old_log_probs: torch.Tensor,
                   advantages: torch.Tensor, entropy: torch.Tensor, clipped: torch.Tensor,
                   loss_mask: torch.Tensor, turn_ids: torch.Tensor,
                   max_turns: int) -> dict[str, torch.Tensor]:
    """The per-turn metrics of the module docstring, keyed `turn/k{k}/{name}`, for the turns
    0..max_turns−1 that have agent tokens; detached 0-d tensors. Every tensor (N, T); values off
    agent tokens may be anything (nan/inf included)."""
    if max_turns < 1:
        raise ValueError(f"max_turns must be >= 1, got {max_turns}")
    sel = loss_mask & (turn_ids >= 0) & (turn_ids < max_turns)  # (N, T)
    idx = turn_ids[sel]  # (M,)
    dtype = torch.float64
    count = torch.zeros(max_turns, dtype=dtype, device=idx.device).index_add_(
        0, idx, torch.ones_like(idx, dtype=dtype))  # (K,)

    def mean(x: torch.Tensor) -> torch.Tensor:  # (K,) mean over each turn's tokens
        total = torch.zeros(max_turns, dtype=dtype, device=idx.device)
        return total.index_add_(0, idx, x[sel].to(dtype)) / count.clamp(min=1.0)

    delta = (log_probs.detach() - old_log_probs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    rho = ratio.detach()
    rho_max = torch.full((max_turns,), float("-inf"), dtype=dtype, device=idx.device).scatter_reduce(
        0, idx, rho[sel].to(dtype), reduce="amax")
    values = {"pg_clipfrac": mean(clipped.to(dtype)), "ratio_mean": mean(rho),
              "ratio_max": rho_max, "adv_mean": mean(advantages), "ppo_kl": mean(-delta),
              "entropy": mean(entropy.detach()), "tokens": count / max(1, loss_mask.shape[0])}
    present = [k for k in range(max_turns) if count[k] > 0]
    return {turn_key(k, name): v[k] for k in present for name, v in values.items()}


@torch.no_grad()
def group_signal_fractions(scores: torch.Tensor, group_ids: torch.Tensor) -> dict[str, float]:
    """Fractions of groups whose scores all agree / are all 0 / are all 1. scores, group_ids (N,)."""
    if scores.dim() != 1 or group_ids.shape != scores.shape:
        raise ValueError(f"scores and group_ids must have one shape (N,), got "
                         f"{tuple(scores.shape)} and {tuple(group_ids.shape)}")
    _, inv = torch.unique(group_ids, return_inverse=True)  # (N,)
    g = int(inv.max()) + 1 if inv.numel() else 0
    if g == 0:
        return {ZERO_STD_GROUP_FRAC: 0.0, ALL_ZERO_GROUP_FRAC: 0.0, ALL_ONE_GROUP_FRAC: 0.0}
    r = scores.to(torch.float64)
    lo = torch.full((g,), float("inf"), dtype=r.dtype).scatter_reduce(0, inv, r, reduce="amin")
    hi = torch.full((g,), float("-inf"), dtype=r.dtype).scatter_reduce(0, inv, r, reduce="amax")
    same = hi == lo  # (G,)
    return {ZERO_STD_GROUP_FRAC: float(same.double().mean()),
            ALL_ZERO_GROUP_FRAC: float((same & (lo == 0)).double().mean()),
            ALL_ONE_GROUP_FRAC: float((same & (lo == 1)).double().mean())}


@torch.no_grad()
def sampler_mismatch(old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor,
                     loss_mask: torch.Tensor, threshold: float = 2.0) -> dict[str, torch.Tensor]:
    """The sampler-vs-trainer metrics of the module docstring (detached 0-d tensors); all (N, T),
    anything off agent tokens. `threshold`: C of the truncated IS weights."""
    _, is_metrics = truncated_is_weights(old_log_probs, rollout_log_probs, loss_mask, threshold)
    m = loss_mask
    mf = m.to(torch.float64)
    n = mf.sum().clamp(min=1.0)
    r = torch.where(m, old_log_probs.double() - rollout_log_probs.double(), 0.0)  # (N, T)
    r = r.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    lengths = mf.sum(dim=1)  # (N,)
    has = lengths > 0
    per_row = -r.sum(dim=1) / lengths.clamp(min=1.0)  # (N,) mean log p_rollout − log p_old
    abs_r = r.abs()
    out = {ROLLOUT_CORR_KL: -r.sum() / n,
           ROLLOUT_CORR_K3_KL: ((r.exp() - r - 1.0) * mf).sum() / n,
           ROLLOUT_CORR_LOG_PPL_DIFF: per_row[has].mean() if bool(has.any()) else r.new_zeros(()),
           ROLLOUT_CORR_ABS_DIFF_MEAN: abs_r.sum() / n,
           ROLLOUT_CORR_ABS_DIFF_MAX: abs_r.max() if abs_r.numel() else r.new_zeros(())}
    return {**{k: v.float() for k, v in out.items()}, **is_metrics}
