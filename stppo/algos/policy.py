"""`policy_loss`: the one entry point of every preset's policy loss (DESIGN.md §2).

    loss_mode 'clip' (default), no options, no rollout IS weights → the clip path
        (`stppo.algos.loss.clip_policy_loss`: token / turn / sequence ratios, corrections)
    anything else → `stppo.algos.baselines.dispatch` (cispo, gmpo, sapo, clip_cov, kl_cov, bapo;
        the clip path with truncated IS weights ω as advantages ωA)

The trainer, the verl plugin and the checks call this function only; its keywords are those of
the clip path plus `loss_mode`, `options` (the mode's named floats) and `rollout_is_weights`
((N, T) detached ω, multiplying the per-token loss).
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping, Optional

import torch

from stppo.algos.aggregation import GlobalDenoms
from stppo.algos.baselines import LOSS_MODES, dispatch
from stppo.algos.clip_bias import Reduce, resolve_correction
from stppo.algos.loss import clip_policy_loss


def policy_loss(log_probs: torch.Tensor, old_log_probs: torch.Tensor, advantages: torch.Tensor,
                loss_mask: torch.Tensor, turn_ids: torch.Tensor, *, ratio_level: str,
                clip_low: float, clip_high: float, loss_agg: str, correction: Any = None,
                dual_clip: Optional[float] = None, global_denoms: GlobalDenoms = None,
                params: Optional[Iterable[torch.Tensor]] = None, reduce: Reduce = None,
                loss_mode: str = "clip", options: Optional[Mapping[str, float]] = None,
                rollout_is_weights: Optional[torch.Tensor] = None,
                correction_grad_norm: Optional[torch.Tensor] = None,
                ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The policy loss of every preset and its diagnostics: `(loss, metrics)`.

    Tensors (N, T): log_probs (with graph), old_log_probs, advantages, loss_mask (bool, agent
    tokens), turn_ids (long); non-agent positions may hold anything (nan/inf). See
    `clip_policy_loss` for the clip path's keywords and metrics; loss_mode ∈ LOSS_MODES."""
    kw = dict(ratio_level=ratio_level, clip_low=clip_low, clip_high=clip_high, loss_agg=loss_agg,
              correction=correction, dual_clip=dual_clip, global_denoms=global_denoms,
              params=params, reduce=reduce)
    if correction_grad_norm is not None:
        kw["correction_grad_norm"] = correction_grad_norm
    if loss_mode == "clip" and not options and rollout_is_weights is None:
        return clip_policy_loss(log_probs, old_log_probs, advantages, loss_mask, turn_ids, **kw)
    return dispatch(log_probs, old_log_probs, advantages, loss_mask, turn_ids, loss_mode=loss_mode,
                    options=options, rollout_is_weights=rollout_is_weights, **kw)


def loss_is_separable(loss_mode: str = "clip", correction: Any = None) -> bool:
    """Whether the policy loss of a batch is the sum of its parts' losses, each part computed
    alone with the batch's denominators (`global_denoms`, no `reduce`) — so gradient accumulation
    may backward each part's own loss. False when a statistic of the whole batch enters every
    token's term: a correction's single λ (granularity 'batch': S-PPO, ST-PPO, SO-PPO), or the
    mode's own batch-level choice (`LossMode.separable`: Clip-/KL-Cov's token selection, BAPO's
    bounds). Per-trajectory λ_i (granularity 'sequence'), TIS weights and every ratio level are
    separable."""
    spec = resolve_correction(correction)
    return LOSS_MODES[loss_mode].separable and (spec is None or spec.granularity == "sequence")
