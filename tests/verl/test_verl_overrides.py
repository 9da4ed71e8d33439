"""The launcher's verl overrides compose with verl 0.9.1's own `ppo_trainer` config and build verl's
config dataclasses (actor, critic, rollout, algorithm, model) and pass `validate_config`, for every
preset, for +experiment=paper_search with each Qwen2.5 size, and for a group preset with its group.

The model folder is a local stand-in (`local_model.py`; no hub here): the translated path is
checked to be the preset's hub id, then swapped for the local folder that verl's model config reads.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from local_model import make_local_model

from stppo.algos import LOSS_MODES, PRESETS, LossSpec
from stppo.config import compose, to_config
from stppo.integrations.verl import overrides as O

QWEN = {"qwen2_5_0_5b": "Qwen/Qwen2.5-0.5B-Instruct", "qwen2_5_1_5b": "Qwen/Qwen2.5-1.5B-Instruct",
        "qwen2_5_3b": "Qwen/Qwen2.5-3B-Instruct", "qwen2_5_7b": "Qwen/Qwen2.5-7B-Instruct"}
SMALL = ["backend=verl", "trainer.warmstart.enabled=false", "task.prompt_style=search_r1",
         "trainer.rollout.max_total_tokens=1024"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_local_model(tmp_path_factory.mktemp("model"))


# verl's entry module → (its @hydra.main config folder inside verl, config name)
ENTRY_CONFIGS = {O.ENTRY_SYNC: ("trainer/config", "ppo_trainer"),
                 O.ENTRY_ONE_STEP: ("experimental/one_step_off_policy/config", "one_step_off_ppo_trainer"),
                 O.ENTRY_FULLY_ASYNC: ("experimental/fully_async_policy/config", "fully_async_ppo_trainer")}


def verl_compose(overrides: list[str], entry: str = O.ENTRY_SYNC):
    """verl's config as `python -m ENTRY OVERRIDES…` composes it (its own config file)."""
    import verl
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    folder, name = ENTRY_CONFIGS[entry]
    with initialize_config_dir(config_dir=str(Path(verl.__file__).parent / folder), version_base=None):
        return hydra_compose(name, overrides=overrides)


def translate(stppo_overrides: list[str], model_dir: Path, hub_id: str | None = None):
    """(stppo Config, verl config, built dataclasses) of one job, composed with the config of the
    trainer the launcher picks and checked as its entry module checks it."""
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import omega_conf_to_dataclass, validate_config

    cfg = to_config(compose(stppo_overrides))
    files = O.JobFiles("/data/train.parquet", "/data/val.parquet", "/data/tool_config.yaml", "/ckpt")
    ov = O.verl_overrides(cfg, files) + O.env_overrides({"MLFLOW_RUN_ID": "abc", "MLFLOW_TRACKING_URI": "sqlite:////x.db"})
    paths = [o for o in ov if o.endswith("model.path=" + (hub_id or str(model_dir)))]
    assert len(paths) == 2, "actor and critic model paths"
    ov = [o.split("=", 1)[0] + f"={model_dir}" if o in paths else o for o in ov]
    entry = O.entry_module(cfg)
    c = verl_compose(ov, entry)
    if entry != O.ENTRY_FULLY_ASYNC:  # (the fully async trainer asserts its own: test below)
        validate_config(c, use_reference_policy=need_reference_policy(c), use_critic=need_critic(c))
    built = {"actor": omega_conf_to_dataclass(c.actor_rollout_ref.actor),
             "rollout": omega_conf_to_dataclass(c.actor_rollout_ref.rollout),
             "algorithm": omega_conf_to_dataclass(c.algorithm),
             "model": omega_conf_to_dataclass(c.actor_rollout_ref.model),
             "critic": omega_conf_to_dataclass(c.critic) if need_critic(c) else None}
    return cfg, c, built


@pytest.mark.parametrize("preset", [n for n, p in PRESETS.items() if not LOSS_MODES[p.loss_mode].segments])
def test_every_preset_composes_with_verl_and_builds_its_dataclasses(preset, model_dir):
    cfg, c, b = translate([*SMALL, f"algo={preset}", f"model.path={model_dir}"], model_dir)
    p = PRESETS[preset]
    loss = b["actor"].policy_loss
    assert type(loss).__name__ == "StppoPolicyLossConfig" and loss.loss_mode == f"stppo_{preset}"
    assert LossSpec.from_dict(loss.spec) == cfg.algo.spec  # the run's whole loss travels
    assert loss.max_turns == cfg.task.max_turns == 4  # the per-turn metrics' K
    assert b["algorithm"].adv_estimator == O.ADV_ESTIMATORS[p.advantage]
    assert (b["critic"] is not None) == p.use_critic
    a = b["actor"]
    assert (a.clip_ratio_low, a.clip_ratio_high, a.loss_agg_mode) == (
        cfg.algo.clip_low, cfg.algo.clip_high, cfg.algo.loss_agg)
    assert a.ppo_mini_batch_size == cfg.trainer.minibatch_size // cfg.trainer.group_size
    assert (a.optim.lr, a.ppo_epochs) == (cfg.trainer.actor_lr, cfg.trainer.ppo_epochs)
    r = b["rollout"]
    assert (r.n, r.multi_turn.max_assistant_turns, r.multi_turn.format) == (cfg.trainer.group_size, 4, "search_r1")
    assert r.multi_turn.enable and r.agent.default_agent_loop == O.AGENT_LOOP
    assert c.data.max_prompt_length + c.data.max_response_length == 1024
    assert c.reward.custom_reward_function.path == O.REWARD_PATH
    assert list(c.trainer.logger) == ["console", "mlflow"]
    assert c.ray_kwargs.ray_init.runtime_env.env_vars.MLFLOW_RUN_ID == "abc"
    assert b["model"].local_path == str(model_dir)


@pytest.mark.parametrize("size", list(QWEN))
def test_paper_search_composes_with_each_qwen_size(size, model_dir):
    cfg, c, b = translate(["backend=verl", "+experiment=paper_search", "algo=st_ppo", f"model={size}"],
                          model_dir, hub_id=QWEN[size])
    a, algo, crit = b["actor"], b["algorithm"], b["critic"]
    assert (a.optim.lr, crit.optim.lr) == (1e-6, 1e-5)
    assert a.ppo_mini_batch_size == 256 and c.data.train_batch_size == 512
    assert algo.use_kl_in_reward and algo.kl_ctrl.kl_coef == 0.001 and algo.kl_penalty == "k1"
    assert not a.use_kl_loss and algo.gamma == 1.0 and algo.lam == 1.0
    assert c.data.max_prompt_length + c.data.max_response_length == 4096
    assert b["rollout"].dtype == "bfloat16" and c.actor_rollout_ref.model.enable_gradient_checkpointing
    assert c.trainer.total_training_steps == 1005 and c.trainer.test_freq == 100


EXPERIMENTS = sorted(p.stem for p in (Path(__file__).resolve().parents[2] / "conf" / "experiment").glob("*.yaml"))


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_every_shipped_experiment_composes_valid_verl_settings(experiment, model_dir):
    """backend=verl with each shipped experiment (a pretrained model where the experiment's is a
    CPU one): verl composes the overrides, builds its config classes and passes validate_config;
    the prompt and response lengths split the experiment's context."""
    cfg, c, b = translate(["backend=verl", f"+experiment={experiment}", f"model.path={model_dir}"], model_dir)
    assert not cfg.trainer.warmstart.enabled and cfg.task.prompt_style in ("search_r1", "instruct")  # chat prompts
    assert c.data.max_prompt_length + c.data.max_response_length == cfg.trainer.rollout.max_total_tokens
    assert c.data.max_prompt_length == min(512, cfg.trainer.rollout.max_total_tokens // 2)
    assert b["actor"].policy_loss.max_turns == cfg.task.max_turns


def test_per_turn_metrics_off_reach_the_loss_as_zero_turns(model_dir):
    cfg, c, b = translate([*SMALL, "algo=st_ppo", "diagnostics.per_turn=false", f"model.path={model_dir}"],
                          model_dir)
    assert b["actor"].policy_loss.max_turns == 0


def test_a_group_preset_takes_its_group_size(model_dir):
    cfg, c, b = translate(["backend=verl", "+experiment=paper_search", "algo=grpo", "trainer.group_size=5",
                           "trainer.minibatch_size=1280", "model=qwen2_5_3b"], model_dir, hub_id=QWEN["qwen2_5_3b"])
    assert b["rollout"].n == 5 and b["actor"].ppo_mini_batch_size == 256
    assert b["algorithm"].adv_estimator == "grpo" and b["critic"] is None and not c.critic.enable


def test_the_baselines_settings_reach_verl(model_dir):
    """dapo: clip-higher, token-mean, verl's group filtering and its DAPO reward manager with the
    overlong buffer; sapo: the loss options on the policy-loss config; TIS: verl's rollout IS."""
    cfg, c, b = translate([*SMALL, "algo=dapo", "algo.overlong.buffer_len=64", f"model.path={model_dir}"],
                          model_dir)
    a, algo = b["actor"], b["algorithm"]
    assert (a.clip_ratio_low, a.clip_ratio_high, a.loss_agg_mode) == (0.2, 0.28, "token-mean")
    assert algo.filter_groups.enable and algo.filter_groups.metric == "reward"
    assert algo.filter_groups.max_num_gen_batches == cfg.algo.dynamic_sampling.max_rounds + 1
    assert c.reward.reward_manager.name == "dapo"
    ob = c.reward.reward_kwargs.overlong_buffer_cfg
    assert ob.enable and ob.len == 64 and c.reward.reward_kwargs.max_resp_len == c.data.max_response_length
    assert a.clip_ratio_c == O.NO_DUAL_CLIP  # stppo's dual_clip=null

    cfg, c, b = translate([*SMALL, "algo=sapo", "+algo.loss_options.tau_pos=2.5", f"model.path={model_dir}"],
                          model_dir)
    assert dict(b["actor"].policy_loss.spec["options"]) == dict(cfg.algo.loss_options)
    assert b["actor"].policy_loss.spec["options"]["tau_pos"] == 2.5

    cfg, c, b = translate([*SMALL, "algo=ppo", "algo.rollout_correction=decoupled_token_is",
                           "algo.rollout_correction_options.threshold=3.0", f"model.path={model_dir}"], model_dir)
    rc = b["algorithm"].rollout_correction
    assert (rc["rollout_is"], rc["rollout_is_threshold"]) == ("token", 3.0)


@pytest.mark.parametrize("name,options", [
    ("none", []), ("decoupled_geo_rs", []), ("decoupled_seq_is_rs", ["rs_threshold='0.5_3'"]),
    ("decoupled_token_icepop", ["threshold_lower=0.25"]), ("decoupled_k3_rs_token_tis", ["batch_normalize=true"]),
    ("bypass_ppo_clip_k3_rs", []), ("bypass_pg_geo_rs_seq_tis", ["rs_threshold=0.99_1.01"])])
def test_rollout_corrections_reach_verls_rollout_correction_config(model_dir, name, options):
    """algo.rollout_correction → algorithm.rollout_correction.*: verl builds its own
    RolloutCorrectionConfig with the name's fields (its classmethod's, with the run's options),
    and the loss's spec carries the same correction (bypass mode is applied by the stppo_* loss)."""
    from verl.trainer.config.algorithm import RolloutCorrectionConfig

    cfg, c, b = translate([*SMALL, "algo=grpo", f"algo.rollout_correction={name}",
                           *(f"algo.rollout_correction_options.{o}" for o in options),
                           f"model.path={model_dir}"], model_dir)
    ours = cfg.algo.spec.rollout_correction
    from verl.utils.config import omega_conf_to_dataclass

    built = omega_conf_to_dataclass(c.algorithm.rollout_correction, RolloutCorrectionConfig)
    assert dict(b["algorithm"].rollout_correction) == {f: getattr(built, f) for f in built.keys()
                                                       if f != "_target_"}
    verl_name = "disabled" if name == "none" else name
    args = {k: v for k, v in ours.options.items() if k != "batch_normalize"}
    want = getattr(RolloutCorrectionConfig, verl_name)(**args)
    for f in ("rollout_is", "rollout_is_threshold", "rollout_rs", "rollout_rs_threshold", "bypass_mode", "loss_type"):
        assert getattr(built, f) == getattr(want, f), f
    assert built.rollout_is_batch_normalize == ours.rollout_is_batch_normalize
    assert LossSpec.from_dict(b["actor"].policy_loss.spec).rollout_correction == ours
    if name == "decoupled_seq_is_rs":  # '0.5_3' stays a string on the way (Hydra reads 0.5_3 as 0.53)
        assert built.rollout_rs_threshold == "0.5_3"


def test_a_loss_other_than_the_presets_reaches_verl(model_dir):
    """Any override of the loss travels in the spec: verl's stppo_ppo computes cispo here."""
    cfg, c, b = translate([*SMALL, "algo=ppo", "algo.loss_mode=cispo", "algo.clip_low=0.99",
                           f"model.path={model_dir}"], model_dir)
    loss = b["actor"].policy_loss
    assert loss.loss_mode == "stppo_ppo" and LossSpec.from_dict(loss.spec).loss_mode == "cispo"
    assert LossSpec.from_dict(loss.spec) == cfg.algo.spec


@pytest.mark.parametrize("algo", [["algo=tir_optimal_token_baseline"],
                                  ["algo=grpo", "algo.advantage=tir_optimal_token_baseline"]])
def test_the_optimal_token_baseline_gets_verls_sum_pi_squared_and_legacy_trainer(algo, model_dir):
    """verl 0.9.1 computes Σπ² only with calculate_sum_pi_squared, unfused kernels and its legacy
    trainer (its v1 trainer never fetches it for `compute_advantage`)."""
    cfg, c, b = translate([*SMALL, *algo, f"model.path={model_dir}"], model_dir)
    assert b["algorithm"].adv_estimator == "tir_optimal_token_baseline" and b["critic"] is None
    assert b["actor"].calculate_sum_pi_squared and not c.actor_rollout_ref.model.use_fused_kernels
    assert c.trainer.use_v1 is False
    cfg, c, b = translate([*SMALL, "algo=grpo", f"model.path={model_dir}"], model_dir)
    assert not b["actor"].calculate_sum_pi_squared  # verl's default
    assert c.trainer.use_v1 is False  # stppo's choice for every run without bypass mode (overrides.uses_v1)


def test_the_new_baselines_options_reach_verl_and_sspo_is_refused(model_dir):
    cfg, c, b = translate([*SMALL, "algo=dppo_kl", "+algo.loss_options.clip_ratio_c=5.0",
                           f"model.path={model_dir}"], model_dir)
    spec = LossSpec.from_dict(b["actor"].policy_loss.spec)
    assert spec.loss_mode == "dppo_kl" and dict(spec.options) == {"clip_ratio_c": 5.0}
    assert (b["actor"].clip_ratio_low, b["actor"].clip_ratio_high) == (0.05, 0.05)  # δ_low, δ_high
    with pytest.raises(ValueError, match="algo.loss_mode=sspo reads subsentences from the token ids") as e:
        translate([*SMALL, "algo=sspo", f"model.path={model_dir}"], model_dir)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("preset", O.VERL_LOSS_MODES)
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_verls_own_loss_on_the_translated_config_is_the_runs_loss(preset, agg, model_dir):
    """dppo_tv, dppo_kl, dro: the translated actor config read by verl's own loss of that name
    (policy_loss.loss_mode swapped, stppo's keys dropped) gives the stppo_<preset> loss the run
    trains with, through verl's ppo_loss: the same loss, gradient and verl's metrics — δ_low,
    δ_high from clip_ratio_low/high, DPPO's C from clip_ratio_c, DRO's β from dro_beta."""
    import copy

    from omegaconf import open_dict
    from verl.utils.config import omega_conf_to_dataclass
    from verl_batch import floats, make_batch, run_ppo_loss

    opts = {"dro": "+algo.loss_options.beta=0.3"}.get(preset, "+algo.loss_options.clip_ratio_c=1.5")
    cfg, c, b = translate([*SMALL, f"algo={preset}", opts, f"algo.loss_agg={agg}",
                           f"model.path={model_dir}"], model_dir)
    node = copy.deepcopy(c).actor_rollout_ref.actor
    with open_dict(node):
        node.policy_loss = {k: v for k, v in node.policy_loss.items() if k not in O.LOSS_FIELDS}
        node.policy_loss.loss_mode = preset
        node.policy_loss._target_ = "verl.workers.config.PolicyLossConfig"
    own = omega_conf_to_dataclass(node)
    assert type(own.policy_loss).__name__ == "PolicyLossConfig"
    if preset == "dro":
        assert own.policy_loss.dro_beta == 0.3
    else:
        assert (own.clip_ratio_low, own.clip_ratio_high, own.clip_ratio_c) == (
            cfg.algo.clip_low, cfg.algo.clip_high, 1.5)
    batch = make_batch(seed=11, garbage=0.0)  # verl's losses multiply by the mask: finite garbage
    want_l, want_m, want_g = run_ppo_loss(own, batch, micro=4)
    got_l, got_m, got_g = run_ppo_loss(b["actor"], batch, micro=4)
    for g, w in zip(got_l, want_l):
        assert float(g) == pytest.approx(float(w), rel=1e-12, abs=1e-12)
    assert torch.allclose(got_g, want_g, rtol=1e-12, atol=1e-12)
    for got, want in zip(got_m, want_m):
        got, want = floats(got), floats(want)
        for k, v in want.items():  # verl's fractions are float32
            assert got[k] == pytest.approx(v, rel=1e-7, abs=1e-7), k
    if preset != "dro":  # the truncation binds, the region excludes some tokens
        fracs = [floats(m) for m in want_m]
        assert max(m["actor/pg_clipfrac_lower"] for m in fracs) > 0
        assert max(m["actor/pg_clipfrac"] for m in fracs) > 0


STALE = [*SMALL, "backend.n_gpus_per_node=8"]


def rollout_correction(c):
    """verl's RolloutCorrectionConfig built from the composed `algorithm.rollout_correction`."""
    from verl.trainer.config.algorithm import RolloutCorrectionConfig
    from verl.utils.config import omega_conf_to_dataclass

    return omega_conf_to_dataclass(c.algorithm.rollout_correction, RolloutCorrectionConfig)


def test_lag_one_composes_with_verls_one_step_off_policy_trainer(model_dir):
    """trainer.offpolicy.lag=1: verl's one-step off-policy trainer (its own config over
    ppo_trainer), rollout on half the node's GPUs, stppo's loss in the decoupled form."""
    cfg, c, b = translate([*STALE, "algo=st_ppo", "trainer.offpolicy.lag=1", f"model.path={model_dir}"], model_dir)
    assert O.entry_module(cfg) == O.ENTRY_ONE_STEP
    assert not c.actor_rollout_ref.hybrid_engine and c.actor_rollout_ref.rollout.calculate_log_probs
    assert (c.rollout.nnodes, c.rollout.n_gpus_per_node, c.trainer.n_gpus_per_node) == (1, 4, 4)
    assert rollout_correction(c).bypass_mode is False  # π_old recomputed; stppo's loss, not verl's bypass_mode
    assert b["actor"].policy_loss.loss_mode == "stppo_st_ppo"
    assert c.data.train_batch_size == cfg.trainer.questions_per_step


def test_verls_one_step_config_needs_the_package_search_path_from_an_installed_verl(model_dir):
    """Its config's `file://verl/trainer/config` resolves only from a verl checkout's root; the
    launcher's hydra.searchpath override makes `python -m` work from anywhere."""
    from hydra.errors import MissingConfigException

    with pytest.raises(MissingConfigException, match="ppo_trainer"):
        verl_compose([], O.ENTRY_ONE_STEP)


@pytest.mark.parametrize("lag", [2, 4])
def test_larger_lags_compose_with_verls_fully_async_trainer(lag, model_dir):
    """trainer.offpolicy.lag >= 2: verl's fully async trainer with staleness_threshold = lag,
    a weight sync after every training step, a step = questions_per_step prompts; with a rollout
    correction (verl computes it between the recomputed π_old and the rollout's log-probs)."""
    from verl.utils.config import omega_conf_to_dataclass

    cfg, c, b = translate(["backend=verl", "+experiment=paper_search", "algo=ppo", f"trainer.offpolicy.lag={lag}",
                           "algo.rollout_correction=decoupled_token_is", "model=qwen2_5_1_5b"], model_dir, hub_id=QWEN["qwen2_5_1_5b"])
    assert O.entry_module(cfg) == O.ENTRY_FULLY_ASYNC
    at, t = c.async_training, cfg.trainer
    assert (at.staleness_threshold, at.trigger_parameter_sync_step, at.partial_rollout) == (lag, 1, False)
    # the checks of FullyAsyncRollouter.__init__ / _validate_config
    assert c.data.train_batch_size == 0 and c.data.gen_batch_size == 1
    assert at.staleness_threshold >= 0 and at.trigger_parameter_sync_step >= 1
    assert c.actor_rollout_ref.rollout.calculate_log_probs and not c.actor_rollout_ref.hybrid_engine
    # its batch arithmetic: a training step takes questions_per_step prompts; at most lag + 1
    # steps' samples are generated per weight version; total_steps training steps
    required = b["actor"].ppo_mini_batch_size * at.require_batches
    assert required == t.questions_per_step
    assert required * (at.staleness_threshold + 1) * at.trigger_parameter_sync_step == (lag + 1) * t.questions_per_step
    assert c.rollout.total_rollout_steps // (required * at.trigger_parameter_sync_step) == t.total_steps
    rc = rollout_correction(c)
    assert rc.bypass_mode is False and (rc.rollout_is, rc.rollout_is_threshold) == ("token", 2.0)
    assert b["actor"].policy_loss.loss_mode == "stppo_ppo" and b["critic"] is not None
    assert omega_conf_to_dataclass(c.actor_rollout_ref.rollout).n == t.group_size
