"""A researcher's package of stabilisers (docs/extending.md): found by its entry point.

A package declares one entry point in the group `stppo.plugins`, its name the package's, its
value a module:

    [project.entry-points."stppo.plugins"]
    turn_drift = "turn_drift"

Importing that module registers the package's loss modes (`stppo.algos.contract.loss_mode`, the
decorator of the built-in ones) and its presets (`stppo.algos.presets.register_preset`, each a
`Preset` as the built-in ones are). Its preset folder — the `conf` subpackage of the module's
package, with `algo/<preset>.yaml` naming each preset as `conf/algo/<preset>.yaml` names a
built-in one — joins
Hydra's search path (`StppoSearchPath`, registered in the `hydra.plugins` group), so after
`pip install` `python run.py algo=turn_drift` works as for a built-in preset, on both backends.

A package that is not installed (a plain folder) keeps Hydra's search path
(`hydra.searchpath=[file://…]`) and names the module to import in its preset file
(`plugin: my_pkg.presets`, `stppo.config.AlgoConfig.plugin`).

A plugin that fails to import is one line naming it, and no run starts.
"""

from __future__ import annotations

import importlib
import importlib.util
from functools import lru_cache
from importlib.metadata import entry_points

GROUP = "stppo.plugins"


class PluginError(ValueError):
    """A plugin that cannot be loaded (one line)."""


def import_plugin(module: str, what: str) -> None:
    """Import a plugin module; a failure is one `PluginError` line naming `what`."""
    try:
        importlib.import_module(module)
    except Exception as e:  # noqa: BLE001 - any failure of the user's package is one line
        raise PluginError(f"{what}: module {module!r} cannot be imported ({type(e).__name__}: {e})") from None


@lru_cache(maxsize=1)
def _entry_points() -> tuple[tuple[str, str], ...]:
    return tuple(sorted((ep.name, ep.value) for ep in entry_points(group=GROUP)))


def load_plugins() -> tuple[str, ...]:
    """Import every installed plugin (idempotent); returns their names."""
    for name, module in _entry_points():
        import_plugin(module, f"stppo plugin {name!r} (entry point group {GROUP})")
    return tuple(name for name, _ in _entry_points())


def conf_folders() -> list[str]:
    """`pkg://<package>.conf` of every installed plugin whose package has a `conf` folder."""
    out = []
    for _, module in _entry_points():
        package = module.split(":")[0].rsplit(".", 1)[0] if "." in module else module
        try:
            found = importlib.util.find_spec(f"{package}.conf") is not None
        except (ImportError, ValueError):
            found = False
        if found:
            out.append(f"pkg://{package}.conf")
    return out
