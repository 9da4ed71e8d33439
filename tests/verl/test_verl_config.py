"""stppo's knobs reach the loss through verl's own config machinery: Hydra composes verl's
`ppo_trainer` with a `_target_` override, verl's `omega_conf_to_dataclass` instantiates the
actor config (as its workers do), and the loss reads τ / granularity from it."""

from __future__ import annotations

import warnings

import pytest
from hydra import compose, initialize_config_module
from hydra.errors import InstantiationException

from stppo.algos import PRESETS
from stppo.integrations.verl.config import TARGET, StppoPolicyLossConfig
from stppo.metric_names import CLIP_BIAS_NORM, CLIP_BIAS_SCALE
from verl_batch import floats, make_batch, run_ppo_loss

PL = "actor_rollout_ref.actor.policy_loss"


def actor_from_overrides(*overrides: str):
    from verl.utils.config import omega_conf_to_dataclass

    with initialize_config_module("verl.trainer.config", version_base=None):
        cfg = compose("ppo_trainer", overrides=[
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2", *overrides])
    return omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)


def test_stppo_compose_in_verls_hydra_warns_nothing():
    """verl's environment has Hydra 1.3.8 (verl asks for any hydra-core; 1.4 is a pre-release),
    which assumes 1.1's defaults (with a migration warning) unless given `version_base`;
    `stppo.config.compose` gives it (`python -m stppo.integrations.verl.data` run with verl's
    interpreter and these tests compose with it)."""
    from stppo.config import compose

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert compose(["algo=st_ppo", "backend=verl"]).backend.name == "verl"


def test_target_override_carries_stppo_knobs_to_the_loss():
    actor = actor_from_overrides(f"{PL}._target_={TARGET}", f"{PL}.loss_mode=stppo_st_ppo",
                                 f"+{PL}.tau=0.25", f"+{PL}.granularity=batch",
                                 "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean",
                                 "actor_rollout_ref.actor.clip_ratio_high=0.28")
    pl = actor.policy_loss
    assert type(pl) is StppoPolicyLossConfig
    assert TARGET == f"{StppoPolicyLossConfig.__module__}.{StppoPolicyLossConfig.__qualname__}"
    assert (pl.loss_mode, pl.tau, pl.estimator, pl.granularity) == ("stppo_st_ppo", 0.25,
                                                                     "token", "batch")
    assert (actor.clip_ratio_low, actor.clip_ratio_high, actor.clip_ratio_c) == (0.2, 0.28, 3.0)
    _, metrics, _ = run_ppo_loss(actor, make_batch(seed=11), micro=8)
    m = floats(metrics[0])
    assert m[CLIP_BIAS_NORM] > 0.25  # so τ = 0.25 binds: λ = τ / ‖C‖, not the preset's 0.5
    assert m[CLIP_BIAS_SCALE] == pytest.approx(0.25 / m[CLIP_BIAS_NORM], rel=1e-12)


def test_without_the_target_verl_rejects_stppo_knobs_and_the_preset_defaults_apply():
    with pytest.raises(InstantiationException, match="tau"):
        actor_from_overrides(f"{PL}.loss_mode=stppo_st_ppo", f"+{PL}.tau=0.25")
    actor = actor_from_overrides(f"{PL}.loss_mode=stppo_st_ppo")
    assert not hasattr(actor.policy_loss, "tau")
    _, metrics, _ = run_ppo_loss(actor, make_batch(seed=11), micro=8)
    m = floats(metrics[0])
    tau = PRESETS["st_ppo"].tau
    assert m[CLIP_BIAS_SCALE] == pytest.approx(min(1.0, tau / m[CLIP_BIAS_NORM]), rel=1e-12)


@pytest.mark.parametrize("overrides,message", [
    ((f"+{PL}.estimator=grad",), "estimator=grad: clip-bias estimator 'grad' needs the policy "
                                 "parameters, which verl does not pass"),
    ((f"+{PL}.tau=-1",), r"actor.policy_loss \(stppo_st_ppo\): clip_bias.tau must be a number"),
    ((f"+{PL}.granularity=turn",), "clip_bias.granularity='turn' is not valid"),
    ((f"{PL}.loss_mode=vanilla", f"+{PL}.tau=0.3"), "act on the stppo_\\* loss modes only"),
    ((f"{PL}.loss_mode=stppo_nope",), "'stppo_nope' is not an stppo loss; allowed: stppo_ppo"),
    ((f"+{PL}.max_turns=-1",), "actor.policy_loss.max_turns must be an integer >= 0, got -1"),
])
def test_invalid_knobs_fail_at_config_time_with_one_line(overrides, message):
    with pytest.raises(InstantiationException, match=message):
        actor_from_overrides(f"{PL}._target_={TARGET}", f"{PL}.loss_mode=stppo_st_ppo",
                             *overrides)
