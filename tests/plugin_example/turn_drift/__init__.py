"""turn_drift: an stppo plugin (docs/extending.md) — one loss mode and two presets.

Installed, its entry point (`stppo.plugins`, pyproject.toml) makes stppo import this module,
which registers the loss mode `turn_drift` (`turn_drift.loss`) and the presets below, made as the
built-in ones are (`stppo.algos.presets`): each a partial `LossSpec`, the fields it fixes (β
is the loss mode's own default, 0.1, unless a preset sets it); `conf/algo/<preset>.yaml` names
each:

    python run.py algo=turn_drift
"""

from stppo.algos import Preset, register_preset

from turn_drift.loss import turn_drift  # noqa: F401  (registers the loss mode)

register_preset(Preset("turn_drift", loss_mode="turn_drift", advantage="grpo", use_critic=False))
register_preset(Preset("turn_drift_strong", loss_mode="turn_drift", advantage="grpo", use_critic=False,
                       options={"beta": 0.5}))
