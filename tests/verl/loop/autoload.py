"""TEST-ONLY: the module `VERL_USE_EXTERNAL_MODULES` names; importing it runs `loop.plugin.load()`."""

from loop.plugin import load

load()
