"""Step diagnostics as pure functions (docs/design.md §4): the per-turn breakdown of the policy loss,
the groups without reward signal, and the sampler-vs-trainer log-prob mismatch.

Per turn k (the k-th generation call, `turn_ids == k` on agent tokens), over a minibatch with n
trajectories, with δ_t = clamp(log π_θ − log π_old, −20, 20), ρ the preset's importance ratio,
κ the clipped indicator of `stppo.algos.surrogate`, A the advantage and H the entropy:

    pg_clipfrac_k = mean_{t∈k} κ_t        ratio_mean_k = mean_{t∈k} ρ_t     ratio_max_k = max_{t∈k} ρ_t
    adv_mean_k    = mean_{t∈k} A_t        ppo_kl_k     = mean_{t∈k} −δ_t    entropy_k   = mean_{t∈k} H_t
    tokens_k      = |{t ∈ k}| / n         (agent tokens of turn k per trajectory)
    rollout_kl_k  = mean_{t∈k} (log π_rollout − log π_old)     (with the sampler's log-probs)

Turns without a token in the minibatch are left out (no value, not 0). One `index_add_` per
quantity over the flattened agent tokens: no loop over rows or turns.

Groups without signal (group presets; `group_ids` = the prompt): with G groups,

    zero_std_group_frac = |{g : all scores of g equal}| / G,  all_zero = … all 0,  all_one = … all 1

Sampler vs trainer (verl 0.9.1's `compute_offpolicy_metrics`, rollout_corr_helper, on the same
tensors; r_t = log π_train − log π_rollout on agent tokens, π_train the recomputed π_old — the
current π_θ in bypass mode, as verl's bypass loss —, mean_m verl's masked mean Σ m x / Σ m,
ℓ̄_i = mean_m over trajectory i of a log-prob, means over i over every row):

    kl = mean_m(−r)    k3_kl = mean_m(e^r − r − 1)    training_ppl = mean_i exp(−ℓ̄_i^train)
    training_log_ppl = mean_i(−ℓ̄_i^train), rollout_ppl / rollout_log_ppl the same of π_rollout
    d_i = ℓ̄_i^rollout − ℓ̄_i^train:  log_ppl_diff = mean_i d_i, log_ppl_abs_diff = mean_i |d_i|,
    log_ppl_diff_max / _min = max_i / min_i d_i, ppl_ratio = mean_i e^{d_i}
    chi2_token = mean_m((e^{clamp(r, ±20)})²) − 1   chi2_seq = mean_i e^{2 clamp(Σ_{t∈i} r_t, ±20)} − 1

plus stppo's abs_diff_mean = mean |r̃|, abs_diff_max = max |r̃| (r̃ = clamp(r, ±20), mean over agent
tokens) and, when `threshold` is given, the token IS statistics of ω = min(e^r, C)
(`stppo.algos.rollout_corr.weights.is_metrics`: a diagnostic of what truncated IS would do, logged
when the run's correction applies no IS weights of its own).
"""

from __future__ import annotations

from typing import Optional

import torch

from stppo.algos.ratios import LOG_RATIO_CLAMP
from stppo.algos.rollout_corr.presets import SAFETY_BOUND
from stppo.algos.rollout_corr.weights import is_weights, masked_mean, masked_sum
from stppo import metric_names as K
from stppo.metric_names import ALL_ONE_GROUP_FRAC, ALL_ZERO_GROUP_FRAC, ZERO_STD_GROUP_FRAC, turn_key


@torch.no_grad()
def turn_breakdown(ratio: torch.Tensor, log_probs: torch.Tensor, old_log_probs: torch.Tensor,
                   advantages: torch.Tensor, entropy: torch.Tensor, clipped: torch.Tensor,
                   loss_mask: torch.Tensor, turn_ids: torch.Tensor, max_turns: int,
                   rollout_log_probs: Optional[torch.Tensor] = None) -> dict[str, torch.Tensor]:
    """The per-turn metrics of the module docstring, keyed `turn/k{k}/{name}`, for the turns
    0..max_turns−1 that have agent tokens; detached 0-d tensors. Every tensor (N, T); values off
    agent tokens may be anything (nan/inf included). `rollout_kl` only with `rollout_log_probs`."""
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
    if rollout_log_probs is not None:
        values["rollout_kl"] = mean(rollout_log_probs.to(dtype) - old_log_probs.to(dtype))
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
                     loss_mask: torch.Tensor, threshold: Optional[float] = None,
                     ) -> dict[str, torch.Tensor]:
    """The sampler-vs-trainer metrics of the module docstring (detached 0-d float64 tensors),
    computed in float64. old_log_probs: the trainer's (π_old, or π_θ in bypass mode),
    rollout_log_probs: the sampler's, loss_mask: bool — all (N, T), anything off agent tokens.
    `threshold`: C of the diagnostic token IS statistics (None: none)."""
    m = loss_mask
    old, roll = old_log_probs.double(), rollout_log_probs.double()
    r = old - roll  # (N, T) log π_train − log π_rollout
    train_row = masked_mean(old, m, dim=-1)  # (N,) ℓ̄_i of π_train
    roll_row = masked_mean(roll, m, dim=-1)  # (N,)
    d = roll_row - train_row  # (N,)
    safe = r.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    n = m.sum().clamp(min=1).double()
    abs_r = torch.where(m, safe, 0.0).abs()
    out = {K.ROLLOUT_CORR_TRAINING_PPL: (-train_row).exp().mean(),
           K.ROLLOUT_CORR_TRAINING_LOG_PPL: (-train_row).mean(),
           K.ROLLOUT_CORR_KL: masked_mean(roll - old, m),
           K.ROLLOUT_CORR_K3_KL: masked_mean(r.exp() - r - 1.0, m),
           K.ROLLOUT_CORR_ROLLOUT_PPL: (-roll_row).exp().mean(),
           K.ROLLOUT_CORR_ROLLOUT_LOG_PPL: (-roll_row).mean(),
           K.ROLLOUT_CORR_LOG_PPL_DIFF: d.mean(), K.ROLLOUT_CORR_LOG_PPL_ABS_DIFF: d.abs().mean(),
           K.ROLLOUT_CORR_LOG_PPL_DIFF_MAX: d.max(), K.ROLLOUT_CORR_LOG_PPL_DIFF_MIN: d.min(),
           K.ROLLOUT_CORR_PPL_RATIO: d.exp().mean(),
           K.ROLLOUT_CORR_CHI2_TOKEN: masked_mean(safe.exp().square(), m) - 1.0,
           K.ROLLOUT_CORR_CHI2_SEQ: (2.0 * masked_sum(r, m, dim=-1).clamp(
               -SAFETY_BOUND, SAFETY_BOUND)).exp().mean() - 1.0,
           K.ROLLOUT_CORR_ABS_DIFF_MEAN: abs_r.sum() / n,
           K.ROLLOUT_CORR_ABS_DIFF_MAX: abs_r.max() if abs_r.numel() else r.new_zeros(())}
    if threshold is not None:
        _, is_m = is_weights(r, m, "token", threshold)
        out.update(is_m)
    return out
