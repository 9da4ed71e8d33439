"""turn_drift: an stppo plugin (docs/extending.md) — one loss mode and two presets.

Installed, its entry point (`stppo.plugins`, pyproject.toml) makes stppo import this module,
which registers the loss mode `turn_drift` (`turn_drift.loss`) and the presets below, in the
shape of the built-in ones (`stppo.algos.presets`); `conf/algo/<preset>.yaml` names each:

    python run.py algo=turn_drift
"""

from stppo.algos import Preset, register_preset

from turn_drift.loss import turn_drift  # noqa: F401  (registers the loss mode)

# name, ratio level, clip-bias kind, advantage, critic — and what else the preset fixes
register_preset(Preset("turn_drift", "token", "none", "grpo", False, loss_mode="turn_drift",
                       options={"beta": 0.1}))
register_preset(Preset("turn_drift_strong", "token", "none", "grpo", False, loss_mode="turn_drift",
                       options={"beta": 0.5}))
