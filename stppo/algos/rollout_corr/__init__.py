"""Sampler/trainer mismatch corrections (docs/design.md §2, "Rollout correction"): verl 0.9.1's
rollout correction (`verl/trainer/ppo/rollout_corr_helper.py`, `RolloutCorrectionConfig`) as pure
torch functions, equal to verl's on the same tensors (tests/verl/test_rollout_correction_vs_verl.py).

    presets     the names (`ROLLOUT_CORRECTIONS`: none and verl's 18 classmethods) → verl's fields
    correction  `RolloutCorrection`: a run's correction, its mode (none | decoupled | bypass) and
                `apply` — weights, kept tokens and metrics of one batch
    weights     IS weights ω: token / sequence level, truncation (TIS) or IcePop, batch normalisation
    rejection   rejection masks: token_k*, seq_sum_k*, seq_mean_k*, seq_max_k* with their thresholds
    reinforce   the bypass-mode REINFORCE loss with explicit IS weights: the loss mode `reinforce`
                (registered by `stppo.algos.modes` with the others)

Where a correction acts: decoupled mode once per step from the recomputed π_old (the trainer's
batch preparation, before the advantages); bypass mode in each minibatch's loss from π_θ
(`stppo.train.rollout_corr`, and the verl plugin's loss).
"""

from __future__ import annotations

from stppo.algos.rollout_corr.presets import (FIELDS, IS_LEVELS, LOSS_TYPES, REJECTION_OPTIONS,
                                              ROLLOUT_CORRECTIONS, SAFETY_BOUND, parse_is_threshold,
                                              parse_rs_thresholds, resolve)
from stppo.algos.rollout_corr.rejection import rejection_mask
from stppo.algos.rollout_corr.weights import Reduce, is_weights, masked_mean, masked_sum
from stppo.algos.rollout_corr.correction import (DIAGNOSTIC_IS_THRESHOLD, MODES, Corrected,
                                                 RolloutCorrection, rollout_correction)

__all__ = ["Corrected", "DIAGNOSTIC_IS_THRESHOLD", "FIELDS", "IS_LEVELS", "LOSS_TYPES", "MODES",
           "REJECTION_OPTIONS", "ROLLOUT_CORRECTIONS", "Reduce", "RolloutCorrection",
           "SAFETY_BOUND", "is_weights", "masked_mean", "masked_sum", "parse_is_threshold",
           "parse_rs_thresholds", "rejection_mask", "resolve", "rollout_correction"]
