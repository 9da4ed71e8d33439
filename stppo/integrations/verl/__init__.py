"""stppo inside verl (docs/design.md, "verl backend").

- `losses`: every preset's policy loss with verl's policy-loss signature (torch + stppo.algos).
- `plugin`: registers them in verl's policy-loss registry as `stppo_<preset>`; the target of the
  `verl.plugins` entry point in pyproject.toml, so a plain `import verl` loads it.
- `config`: `StppoPolicyLossConfig`, verl's `PolicyLossConfig` plus stppo's correction knobs
  (tau, estimator, granularity); name it as `actor_rollout_ref.actor.policy_loss._target_`
  (`stppo.integrations.verl.config.TARGET`).

Importing this package imports neither torch nor verl.
"""
