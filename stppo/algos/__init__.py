"""stppo.algos — every equation of docs/design.md §2 as pure torch functions (no I/O, no .item()).

Entry point: `policy_loss(log_probs, old_log_probs, advantages, loss_mask, turn_ids, spec)` →
loss, metrics, and per token ρ and κ; `spec` is a `LossSpec`, built from a preset
(`PRESETS[name].spec(...)`) or a run's config. Registries (unknown names list the valid ones):
RATIO_LEVELS, LOSS_AGGS, CLIP_BIAS_KINDS, LOSS_MODES, ROLLOUT_CORRECTIONS, ADVANTAGE_ESTIMATORS,
KL_ESTIMATORS, PRESETS.
"""

from stppo.algos.advantages import (ADVANTAGE_ESTIMATORS, compute_advantages, gae, grpo_advantages,
                                    masked_whiten, reinforce_pp_advantages, rloo_advantages,
                                    turn_gae)
from stppo.algos.aggregation import LOSS_AGGS, agg_denoms, agg_loss, agg_weights
from stppo.algos.clip_bias import (CLIP_BIAS_KINDS, DEFAULT_TAU, ClipBias, clip_bias_grad_norm,
                                   clip_bias_norm, clip_bias_term, clip_triggered_ratio,
                                   pg_loss_norm, resolve_clip_bias, sequence_clip_bias_norm)
from stppo.algos.contract import LossInputs, LossMode, loss_mode
from stppo.algos.modes import LOSS_MODES, resolve_options
from stppo.algos.breakdown import group_signal_fractions, sampler_mismatch, turn_breakdown
from stppo.algos.baselines.bapo import bapo_schedule, positive_share
from stppo.algos.baselines.sapo import sapo_gate
from stppo.algos.dapo import groups_with_signal, overlong_penalty
from stppo.algos.entropy import entropy_from_logits, token_log_probs
from stppo.algos.kl import KL_ESTIMATORS, kl_in_reward, kl_loss, kl_penalty
from stppo.algos.policy import LossOutput, policy_loss
from stppo.algos.presets import PRESETS, Preset, register_preset
from stppo.algos.spec import DEFAULT_LOSS_AGG, LossSpec
from stppo.algos.ratios import (RATIO_LEVELS, importance_ratio, log_ratio, sequence_ratio,
                                token_ratio, turn_ratio)
from stppo.algos.rollout_corr import (ROLLOUT_CORRECTIONS, Corrected, RolloutCorrection,
                                      is_weights, rejection_mask, rollout_correction)
from stppo.algos.rollout_corr.reinforce import reinforce_loss
from stppo.registry import Registry, UnknownNameError
from stppo.algos.surrogate import Surrogate, SurrogateParts, clipped_surrogate, surrogate_parts
from stppo.algos.value import explained_variance, value_loss

__all__ = [
    "ADVANTAGE_ESTIMATORS", "CLIP_BIAS_KINDS", "ClipBias", "DEFAULT_LOSS_AGG", "DEFAULT_TAU",
    "KL_ESTIMATORS", "LOSS_AGGS", "LOSS_MODES", "LossInputs", "LossMode", "LossOutput", "LossSpec", "PRESETS",
    "Preset", "RolloutCorrection", "Corrected",
    "RATIO_LEVELS", "ROLLOUT_CORRECTIONS", "Registry", "Surrogate", "SurrogateParts",
    "UnknownNameError", "agg_denoms", "agg_loss", "agg_weights", "bapo_schedule",
    "clip_bias_grad_norm", "clip_bias_norm", "clip_bias_term", "clip_triggered_ratio", "clipped_surrogate", "compute_advantages", "entropy_from_logits",
    "explained_variance", "gae", "group_signal_fractions", "groups_with_signal", "grpo_advantages",
    "importance_ratio", "is_weights", "kl_in_reward", "kl_loss", "kl_penalty", "log_ratio", "loss_mode", "masked_whiten",
    "overlong_penalty", "pg_loss_norm", "policy_loss", "positive_share", "register_preset",
    "reinforce_loss", "reinforce_pp_advantages", "rejection_mask", "resolve_clip_bias", "resolve_options", "rloo_advantages", "rollout_correction",
    "sampler_mismatch", "sapo_gate", "sequence_clip_bias_norm", "sequence_ratio",
    "surrogate_parts", "token_log_probs", "token_ratio", "turn_breakdown",
    "turn_gae", "turn_ratio", "value_loss",
]
