"""The metric keys and run tags of docs/design.md §4.

The constants below are the one place these strings are spelled: the trainer,
sweeps, analysis and the dashboard import them. This module imports neither torch nor mlflow, so
`analysis/` and `dashboard/` can use the constants cheaply; the MLflow logging is `stppo.tracker`.
Every metric is reduced the same way over minibatches: mean, except `*_max` keys (max).
"""

from __future__ import annotations

# --- actor -------------------------------------------------------------------------------------
PG_LOSS = "actor/pg_loss"
PG_LOSS_NORM = "actor/pg_loss_norm"
PG_CLIPFRAC = "actor/pg_clipfrac"
PG_CLIPFRAC_HIGH = "actor/pg_clipfrac_high"
PG_CLIPFRAC_LOW = "actor/pg_clipfrac_low"
# verl's name (its losses and stppo's verl plugin): share of agent tokens where the dual clip
# binds (A < 0, ρ > c) — not the lower trust-region clip, which is PG_CLIPFRAC_LOW.
PG_CLIPFRAC_LOWER = "actor/pg_clipfrac_lower"
PPO_KL = "actor/ppo_kl"
KL_REF = "actor/kl_ref"
# how far a step's update moved the policy: KL(π before ‖ π after) by k3 on the agent tokens of the
# first trajectory of each group (stppo.train.loop.step_kl); the KL-matched control reads it
STEP_KL = "actor/step_kl"
ENTROPY = "actor/entropy"
GRAD_NORM = "actor/grad_norm"
GRAD_NORM_MAX = "actor/grad_norm_max"
LR = "actor/lr"
RATIO_MEAN = "actor/ratio_mean"
RATIO_MAX = "actor/ratio_max"
SKIPPED_STEPS = "actor/skipped_steps"

# --- clipping bias (the paper's diagnostic and its scale) -------------------------------
CLIP_BIAS_NORM = "clip_bias/norm"
CLIP_BIAS_NORM_MAX = "clip_bias/norm_max"
CLIP_BIAS_GRAD_NORM = "clip_bias/grad_norm"
CLIP_BIAS_SCALE = "clip_bias/scale"
CLIP_BIAS_TRIGGERED = "clip_bias/triggered"

# --- baselines' own diagnostics (stppo.algos.baselines; docs/design.md §2) ---------------------------
COV_SELECTED_FRAC = "actor/cov_selected_frac"  # clip_cov: tokens detached; kl_cov: tokens penalised
BAPO_CLIP_LOW = "actor/bapo_clip_low"  # the adaptive ratio bounds c_low, c_high BAPO chose
BAPO_CLIP_HIGH = "actor/bapo_clip_high"
BAPO_POS_SHARE = "actor/bapo_pos_share"  # ρ: positive-advantage tokens' share of the loss
SSPO_CLIP_SCALE_STD = "actor/sspo_clip_scale_std"  # SSPO: token std of the entropy clip scale w
SSPO_SUBSENTENCE_LENGTH = "actor/sspo_subsentence_length_mean"  # SSPO: agent tokens per subsentence

# --- DAPO's dynamic sampling and overlong reward shaping (stppo.train.dapo) --------------------
DS_ROLLOUTS = "dynamic_sampling/rollouts"  # rollout calls this step (1 = no refill needed)
DS_GROUPS_ROLLED = "dynamic_sampling/groups_rolled_out"
DS_GROUPS_DROPPED = "dynamic_sampling/groups_dropped"  # groups whose rewards all agree
DS_GROUPS_FILLED = "dynamic_sampling/filler_groups"  # dropped groups put back: refills ran out
OVERLONG_PENALTY_MEAN = "overlong/penalty_mean"
OVERLONG_FRAC = "overlong/penalised_frac"

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
# critic warm start (trainer.critic_warmstart), logged once at step 0: held-out explained variance
# of the critic before and after its fit to the warm-started policy's Monte-Carlo returns
CRITIC_WS_EV_BEFORE = "critic_warmstart/explained_var_before"
CRITIC_WS_EV_AFTER = "critic_warmstart/explained_var_after"
CRITIC_WS_LOSS = "critic_warmstart/value_loss"

# --- environment -------------------------------------------------------------------------------
SUCCESS_RATE = "env/success_rate"
VALID_ACTION_RATIO = "env/valid_action_ratio"
NUM_TURNS_MEAN = "env/num_turns_mean"
NUM_SEARCHES_MEAN = "env/num_searches_mean"
FINISH_RATIO = "env/finish_ratio"
RESPONSE_LENGTH_MEAN = "response_length/mean"
RESPONSE_LENGTH_CLIP_RATIO = "response_length/clip_ratio"
VAL_SUCCESS_RATE = "val/success_rate"
# the live policy's greedy success on the first trainer.collapse.questions validation questions,
# every trainer.collapse.every steps and at step 0: what the collapse rule reads (stppo.diagnostics)
VAL_LIVE_SUCCESS_RATE = "val/live_success_rate"

# --- performance -------------------------------------------------------------------------------
STEP_TIME = "perf/step_time_s"
ROLLOUT_TIME = "perf/rollout_time_s"
UPDATE_TIME = "perf/update_time_s"
TOKENS_PER_S = "perf/tokens_per_s"
GPU_PEAK_MEM = "perf/gpu_peak_mem_gb"  # CUDA runs: peak memory allocated by this process so far
LIVE_CHECK_TIME = "perf/live_check_time_s"  # the live check's greedy rollouts, at the steps it runs

# --- collapse ----------------------------------------------------------------------------------
COLLAPSE_DETECTED = "collapse/detected"
COLLAPSE_STEP = "collapse/step"
COLLAPSE_ROLLBACKS = "collapse/rollbacks"  # cumulative count of rollbacks (trainer.on_alarm=rollback)

# --- groups without signal (group presets: every reward of a group equal) -----------------------
ZERO_STD_GROUP_FRAC = "env/zero_std_group_frac"
ALL_ZERO_GROUP_FRAC = "env/all_zero_group_frac"
ALL_ONE_GROUP_FRAC = "env/all_one_group_frac"

# --- sampler vs trainer log-probs (verl's rollout_corr names; abs_diff_* are stppo's) -----------
# Logged every step from the rollout's sampling log-probs and the trainer's (π_old; π_θ in bypass
# mode) by stppo.algos.breakdown.sampler_mismatch, and by the run's rollout correction
# (algo.rollout_correction, stppo.algos.rollout_corr): the rollout_is_* statistics of its IS
# weights — or, when it applies none, of the token IS weights min(π_old / π_rollout, 2) as a
# diagnostic — and the rollout_rs_* statistics of its rejection sampling.
ROLLOUT_CORR_KL = "rollout_corr/kl"  # mean (log p_rollout - log p_old)
ROLLOUT_CORR_K3_KL = "rollout_corr/k3_kl"
ROLLOUT_CORR_LOG_PPL_DIFF = "rollout_corr/log_ppl_diff"
ROLLOUT_CORR_ABS_DIFF_MAX = "rollout_corr/abs_diff_max"
ROLLOUT_CORR_ABS_DIFF_MEAN = "rollout_corr/abs_diff_mean"
ROLLOUT_IS_MEAN = "rollout_corr/rollout_is_mean"
ROLLOUT_IS_MAX = "rollout_corr/rollout_is_max"
ROLLOUT_IS_ESS = "rollout_corr/rollout_is_eff_sample_size"
ROLLOUT_IS_FRACTION_HIGH = "rollout_corr/rollout_is_ratio_fraction_high"
ROLLOUT_IS_FRACTION_LOW = "rollout_corr/rollout_is_ratio_fraction_low"
# the rest of verl's compute_is_metrics (rollout_corr_helper): the weights' min and std, the
# per-sequence mean weights' statistics, IcePop's out-of-bounds share, the batch normaliser
ROLLOUT_IS_MIN = "rollout_corr/rollout_is_min"
ROLLOUT_IS_STD = "rollout_corr/rollout_is_std"
ROLLOUT_IS_SEQ_MEAN = "rollout_corr/rollout_is_seq_mean"
ROLLOUT_IS_SEQ_STD = "rollout_corr/rollout_is_seq_std"
ROLLOUT_IS_SEQ_MAX = "rollout_corr/rollout_is_seq_max"
ROLLOUT_IS_SEQ_MIN = "rollout_corr/rollout_is_seq_min"
ROLLOUT_IS_SEQ_MAX_DEVIATION = "rollout_corr/rollout_is_seq_max_deviation"
ROLLOUT_IS_SEQ_FRACTION_HIGH = "rollout_corr/rollout_is_seq_fraction_high"
ROLLOUT_IS_SEQ_FRACTION_LOW = "rollout_corr/rollout_is_seq_fraction_low"
ROLLOUT_IS_OOB_RATIO = "rollout_corr/rollout_is_oob_ratio"  # IcePop: share of weights zeroed
ROLLOUT_IS_BATCH_NORM_FACTOR = "rollout_corr/rollout_is_batch_norm_factor"
# rejection sampling (verl's compute_rollout_rejection_mask): the share of agent tokens / of
# trajectories the combined mask rejects; per option `rollout_rs_key(option, stat)`
ROLLOUT_RS_MASKED_FRACTION = "rollout_corr/rollout_rs_masked_fraction"
ROLLOUT_RS_SEQ_MASKED_FRACTION = "rollout_corr/rollout_rs_seq_masked_fraction"
ROLLOUT_RS_OPTIONS: tuple[str, ...] = ("token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2",
                                       "seq_sum_k3", "seq_mean_k1", "seq_mean_k2", "seq_mean_k3",
                                       "seq_max_k2", "seq_max_k3")
ROLLOUT_RS_STATS: tuple[str, ...] = ("mean", "max", "min", "fraction_high", "fraction_low", "std",
                                     "seq_mean", "seq_std", "seq_max", "seq_min", "seq_max_deviation",
                                     "seq_fraction_high", "seq_fraction_low", "masked_fraction",
                                     "seq_masked_fraction")
# verl's compute_offpolicy_metrics (rollout_corr_helper): perplexities of the trainer's π_old and
# the sampler on agent tokens, their ratio, and χ² divergences of the ratio π_old / π_rollout.
ROLLOUT_CORR_TRAINING_PPL = "rollout_corr/training_ppl"
ROLLOUT_CORR_TRAINING_LOG_PPL = "rollout_corr/training_log_ppl"
ROLLOUT_CORR_ROLLOUT_PPL = "rollout_corr/rollout_ppl"
ROLLOUT_CORR_ROLLOUT_LOG_PPL = "rollout_corr/rollout_log_ppl"
ROLLOUT_CORR_LOG_PPL_ABS_DIFF = "rollout_corr/log_ppl_abs_diff"
ROLLOUT_CORR_LOG_PPL_DIFF_MAX = "rollout_corr/log_ppl_diff_max"
ROLLOUT_CORR_LOG_PPL_DIFF_MIN = "rollout_corr/log_ppl_diff_min"
ROLLOUT_CORR_PPL_RATIO = "rollout_corr/ppl_ratio"
ROLLOUT_CORR_CHI2_TOKEN = "rollout_corr/chi2_token"
ROLLOUT_CORR_CHI2_SEQ = "rollout_corr/chi2_seq"

# --- stale rollouts (trainer.offpolicy; docs/design.md §3) ---------------------------------------
# The lag (in training steps) of the policy that sampled the step's batch — the batch of step t
# was sampled by the policy as it was after step t − lag — its mean and max over the batch's
# groups, and KL(π_stale ‖ π_current) on agent tokens (k1: mean log π_stale − log π_old).
OFFPOLICY_LAG_MEAN = "offpolicy/lag_mean"
OFFPOLICY_LAG_MAX = "offpolicy/lag_max"
OFFPOLICY_KL_TO_CURRENT = "offpolicy/kl_to_current"

# --- per turn: `turn/k{k}/{name}` for k = 0 .. max_turns-1 ------------------------------------
TURN_PREFIX = "turn/k"
# rollout_kl: mean over the turn's agent tokens of log π_rollout − log π_old (runs whose batch has
# the sampler's log-probs)
TURN_METRICS: tuple[str, ...] = ("pg_clipfrac", "ratio_mean", "ratio_max", "adv_mean", "ppo_kl", "entropy",
                                 "tokens", "rollout_kl")

# --- online alarms (stppo.alarms): `alarm/<indicator>` = 1.0 at the step the alarm fires ----------
ALARM_PREFIX = "alarm/"

# --- sampled trajectories: MLflow table artifacts `samples/step_{step:06d}.json` ----------------
SAMPLES_DIR = "samples"
TAG_SAMPLES_STEPS = "samples_steps"  # run tag: the steps written, comma-separated
SAMPLE_COLUMNS: tuple[str, ...] = ("step", "sample", "question", "answers", "reward", "segment", "role", "turn",
                                   "text", "action", "ratio_mean", "ratio_max", "advantage_mean", "collapse_step")
SAMPLE_ROLES: tuple[str, ...] = ("prompt", "agent", "observation")
SAMPLE_ACTIONS: tuple[str, ...] = ("search", "answer", "invalid", "")


def turn_key(k: int, name: str) -> str:
    """The key of per-turn metric `name` (one of TURN_METRICS) at turn index k: `turn/k{k}/{name}`."""
    if name not in TURN_METRICS:
        raise ValueError(f"unknown per-turn metric {name!r}; valid: {', '.join(TURN_METRICS)}")
    if int(k) < 0:
        raise ValueError(f"turn index must be >= 0, got {k}")
    return f"{TURN_PREFIX}{int(k)}/{name}"


def parse_turn_key(key: str) -> tuple[int, str] | None:
    """(k, name) of a `turn/k{k}/{name}` key, None for any other key."""
    if not key.startswith(TURN_PREFIX):
        return None
    head, _, name = key[len(TURN_PREFIX):].partition("/")
    if not head.isdigit() or name not in TURN_METRICS:
        return None
    return int(head), name


def rollout_rs_key(option: str, stat: str) -> str:
    """verl's key of rejection-sampling statistic `stat` (ROLLOUT_RS_STATS) of option `option`
    (ROLLOUT_RS_OPTIONS): `rollout_corr/rollout_rs_{option}_{stat}`."""
    if option not in ROLLOUT_RS_OPTIONS:
        raise ValueError(f"unknown rejection option {option!r}; valid: {', '.join(ROLLOUT_RS_OPTIONS)}")
    if stat not in ROLLOUT_RS_STATS:
        raise ValueError(f"unknown rejection statistic {stat!r}; valid: {', '.join(ROLLOUT_RS_STATS)}")
    return f"rollout_corr/rollout_rs_{option}_{stat}"


def alarm_key(indicator: str) -> str:
    """The key logged (1.0) at the step an online alarm of `indicator` fires: `alarm/<indicator>`."""
    return f"{ALARM_PREFIX}{indicator}"


def samples_artifact(step: int) -> str:
    """The run-relative path of the sampled trajectories logged at `step`."""
    return f"{SAMPLES_DIR}/step_{int(step):06d}.json"


ALL_METRICS: tuple[str, ...] = tuple(
    v for k, v in dict(globals()).items()
    if k.isupper() and isinstance(v, str) and "/" in v and not k.endswith("_PREFIX")
) + tuple(rollout_rs_key(o, s) for o in ROLLOUT_RS_OPTIONS for s in ROLLOUT_RS_STATS)

# Keys reduced by max / min (not mean) over minibatches and ranks.
MAX_REDUCED: frozenset[str] = frozenset(k for k in ALL_METRICS if k.endswith("_max"))
MIN_REDUCED: frozenset[str] = frozenset(k for k in ALL_METRICS if k.endswith("_min"))

# --- run tags ----------------------------------------------------------------------------------
TAG_ALGO = "algo"
TAG_MODEL = "model"
TAG_TASK = "task"
TAG_SEED = "seed"
TAG_SWEEP = "sweep"
TAG_GIT_COMMIT = "git_commit"
TAG_TRIAL = "trial"
TAG_STUDY = "study"
TAG_BACKEND = "backend"  # 'verl' on runs trained by verl (stppo.integrations.verl); absent: own trainer
TAG_HOST = "host"  # the device the run trained on: 'cpu:AVX512' (torch's CPU kernels), 'cuda:NVIDIA H200'
TAG_STOPPED = "stopped"  # why a run was stopped early: 'collapse at step S …' or 'alarm NAME at step S'
RUN_TAGS: tuple[str, ...] = (TAG_ALGO, TAG_MODEL, TAG_TASK, TAG_SEED, TAG_SWEEP, TAG_GIT_COMMIT, TAG_HOST)


def reduce_name(key: str) -> str:
    """'max' for `*_max` keys, 'min' for `*_min` keys, 'mean' otherwise;
    per-turn keys by their name (`turn/k2/ratio_max` -> 'max')."""
    turn = parse_turn_key(key)
    if turn is not None:
        return "max" if turn[1].endswith("_max") else "mean"
    return "max" if key in MAX_REDUCED else "min" if key in MIN_REDUCED else "mean"


def known_metric(key: str) -> bool:
    """A key of docs/design.md §4: one of ALL_METRICS, a per-turn key or an alarm key."""
    return key in ALL_METRICS or parse_turn_key(key) is not None or key.startswith(ALARM_PREFIX)
