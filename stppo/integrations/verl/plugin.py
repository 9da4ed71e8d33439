"""verl plugin: registers every stppo preset's policy loss in verl's registry as `stppo_<preset>` —
the built-in presets and those of the installed stppo plugins (`stppo.plugins`, loaded first).

The target of the `verl.plugins` entry point (pyproject.toml): verl ≥ 0.9 loads it in every
process that imports `verl` (driver and Ray workers), unless `VERL_USE_EXTERNAL_PLUGINS=none`.
Importing `stppo.integrations.verl.config` (the `_target_` of the policy-loss config) loads it too.

verl logs a plugin's load error at debug level only, so a broken plugin would show up later as
"Unsupported loss mode: stppo_…". This module's top level therefore imports only `logging`: every
other import and the registration run inside one guard that logs a WARNING naming the cause, then
re-raises (verl swallows it; a direct import sees it).
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)


def register(names=None) -> tuple[str, ...]:
    """Register `stppo_<name>` for each of `names` (default: every name in
    `stppo.algos.PRESETS` once the installed plugins are loaded, read at load time, so a preset
    added to the registry needs no change here; a plain-folder plugin's preset is registered by
    its policy-loss config, `config.py`).
    Registering again is a no-op for stppo's own losses; a name held by another loss raises
    ValueError. Returns the registered names."""
    from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY, register_policy_loss

    from stppo.algos import PRESETS
    from stppo.integrations.verl import loss_mode
    from stppo.integrations.verl.losses import make_verl_loss
    from stppo.plugins import load_plugins

    load_plugins()
    out = []
    for preset in (PRESETS if names is None else names):
        name = loss_mode(preset)
        held = POLICY_LOSS_REGISTRY.get(name)
        if held is not None and getattr(held, "stppo_preset", None) != preset:
            raise ValueError(f"verl's policy loss {name!r} is already registered by "
                             f"{getattr(held, '__module__', held)!r}")
        if held is None:
            register_policy_loss(name)(make_verl_loss(preset))
        out.append(name)
    return tuple(out)


try:
    LOSS_MODES = register()
except Exception as exc:  # noqa: BLE001 — reported, then re-raised
    log.warning("stppo's verl plugin failed to load (%s: %s): the stppo_* policy losses are NOT "
                "registered and loss_mode=stppo_<preset> will fail with 'Unsupported loss mode'",
                type(exc).__name__, exc)
    raise
