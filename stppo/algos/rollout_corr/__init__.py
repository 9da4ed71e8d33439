"""Sampler/trainer mismatch corrections (docs/design.md §2, "Rollout correction"): verl 0.9.1's
rollout correction (`verl/trainer/ppo/rollout_corr_helper.py`, `RolloutCorrectionConfig`) as pure
torch functions, equal to verl's on the same tensors (tests/verl/test_rollout_correction_vs_verl.py).

    presets    the names (`ROLLOUT_CORRECTIONS`: none and verl's 18 classmethods) → verl's fields
    weights    IS weights ω: token / sequence level, truncation (TIS) or IcePop, batch normalisation
    rejection  rejection masks: token_k*, seq_sum_k*, seq_mean_k*, seq_max_k* with their thresholds
    reinforce  the bypass-mode REINFORCE loss with explicit IS weights

`rollout_correction(train_log_probs, rollout_log_probs, loss_mask, rc)` is verl's
`compute_rollout_correction_and_rejection_mask` without its off-policy diagnostics (those are
`stppo.algos.breakdown.sampler_mismatch`): the weights (or None), the kept agent tokens and the
IS / RS metrics. `rc` is the spec's `RolloutCorrection` (`stppo.algos.spec`), whose fields are
verl's. Where it acts: decoupled mode once per step from the recomputed π_old (the trainer's
batch preparation, before the advantages); bypass mode in each minibatch's loss from π_θ
(`stppo.train.rollout_corr`, and the verl plugin's loss).
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import torch

from stppo.algos.rollout_corr.presets import (FIELDS, IS_LEVELS, LOSS_TYPES, REJECTION_OPTIONS,
                                              ROLLOUT_CORRECTIONS, SAFETY_BOUND, parse_is_threshold,
                                              parse_rs_thresholds, resolve)
from stppo.algos.rollout_corr.rejection import rejection_mask
from stppo.algos.rollout_corr.reinforce import reinforce_loss
from stppo.algos.rollout_corr.weights import Reduce, is_weights, masked_mean, masked_sum

# The C of the token IS statistics logged as a diagnostic when a run's correction applies no IS
# weights (verl's default rollout_is_threshold).
DIAGNOSTIC_IS_THRESHOLD = 2.0


class Corrected(NamedTuple):
    weights: Optional[torch.Tensor]  # (N, T) ω, detached, 0 off agent tokens; None: no IS weights
    loss_mask: torch.Tensor  # (N, T) bool: the agent tokens rejection sampling keeps
    metrics: dict  # detached 0-d float64 tensors under verl's rollout_corr/* names


@torch.no_grad()
def rollout_correction(train_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor,
                       loss_mask: torch.Tensor, rc: Any, reduce: Reduce = None) -> Corrected:
    """IS weights and rejection mask of correction `rc` (fields rollout_is, rollout_is_threshold,
    rollout_is_batch_normalize, rollout_rs, rollout_rs_threshold) from r = log π_train −
    log π_rollout (N, T) on agent tokens `loss_mask` (bool), computed in float64; the weights come
    back in train_log_probs' dtype. `reduce`: a sum over data-parallel ranks for the batch
    normaliser (verl's `distributed_masked_mean`)."""
    if train_log_probs.shape != rollout_log_probs.shape or train_log_probs.shape != loss_mask.shape:
        raise ValueError(f"train_log_probs, rollout_log_probs and loss_mask must have one shape "
                         f"(N, T); got {tuple(train_log_probs.shape)}, "
                         f"{tuple(rollout_log_probs.shape)}, {tuple(loss_mask.shape)}")
    r = train_log_probs.double() - rollout_log_probs.double()  # (N, T)
    weights, kept, metrics = None, loss_mask, {}
    if rc.rollout_is is not None:
        weights, m = is_weights(r, loss_mask, rc.rollout_is, rc.rollout_is_threshold,
                                rc.rollout_is_batch_normalize, reduce)
        weights = weights.to(train_log_probs.dtype)
        metrics.update(m)
    if rc.rollout_rs is not None:
        kept, m = rejection_mask(r, loss_mask, rc.rollout_rs, rc.rollout_rs_threshold)
        metrics.update(m)
    return Corrected(weights, kept, metrics)


__all__ = ["Corrected", "DIAGNOSTIC_IS_THRESHOLD", "FIELDS", "IS_LEVELS", "LOSS_TYPES",
           "REJECTION_OPTIONS", "ROLLOUT_CORRECTIONS", "SAFETY_BOUND", "is_weights", "masked_mean",
           "masked_sum", "parse_is_threshold", "parse_rs_thresholds", "reinforce_loss",
           "rejection_mask", "resolve", "rollout_correction"]
