"""Hydra's search path plus the preset folders of the installed stppo plugins (`stppo.plugins`):
registered in the `hydra.plugins` entry-point group (pyproject.toml), so `algo=<plugin preset>`
composes without `hydra.searchpath`."""

from __future__ import annotations

from hydra.core.config_search_path import ConfigSearchPath
from hydra.plugins.search_path_plugin import SearchPathPlugin

from stppo.plugins import conf_folders


class StppoSearchPath(SearchPathPlugin):
    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        for folder in conf_folders():
            search_path.append(provider="stppo-plugin", path=folder)
