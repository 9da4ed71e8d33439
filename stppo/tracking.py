"""MLflow tracking for stppo runs, and the metric keys / run tags of DESIGN.md §4.

The constants below are the one place these strings are spelled (CONVENTIONS.md 5): the trainer,
sweeps, analysis and the dashboard import them. This module is torch-free and imports mlflow
lazily, so `analysis/` and `dashboard/` can use the constants cheaply.
Every metric is reduced the same way over minibatches: mean, except `*_max` keys (max).
"""

from __future__ import annotations

# --- actor -------------------------------------------------------------------------------------
PG_LOSS = "actor/pg_loss"
PG_LOSS_NORM = "actor/pg_loss_norm"
PG_CLIPFRAC = "actor/pg_clipfrac"
PG_CLIPFRAC_HIGH = "actor/pg_clipfrac_high"
PG_CLIPFRAC_LOW = "actor/pg_clipfrac_low"
PPO_KL = "actor/ppo_kl"
KL_REF = "actor/kl_ref"
ENTROPY = "actor/entropy"
GRAD_NORM = "actor/grad_norm"
GRAD_NORM_MAX = "actor/grad_norm_max"
LR = "actor/lr"
RATIO_MEAN = "actor/ratio_mean"
RATIO_MAX = "actor/ratio_max"
SKIPPED_STEPS = "actor/skipped_steps"

# --- clipping bias (the paper's diagnostic and its corrections) -------------------------------
CLIP_BIAS_NORM = "clip_bias/norm"
CLIP_BIAS_NORM_MAX = "clip_bias/norm_max"
CLIP_BIAS_GRAD_NORM = "clip_bias/grad_norm"
CLIP_BIAS_SCALE = "clip_bias/scale"
CLIP_BIAS_TRIGGERED = "clip_bias/triggered"

# --- critic / advantages -----------------------------------------------------------------------
VF_LOSS = "critic/vf_loss"
VF_CLIPFRAC = "critic/vf_clipfrac"
CRITIC_GRAD_NORM = "critic/grad_norm"
VF_EXPLAINED_VAR = "critic/vf_explained_var"
ADV_MEAN = "critic/advantages_mean"
ADV_STD = "critic/advantages_std"
ADV_MAX = "critic/advantages_max"
ADV_MIN = "critic/advantages_min"
RETURNS_MEAN = "critic/returns_mean"
VALUES_MEAN = "critic/values_mean"

# --- environment -------------------------------------------------------------------------------
SUCCESS_RATE = "env/success_rate"
VALID_ACTION_RATIO = "env/valid_action_ratio"
NUM_TURNS_MEAN = "env/num_turns_mean"
NUM_SEARCHES_MEAN = "env/num_searches_mean"
FINISH_RATIO = "env/finish_ratio"
RESPONSE_LENGTH_MEAN = "response_length/mean"
RESPONSE_LENGTH_CLIP_RATIO = "response_length/clip_ratio"
VAL_SUCCESS_RATE = "val/success_rate"

# --- performance -------------------------------------------------------------------------------
STEP_TIME = "perf/step_time_s"
ROLLOUT_TIME = "perf/rollout_time_s"
UPDATE_TIME = "perf/update_time_s"
TOKENS_PER_S = "perf/tokens_per_s"

# --- collapse ----------------------------------------------------------------------------------
COLLAPSE_DETECTED = "collapse/detected"
COLLAPSE_STEP = "collapse/step"

ALL_METRICS: tuple[str, ...] = tuple(
    v for k, v in dict(globals()).items() if k.isupper() and isinstance(v, str) and "/" in v
)

# Keys reduced by max (not mean) over minibatches, ranks and steps-within-a-step.
MAX_REDUCED: frozenset[str] = frozenset(k for k in ALL_METRICS if k.endswith("_max"))

# --- run tags ----------------------------------------------------------------------------------
TAG_ALGO = "algo"
TAG_MODEL = "model"
TAG_TASK = "task"
TAG_SEED = "seed"
TAG_SWEEP = "sweep"
TAG_GIT_COMMIT = "git_commit"
TAG_TRIAL = "trial"
TAG_STUDY = "study"
RUN_TAGS: tuple[str, ...] = (TAG_ALGO, TAG_MODEL, TAG_TASK, TAG_SEED, TAG_SWEEP, TAG_GIT_COMMIT)


def reduce_name(key: str) -> str:
    """'max' for `*_max` keys, 'mean' otherwise (CONVENTIONS.md 5)."""
    return "max" if key in MAX_REDUCED else "mean"
