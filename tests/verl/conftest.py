"""Tests that need verl run in .venv-verl (`make test` does: `.venv-verl/bin/python -m pytest
tests/verl`). Without verl this conftest fails the run loudly — never a silent skip."""

from __future__ import annotations

import copy

import pytest

try:
    import verl  # loads the verl.plugins entry points, as in a real run
    if getattr(verl, "__file__", None) is None:  # only this folder, seen as a namespace package
        raise ModuleNotFoundError("No module named 'verl' (only the tests/verl folder)")
except Exception as exc:  # noqa: BLE001
    raise ImportError(f"tests/verl need verl 0.9.1 ({type(exc).__name__}: {exc}): run `make "
                      "verl-env`, then `.venv-verl/bin/python -m pytest tests/verl`") from exc

from omegaconf import open_dict  # noqa: E402 (verl's dependency)

from stppo.integrations.verl.config import TARGET  # noqa: E402


@pytest.fixture(scope="session")
def verl_cfg():
    """verl's own `ppo_trainer` config, composed by Hydra as `verl.trainer.main_ppo` does."""
    from hydra import compose, initialize_config_module

    with initialize_config_module("verl.trainer.config", version_base=None):
        return compose("ppo_trainer", overrides=[
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
            f"actor_rollout_ref.actor.policy_loss._target_={TARGET}"])


@pytest.fixture
def actor_config(verl_cfg):
    """actor_config(loss_mode, loss_agg_mode='token-mean', **knobs) → verl's actor config
    dataclass, built from the composed node by verl's `omega_conf_to_dataclass` (as its workers
    do); knobs are `policy_loss` keys (tau, estimator, granularity) or actor keys (clip_ratio_*)."""
    from verl.utils.config import omega_conf_to_dataclass

    def make(loss_mode: str, loss_agg_mode: str = "token-mean", **knobs):
        node = copy.deepcopy(verl_cfg).actor_rollout_ref.actor  # interpolations need the root
        with open_dict(node):
            node.policy_loss.loss_mode = loss_mode
            node.loss_agg_mode = loss_agg_mode
            for k, v in knobs.items():
                (node if k.startswith("clip_ratio") else node.policy_loss)[k] = v
        return omega_conf_to_dataclass(node)
    return make
