"""stppo's composed config → the overrides of `python -m verl.trainer.main_ppo` (verl 0.9.1's
`ppo_trainer` config), or of verl's off-policy trainers for stale rollouts (`entry_module`).
Pure: no verl import, nothing started; `launcher.py` runs the command.

What maps to what (one line per stppo setting; anything not listed has no verl counterpart and
is rejected by `check_translatable` when it would change the run):

  algo (the run's LossSpec)  policy_loss.loss_mode=stppo_<preset> with the plugin's config class
                             (`_target_`) carrying the whole spec (policy_loss.spec: ratio level,
                             clip-bias scale, loss mode and options, …) and, for a plain-folder
                             plugin's preset, the module that registers it (policy_loss.plugin);
                             the advantage →
                             algorithm.adv_estimator (tir_optimal_token_baseline also →
                             actor.calculate_sum_pi_squared, unfused kernels, trainer.use_v1=false),
                             the critic → critic.enable; a loss mode that reads subsentences
                             (sspo) is rejected
  algo.clip_low/high         actor.clip_ratio_low/high        (dual_clip → actor.clip_ratio_c)
  loss options of dppo_*/dro clip_ratio_c → actor.clip_ratio_c, beta → policy_loss.dro_beta: the
                             keys verl's own dppo_tv, dppo_kl, dro read (VERL_LOSS_MODES)
  algo.loss_agg              actor.loss_agg_mode
  algo.rollout_correction    algorithm.rollout_correction.<field> for verl's seven fields (rollout_is,
                             rollout_is_threshold, rollout_is_batch_normalize, rollout_rs,
                             rollout_rs_threshold, bypass_mode, loss_type) of the name and its options
                             (none: verl's default, the mismatch metrics only); the spec carries it too
  algo.dynamic_sampling      algorithm.filter_groups (enable, metric=reward, max_num_gen_batches)
  algo.overlong              reward.reward_manager.name=dapo, reward.reward_kwargs.overlong_buffer_cfg
  algo.kl (coef, estimator)  in_reward: algorithm.use_kl_in_reward, kl_penalty, kl_ctrl.kl_coef;
                             else actor.use_kl_loss, kl_loss_coef, kl_loss_type
  algo.gamma/gae_lambda      algorithm.gamma/lam
  algo.entropy_coef, vf_clip actor.entropy_coeff, critic.cliprange_value
  trainer.actor_lr/critic_lr actor.optim.lr / critic.optim.lr (+ weight_decay, max_grad_norm → optim.clip_grad)
  trainer.questions_per_step data.train_batch_size; group_size → rollout.n
  trainer.minibatch_size     actor.ppo_mini_batch_size = minibatch_size / group_size (verl counts prompts)
  trainer.ppo_epochs, critic_warmup, total_steps, val_every and collapse.every (test_freq:
                             `test_freq`), save_every, val_questions
  task.max_turns             rollout.multi_turn.max_assistant_turns
  trainer.rollout            temperature, top_p; max_total_tokens = data.max_prompt_length
                             + data.max_response_length (`verl_lengths`)
  diagnostics.per_turn       policy_loss.max_turns = task.max_turns (0 when off)
  model                      actor_rollout_ref.model.path = critic.model.path; dtype; checkpointing
  backend                    trainer.nnodes, n_gpus_per_node, rollout engine, TP, micro-batches
  tracking                   trainer.logger=[console,mlflow], project = tracking.experiment
  (the trainer)              trainer.use_v1=false: verl's legacy `RayPPOTrainer` (`uses_v1`); true
                             only for a bypass-mode rollout correction, or when backend.overrides
                             says so (the launcher checks that the chosen trainer's and rollout
                             engine's packages are there before Ray starts)
  trainer.offpolicy.lag      1: verl.experimental.one_step_off_policy.main_ppo; ≥ 2:
                             verl.experimental.fully_async_policy.fully_async_main with
                             async_training.staleness_threshold=lag, trigger_parameter_sync_step=1,
                             partial_rollout=false, require_batches = questions_per_step /
                             ppo_mini_batch_size; both with
                             rollout_correction.bypass_mode=false (stppo's loss, π_old recomputed),
                             hybrid_engine=false and backend.rollout_gpus_per_node GPUs of each
                             node for the rollout (docs/design.md §8.2); lag_mode=uniform: rejected
"""

from __future__ import annotations

import math
import re
import shlex
from dataclasses import dataclass
from typing import Any, Mapping

from stppo.algos.rollout_corr.presets import FIELDS as ROLLOUT_CORRECTION_FIELDS
from stppo.config import Config
from stppo.integrations.verl import POLICY_LOSS_TARGET as LOSS_CONFIG_TARGET
from stppo.integrations.verl import loss_mode

# verl's entry modules: the synchronous trainer, and its off-policy trainers (stale rollouts)
ENTRY_SYNC = "verl.trainer.main_ppo"
ENTRY_ONE_STEP = "verl.experimental.one_step_off_policy.main_ppo"
ENTRY_FULLY_ASYNC = "verl.experimental.fully_async_policy.fully_async_main"
OFFPOLICY_ENTRIES = (ENTRY_ONE_STEP, ENTRY_FULLY_ASYNC)
# The one-step trainer's config names `file://verl/trainer/config` as its search path, which only
# resolves from a verl source checkout's root; an installed verl needs the package path.
VERL_CONFIG_SEARCHPATH = ["pkg://verl.trainer.config"]

GRAD_ESTIMATOR_ERROR = ("the 'grad' estimator needs the policy parameters, which verl does not "
                        "pass to a policy loss; use algo.clip_bias.estimator=token with backend=verl")

# --- names shared with the policy-loss plugin (stppo/integrations/verl/{plugin,config}.py):
# loss_mode(preset) = stppo_<preset>, LOSS_CONFIG_TARGET its PolicyLossConfig subclass
LOSS_FIELDS = ("max_turns", "spec", "plugin")  # the fields of that PolicyLossConfig subclass the launcher sets
# verl's losses (and the stppo_* plugin, which follows them) always apply the dual clip with
# `clip_ratio_c` (default 3); stppo's `algo.dual_clip=null` means none, i.e. a bound never reached.
NO_DUAL_CLIP = 1e9
# --- names of this package's verl-side modules -------------------------------------------------
REWARD_PATH = "pkg://stppo.integrations.verl.reward"
REWARD_NAME = "compute_score"
TOOL_FORMAT = "search_r1"  # the ToolParser registered by stppo.integrations.verl.tool
AGENT_LOOP = "search_r1_agent"  # the tool agent loop with Search-R1's stop tags (tool.py)

# Loss modes whose settings verl 0.9.1 reads from its own keys, each mode with verl's loss of the
# same name: a run still trains with stppo_<preset> (the same numbers, tests/verl, plus stppo's
# diagnostics), and its actor config is also the one verl's own loss reads (`_verl_loss_knobs`):
# swapping policy_loss.loss_mode for verl's name changes neither the loss nor its gradient.
VERL_LOSS_MODES = ("dppo_tv", "dppo_kl", "dro")
ADV_ESTIMATORS = {"gae": "gae", "grpo": "grpo", "rloo": "rloo", "reinforce_pp": "reinforce_plus_plus",
                  "tir_optimal_token_baseline": "tir_optimal_token_baseline"}
# verl 0.9.1 computes Σπ² (the optimal token baseline's input) only with the actor's
# calculate_sum_pi_squared, unfused kernels, and in its legacy trainer: the v1 trainer
# (trainer/ppo/v1/trainer_base.py) neither asks its workers for it in `_compute_old_log_prob` nor
# reads it in `_compute_advantage`, so `compute_advantage` fails its "sum_pi_squared" assert.
SUM_PI_SQUARED = {"actor_rollout_ref.actor.calculate_sum_pi_squared": True,
                  "actor_rollout_ref.model.use_fused_kernels": False, "trainer.use_v1": False}
# verl 0.9.1's `main_ppo` runs its v1 trainer (`trainer.use_v1`, verl's default) or its legacy
# `RayPPOTrainer` (main_ppo_v0). The v1 trainer imports the package transfer_queue — in verl's
# `verl-core` extra (pulled by `verl[vllm]`, `verl[sglang]`), not in a plain `pip install verl` —
# and starts a TransferQueue controller and storage-unit actors; the legacy trainer needs
# neither. stppo runs the legacy trainer, the one its CPU test runs end to end
# (tests/verl/test_verl_loop.py), except where only v1 is right: a bypass-mode rollout correction
# (the legacy trainer swaps stppo's loss for verl's own bypass_mode loss). backend.overrides=
# [trainer.use_v1=true] picks v1 for any other run (`uses_v1`; the launcher checks the package).
SEGMENTS_ERROR = ("reads subsentences from the token ids, which verl 0.9.1 does not pass to a policy "
                  "loss (its ppo_loss hands over log-probs, advantages and the response mask only); "
                  "train it with backend=own")
ACTOR = "actor_rollout_ref.actor"
ROLLOUT = "actor_rollout_ref.rollout"
MAX_TOOL_RESPONSE_CHARS = 8192  # verl truncates longer tool responses (middle); 3 passages fit
# data.max_prompt_length when backend.max_prompt_length is null: half the context, at most this.
# Search-R1's instruction and a question take ~200 tokens under Qwen2.5's chat template (its
# system line included); verl drops longer prompts (data.filter_overlong_prompts).
MAX_DERIVED_PROMPT = 512
MIN_PROMPT = 16


@dataclass(frozen=True)
class JobFiles:
    """Where a job's converted data, tool config and checkpoints are (absolute paths)."""

    train: str
    val: str
    tool_config: str
    checkpoints: str


def model_source(cfg: Config) -> str:
    """The model verl loads: `model.path`, else the preset's hub id (pretrained presets only)."""
    if cfg.model.path:
        return cfg.model.path
    from stppo.models.presets import get_model_preset

    preset = get_model_preset(cfg.model.name)
    if preset.kind != "pretrained":
        raise ValueError(f"model={cfg.model.name} is a {preset.kind} preset built by stppo's own trainer; "
                         "backend=verl needs a pretrained model: model=qwen2_5_* or model.path=DIR")
    return preset.source


def test_freq(val_every: int, live_every: int) -> int:
    """verl's validation interval: the collapse rule's live checks (`trainer.collapse.every`)
    when they are more often than `val_every`, which verl's one validation then also serves;
    -1 (none) when both are 0."""
    return min((k for k in (val_every, live_every) if k > 0), default=-1)


def verl_lengths(cfg: Config) -> tuple[int, int]:
    """(data.max_prompt_length, data.max_response_length). verl bounds the initial prompt and the
    whole multi-turn response (agent and tool tokens) apart; stppo's `trainer.rollout.max_total_tokens`
    bounds their sum. The prompt gets `backend.max_prompt_length`, or when that is null half of the
    total, at most MAX_DERIVED_PROMPT; the response the rest. ValueError (one line) when nothing is
    left for the response or the prompt would be under MIN_PROMPT tokens."""
    total, fixed = cfg.trainer.rollout.max_total_tokens, cfg.backend.max_prompt_length
    prompt = fixed if fixed is not None else min(MAX_DERIVED_PROMPT, total // 2)
    if fixed is not None and total <= fixed:
        raise ValueError(f"trainer.rollout.max_total_tokens={total} must exceed backend.max_prompt_length={fixed} "
                         "(the rest is the response); raise it, or set backend.max_prompt_length=null to derive "
                         "the prompt's share")
    if prompt < MIN_PROMPT:
        raise ValueError(f"trainer.rollout.max_total_tokens={total} leaves verl a prompt of {prompt} tokens; "
                         f"backend=verl needs at least {2 * MIN_PROMPT}")
    return prompt, total - prompt


def per_turn_count(cfg: Config) -> int:
    """K of the per-turn metrics `turn/k{k}/*` (k < K): task.max_turns, 0 with diagnostics.per_turn=false."""
    return cfg.task.max_turns if cfg.diagnostics.per_turn else 0


def check_translatable(cfg: Config) -> None:
    """Reject settings the verl backend cannot honour (one line naming the field)."""

    from stppo.algos import LOSS_MODES

    a, t = cfg.algo, cfg.trainer
    c = a.spec.clip_bias
    if c is not None and c.estimator == "grad":
        raise ValueError(f"algo.clip_bias.estimator=grad: {GRAD_ESTIMATOR_ERROR}")
    if LOSS_MODES[a.spec.loss_mode].segments:
        raise ValueError(f"algo.loss_mode={a.spec.loss_mode} {SEGMENTS_ERROR}")
    if a.advantage not in ADV_ESTIMATORS:
        raise ValueError(f"algo.advantage={a.advantage} has no verl estimator; backend=verl supports "
                         f"{', '.join(ADV_ESTIMATORS)}")
    if t.minibatch_size % t.group_size:
        raise ValueError(f"trainer.minibatch_size={t.minibatch_size} must be a multiple of trainer.group_size="
                         f"{t.group_size} with backend=verl (verl's mini-batches are whole prompt groups)")
    verl_lengths(cfg)
    _check_rollout_correction(cfg)
    if not cfg.tracking.enabled:
        raise ValueError("tracking.enabled=false: backend=verl follows verl through its MLflow run; "
                         "enable tracking (tracking.uri=… for another store)")
    if t.warmstart.enabled:
        raise ValueError("trainer.warmstart.enabled=true: verl has no SFT warm start; set "
                         "trainer.warmstart.enabled=false (pretrained models follow the prompt)")
    if cfg.task.prompt_style == "compact":
        raise ValueError("task.prompt_style=compact is for stppo's random-init models; backend=verl sends "
                         "Search-R1's instruction as a chat prompt: set task.prompt_style=search_r1")
    model_source(cfg)
    entry_module(cfg)
    if t.offpolicy.lag > 0:
        _check_offpolicy(cfg)


def entry_module(cfg: Config) -> str:
    """The module verl runs: `backend.entry` for an on-policy run; for trainer.offpolicy.lag = 1
    verl's one-step off-policy trainer, for larger lags its fully asynchronous one (which
    `backend.entry` may also name for lag 1). ValueError (one line) for what verl cannot run."""
    lag, mode, entry = cfg.trainer.offpolicy.lag, cfg.trainer.offpolicy.lag_mode, cfg.backend.entry
    if lag == 0:
        if entry in OFFPOLICY_ENTRIES:
            raise ValueError(f"backend.entry={entry} is one of verl's off-policy trainers, which have no "
                             "on-policy setting (staleness 0 is not the synchronous trainer); set "
                             "trainer.offpolicy.lag >= 1, or leave backend.entry at " + ENTRY_SYNC)
        return entry
    if mode != "fixed":
        raise ValueError(f"trainer.offpolicy.lag_mode={mode}: verl's off-policy trainers have no per-group "
                         "lag draw (their staleness comes from the rollout's pace); use lag_mode=fixed with "
                         "backend=verl, or the own trainer")
    if entry == ENTRY_SYNC:
        return ENTRY_ONE_STEP if lag == 1 else ENTRY_FULLY_ASYNC
    if entry == ENTRY_FULLY_ASYNC or (entry == ENTRY_ONE_STEP and lag == 1):
        return entry
    raise ValueError(f"backend.entry={entry} cannot run trainer.offpolicy.lag={lag}: the lag picks verl's "
                     f"trainer ({ENTRY_ONE_STEP} for lag 1, {ENTRY_FULLY_ASYNC} for any); leave "
                     f"backend.entry at {ENTRY_SYNC}")


def uses_v1(cfg: Config) -> bool:
    """Whether verl runs its v1 trainer (the comment above SEGMENTS_ERROR says why rarely): only
    for the synchronous entry, when backend.overrides sets trainer.use_v1=true or the rollout
    correction runs in bypass mode."""
    if entry_module(cfg) != ENTRY_SYNC:
        return False  # verl's off-policy trainers are trainers of their own
    forced = _overridden(cfg, "trainer.use_v1")
    if forced is not None:
        return forced == "true"
    rc = cfg.algo.spec.rollout_correction
    return rc.name != "none" and bool(rc.bypass_mode)


def rollout_engine(cfg: Config) -> str:
    """The rollout engine verl builds: backend.rollout_engine, or the name backend.overrides gives
    actor_rollout_ref.rollout.name (e.g. an engine registered by a verl plugin)."""
    return _overridden(cfg, f"{ROLLOUT}.name") or cfg.backend.rollout_engine


def verl_device(cfg: Config) -> str:
    """verl's trainer.device: cuda unless backend.overrides sets another (a verl platform plugin's)."""
    return _overridden(cfg, "trainer.device") or "cuda"


def rollout_gpus(cfg: Config) -> int:
    """GPUs per node that verl's off-policy trainers give the rollout (the rest train)."""
    b = cfg.backend
    return b.rollout_gpus_per_node if b.rollout_gpus_per_node is not None else b.n_gpus_per_node // 2


def _check_offpolicy(cfg: Config) -> None:
    """What verl's off-policy trainers need beyond the synchronous trainer (one line each)."""
    t, b = cfg.trainer, cfg.backend
    if b.n_gpus_per_node < 2:
        raise ValueError(f"trainer.offpolicy.lag={t.offpolicy.lag} with backend=verl needs >= 2 GPUs per node "
                         "(verl's off-policy trainers roll out and train on separate GPUs); raise "
                         "backend.n_gpus_per_node")
    if rollout_gpus(cfg) % b.rollout_tp:
        raise ValueError(f"backend.rollout_tp={b.rollout_tp} must divide the rollout's {rollout_gpus(cfg)} GPUs "
                         "per node under trainer.offpolicy.lag > 0; set backend.rollout_gpus_per_node")
    if cfg.algo.dynamic_sampling.enabled:
        raise ValueError("algo.dynamic_sampling with trainer.offpolicy.lag > 0: verl's off-policy trainers have "
                         "no group filtering (algorithm.filter_groups); set "
                         "algo.dynamic_sampling.enabled=false or use the own trainer")
    prompts = t.minibatch_size // t.group_size
    if entry_module(cfg) == ENTRY_FULLY_ASYNC and t.questions_per_step % prompts:
        raise ValueError(f"trainer.questions_per_step={t.questions_per_step} must be a multiple of "
                         f"trainer.minibatch_size / group_size = {prompts} with trainer.offpolicy.lag="
                         f"{t.offpolicy.lag} under verl (its fully async trainer takes a step's batch as "
                         "whole mini-batches: async_training.require_batches)")


def _overridden(cfg: Config, key: str) -> Any:
    """The value `backend.overrides` gives verl's `key` (last one wins), or None."""
    found = None
    for o in cfg.backend.overrides:
        k, _, v = str(o).lstrip("+~").partition("=")
        if k == key:
            found = v.strip().strip("'\"").lower()
    return found


def _check_rollout_correction(cfg: Config) -> None:
    """A rollout correction needs verl's rollout log-probs; bypass mode needs verl's v1 trainer
    (the legacy one swaps the stppo_* loss for its own `bypass_mode` loss)."""
    rc = cfg.algo.spec.rollout_correction
    if rc.name == "none":
        return
    if _overridden(cfg, f"{ROLLOUT}.calculate_log_probs") == "false":
        raise ValueError(f"algo.rollout_correction={rc.name} needs the sampler's log-probs: drop "
                         f"{ROLLOUT}.calculate_log_probs=false from backend.overrides")
    if rc.bypass_mode and _overridden(cfg, "trainer.use_v1") == "false":
        raise ValueError(f"algo.rollout_correction={rc.name} (bypass mode) with trainer.use_v1=false: "
                         "verl's legacy trainer replaces stppo's loss with its own bypass_mode loss; "
                         "drop trainer.use_v1=false from backend.overrides")


def verl_overrides(cfg: Config, files: JobFiles) -> list[str]:
    """Every verl override of the job, in a fixed order; `backend.overrides` come last."""
    check_translatable(cfg)
    o: dict[str, Any] = {}
    o.update(_data(cfg, files))
    if cfg.trainer.offpolicy.lag > 0:  # the decoupled form (a rollout correction may say otherwise)
        o["algorithm.rollout_correction.bypass_mode"] = False
    o.update(_algorithm(cfg))
    o.update(_actor(cfg))
    o.update(_rollout(cfg, files))
    o.update(_critic(cfg))
    o.update(_model(cfg))
    o.update(_trainer(cfg, files))
    o["reward.custom_reward_function.path"] = REWARD_PATH
    o["reward.custom_reward_function.name"] = REWARD_NAME
    o.update(_offpolicy(cfg))
    return [f"{k}={fmt(v)}" for k, v in o.items()] + list(cfg.backend.overrides)


def _data(cfg: Config, files: JobFiles) -> dict[str, Any]:
    t = cfg.trainer
    prompt, response = verl_lengths(cfg)
    return {"data.train_files": files.train, "data.val_files": files.val, "data.prompt_key": "prompt",
            "data.train_batch_size": t.questions_per_step, "data.val_max_samples": t.val_questions,
            "data.max_prompt_length": prompt, "data.max_response_length": response,
            "data.filter_overlong_prompts": True, "data.return_raw_chat": True, "data.seed": cfg.seed}


def _algorithm(cfg: Config) -> dict[str, Any]:
    a = cfg.algo
    o: dict[str, Any] = {"algorithm.adv_estimator": ADV_ESTIMATORS[a.advantage], "algorithm.gamma": a.gamma,
                         "algorithm.lam": a.gae_lambda, "algorithm.norm_adv_by_std_in_grpo": True,
                         "algorithm.use_kl_in_reward": a.kl.coef > 0 and a.kl.in_reward}
    if a.advantage == "tir_optimal_token_baseline":
        o.update(SUM_PI_SQUARED)
    if a.kl.coef > 0 and a.kl.in_reward:
        o.update({"algorithm.kl_penalty": a.kl.estimator, "algorithm.kl_ctrl.type": "fixed",
                  "algorithm.kl_ctrl.kl_coef": a.kl.coef})
    rc = a.spec.rollout_correction
    if rc.name != "none":  # decoupled: verl's driver computes weights and mask before the
        # advantages; bypass: its trainer sets π_old := π_rollout and the stppo_* loss corrects
        o.update({f"algorithm.rollout_correction.{f}": getattr(rc, f) for f in ROLLOUT_CORRECTION_FIELDS})
    if a.dynamic_sampling.enabled:  # verl's own group filtering (its refill rule, not stppo's)
        o.update({"algorithm.filter_groups.enable": True, "algorithm.filter_groups.metric": "reward",
                  "algorithm.filter_groups.max_num_gen_batches": a.dynamic_sampling.max_rounds + 1})
    if a.overlong.enabled:  # verl's DAPO reward manager: the penalty over the response's last tokens
        r = "+reward.reward_kwargs"
        o.update({"reward.reward_manager.name": "dapo", f"{r}.overlong_buffer_cfg.enable": True,
                  f"{r}.overlong_buffer_cfg.len": a.overlong.buffer_len,
                  f"{r}.overlong_buffer_cfg.penalty_factor": a.overlong.penalty_factor,
                  f"{r}.overlong_buffer_cfg.log": False,
                  f"{r}.max_resp_len": verl_lengths(cfg)[1]})
    return o


def _actor(cfg: Config) -> dict[str, Any]:
    a, t = cfg.algo, cfg.trainer
    pl = f"{ACTOR}.policy_loss"
    o: dict[str, Any] = {
        f"{pl}.loss_mode": loss_mode(a.name), f"{pl}._target_": LOSS_CONFIG_TARGET,
        f"+{pl}.max_turns": per_turn_count(cfg),
        **{f"+{pl}.spec.{key}": value for key, value in flat(a.spec.to_dict()).items()},
        **({f"+{pl}.plugin": a.plugin} if a.plugin else {}),
        f"{ACTOR}.clip_ratio_low": a.clip_low, f"{ACTOR}.clip_ratio_high": a.clip_high,
        f"{ACTOR}.loss_agg_mode": a.loss_agg, f"{ACTOR}.entropy_coeff": a.entropy_coef,
        f"{ACTOR}.use_kl_loss": a.kl.coef > 0 and not a.kl.in_reward,
        f"{ACTOR}.ppo_epochs": t.ppo_epochs, f"{ACTOR}.ppo_mini_batch_size": t.minibatch_size // t.group_size,
        f"{ACTOR}.ppo_micro_batch_size_per_gpu": cfg.backend.micro_batch_size_per_gpu,
        f"{ACTOR}.optim.lr": t.actor_lr, f"{ACTOR}.optim.weight_decay": t.weight_decay,
        f"{ACTOR}.optim.clip_grad": t.max_grad_norm,
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu": cfg.backend.micro_batch_size_per_gpu,
    }
    o[f"{ACTOR}.clip_ratio_c"] = a.dual_clip if a.dual_clip is not None else NO_DUAL_CLIP
    o.update(_verl_loss_knobs(a.spec, pl))
    if a.kl.coef > 0 and not a.kl.in_reward:
        o.update({f"{ACTOR}.kl_loss_coef": a.kl.coef, f"{ACTOR}.kl_loss_type": a.kl.estimator})
    return o


def _verl_loss_knobs(spec, pl: str) -> dict[str, Any]:
    """verl's own keys of the VERL_LOSS_MODES, set to the spec's values: DPPO's truncation C is
    verl's `actor.clip_ratio_c` (DPPO has no dual clip; δ_low, δ_high are clip_ratio_low/high
    already), DRO's β its `policy_loss.dro_beta` (required, no default). The stppo_* loss itself
    reads the spec."""
    if spec.loss_mode in ("dppo_tv", "dppo_kl"):
        return {f"{ACTOR}.clip_ratio_c": spec.options["clip_ratio_c"]}
    if spec.loss_mode == "dro":
        return {f"{pl}.dro_beta": spec.options["beta"]}
    return {}


def _rollout(cfg: Config, files: JobFiles) -> dict[str, Any]:
    t, b = cfg.trainer, cfg.backend
    return {
        f"{ROLLOUT}.name": b.rollout_engine, f"{ROLLOUT}.n": t.group_size,
        f"{ROLLOUT}.temperature": t.rollout.temperature, f"{ROLLOUT}.top_p": t.rollout.top_p,
        f"{ROLLOUT}.tensor_model_parallel_size": b.rollout_tp,
        f"{ROLLOUT}.gpu_memory_utilization": b.gpu_memory_utilization,
        f"{ROLLOUT}.log_prob_micro_batch_size_per_gpu": b.micro_batch_size_per_gpu,
        f"{ROLLOUT}.val_kwargs.do_sample": False,  # greedy validation, as the own trainer's
        f"{ROLLOUT}.multi_turn.enable": True, f"{ROLLOUT}.multi_turn.max_assistant_turns": cfg.task.max_turns,
        f"{ROLLOUT}.multi_turn.tool_config_path": files.tool_config, f"{ROLLOUT}.multi_turn.format": TOOL_FORMAT,
        f"{ROLLOUT}.multi_turn.max_tool_response_length": MAX_TOOL_RESPONSE_CHARS,
        f"{ROLLOUT}.agent.default_agent_loop": AGENT_LOOP,
    }


def _critic(cfg: Config) -> dict[str, Any]:
    a, t = cfg.algo, cfg.trainer
    o: dict[str, Any] = {"critic.enable": a.use_critic}
    if a.use_critic:
        o.update({"critic.optim.lr": t.critic_lr, "critic.optim.weight_decay": t.weight_decay,
                  "critic.optim.clip_grad": t.max_grad_norm, "critic.cliprange_value": a.vf_clip,
                  "critic.ppo_micro_batch_size_per_gpu": cfg.backend.micro_batch_size_per_gpu})
    return o


def _model(cfg: Config) -> dict[str, Any]:
    path, m = model_source(cfg), cfg.model
    o: dict[str, Any] = {}
    for prefix in ("actor_rollout_ref.model", "critic.model"):
        o[f"{prefix}.path"] = path
        o[f"{prefix}.enable_gradient_checkpointing"] = m.gradient_checkpointing
    if m.dtype != "auto":  # auto: verl's default, bf16 compute over fp32 master weights
        o.update({f"{ROLLOUT}.dtype": m.dtype, f"{ACTOR}.fsdp_config.dtype": m.dtype,
                  "actor_rollout_ref.ref.fsdp_config.dtype": m.dtype, "critic.fsdp.dtype": m.dtype})
    return o


def _trainer(cfg: Config, files: JobFiles) -> dict[str, Any]:
    t, b = cfg.trainer, cfg.backend
    return {
        "trainer.logger": ["console", "mlflow"], "trainer.project_name": cfg.tracking.experiment,
        "trainer.experiment_name": cfg.tracking.run_name or f"{cfg.algo.name}-{cfg.model.name}-seed{cfg.seed}",
        "trainer.nnodes": b.nnodes, "trainer.n_gpus_per_node": b.n_gpus_per_node,
        "trainer.total_training_steps": t.total_steps, "trainer.total_epochs": t.total_steps,
        "trainer.critic_warmup": t.critic_warmup, "trainer.val_before_train": True,
        "trainer.test_freq": test_freq(t.val_every, t.collapse.every), "trainer.save_freq": t.save_every or -1,
        "trainer.default_local_dir": files.checkpoints,
        "trainer.resume_mode": "auto" if t.resume else "disable",
        **({"trainer.use_v1": uses_v1(cfg)} if entry_module(cfg) == ENTRY_SYNC else {}),
    }


def _offpolicy(cfg: Config) -> dict[str, Any]:
    """Stale rollouts (trainer.offpolicy.lag > 0) in verl's off-policy trainers (docs/design.md
    §8.2): a rollout on GPUs of its own that syncs weights after every training step; the one-step
    trainer is lag 1 exactly, the fully async one keeps at most `lag` steps' batches in flight."""
    t, b = cfg.trainer, cfg.backend
    if t.offpolicy.lag == 0:
        return {}
    entry, gpus = entry_module(cfg), rollout_gpus(cfg)
    o: dict[str, Any] = {
        "actor_rollout_ref.hybrid_engine": False, f"{ROLLOUT}.calculate_log_probs": True,
        "rollout.nnodes": b.nnodes, "rollout.n_gpus_per_node": gpus,
        "trainer.n_gpus_per_node": b.n_gpus_per_node - gpus,
    }
    if entry == ENTRY_ONE_STEP:
        o["hydra.searchpath"] = VERL_CONFIG_SEARCHPATH
    else:  # one trainer step = questions_per_step prompts = require_batches mini-batches
        prompts = t.minibatch_size // t.group_size
        o.update({"async_training.staleness_threshold": t.offpolicy.lag,
                  "async_training.trigger_parameter_sync_step": 1,
                  # a trajectory cut by a weight sync is dropped, not resumed by the new weights:
                  # each trajectory comes from one policy, as in the own trainer
                  "async_training.partial_rollout": False,
                  "async_training.require_batches": t.questions_per_step // prompts,
                  "data.train_batch_size": 0, "data.gen_batch_size": 1,
                  "rollout.total_rollout_steps": t.total_steps * t.questions_per_step})
    return o


def env_overrides(env: Mapping[str, str]) -> list[str]:
    """Environment variables for verl's Ray workers (its MLflow logger runs in a Ray actor)."""
    return [f"+ray_kwargs.ray_init.runtime_env.env_vars.{k}={fmt(v)}" for k, v in env.items()]


_PLAIN = re.compile(r"^[A-Za-z0-9_./:~+-]+$")
# Strings Hydra's grammar may read as a number ('0.5_2' is 0.52, '1_000' 1000; 'inf', 'nan'):
# quoted, so a threshold 'lower_upper' stays a string.
_NUMBER_LIKE = re.compile(r"^[+-]?([0-9_.]+([eE][+-]?[0-9_]+)?|inf|nan)$", re.IGNORECASE)


def flat(d: dict, prefix: str = "") -> dict[str, Any]:
    """Nested dicts → {'a.b': value} (an empty dict stays one entry: `{}` in the grammar)."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out.update(flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def fmt(value: Any) -> str:
    """A value in Hydra's override grammar (strings quoted unless plainly safe)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"non-finite setting {value} cannot go to verl")
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(fmt(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{fmt(v)}" for k, v in value.items()) + "}"
    text = str(value)
    if _PLAIN.match(text) and text not in ("null", "true", "false") and not _NUMBER_LIKE.match(text):
        return text
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def format_command(argv: list[str], env: Mapping[str, str]) -> str:
    """The command as a copy-pasteable shell line, one override per line."""
    head = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
    lines = [f"{head} {shlex.quote(argv[0])} {argv[1]} {argv[2]}".strip()]
    lines += [f"    {shlex.quote(a)}" for a in argv[3:]]
    return " \\\n".join(lines)
