"""stppo inside verl (docs/design.md §7): policy losses, search tool, data, reward, launcher.

- `losses`: every preset's policy loss with verl's policy-loss signature (torch + stppo.algos).
- `plugin`: registers them in verl's policy-loss registry as `stppo_<preset>`; the target of the
  `verl.plugins` entry point in pyproject.toml, so a plain `import verl` loads it.
- `config`: `StppoPolicyLossConfig`, verl's `PolicyLossConfig` plus stppo's clip-bias knobs
  (tau, estimator, granularity), named by `actor_rollout_ref.actor.policy_loss._target_`.
- `tool`, `data`, `reward`: the search tool, the parquet converter and `compute_score` (verl side).
- `overrides`, `launcher`, `monitor`, `metrics`: `backend=verl` — the composed stppo config as
  verl overrides, the `verl.trainer.main_ppo` subprocess, the run monitor (stppo side, no verl).

Importing this package imports neither torch nor verl: a launcher composing verl's overrides
takes the names below from here.
"""

LOSS_PREFIX = "stppo_"
POLICY_LOSS_TARGET = "stppo.integrations.verl.config.StppoPolicyLossConfig"


def loss_mode(preset: str) -> str:
    """verl's `actor_rollout_ref.actor.policy_loss.loss_mode` of an stppo preset."""
    return LOSS_PREFIX + preset
