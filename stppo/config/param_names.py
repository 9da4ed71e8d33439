"""The MLflow params the analysis reads, named once (docs/design.md §4).

A run logs its whole config as params, `flatten(asdict(cfg))`: the key of a setting is its dotted
path in the schema (`stppo.config.Config`). Each constant below is checked against the schema
when this module is imported, so a renamed field fails here, not silently in a study.

`legacy` is the value a run logged before the setting existed reads as (the setting's default
then, e.g. on-policy for `trainer.offpolicy.lag`); such a run logged none of the keys under
`since` (the section the setting came with). A run that lacks a key without `legacy`, or lacks
it while it logged its section, is an error (`analysis.params.param_column`), not a default.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from typing import Optional

from stppo.config.schema import Config


@dataclass(frozen=True)
class ParamKey:
    path: str  # the dotted path in the schema, the MLflow param key
    legacy: Optional[str] = None  # the value of runs logged before the setting existed
    since: Optional[str] = None  # key prefix of the section it came with (default: its parent's)

    @property
    def section(self) -> str:
        return self.since if self.since is not None else self.path.rsplit(".", 1)[0] + "."


def schema_field(path: str) -> dataclasses.Field:
    """The field of `Config` at dotted `path`; KeyError naming the first part that is not one."""
    cls, field = Config, None
    for part in path.split("."):
        if cls is None or not dataclasses.is_dataclass(cls):
            raise KeyError(f"param key {path!r}: {field.name!r} has no fields")
        fields = {f.name: f for f in dataclasses.fields(cls)}
        if part not in fields:
            raise KeyError(f"param key {path!r}: {cls.__name__} has no field {part!r}")
        field = fields[part]
        hint = typing.get_type_hints(cls)[part]
        cls = hint if dataclasses.is_dataclass(hint) else None
    return field


def param_key(path: str, legacy: Optional[str] = None, since: Optional[str] = None) -> ParamKey:
    schema_field(path)
    return ParamKey(path, legacy, since)


SEED = param_key("seed")
ALGO = param_key("algo.name")
MODEL = param_key("model.name")
ACTOR_LR = param_key("trainer.actor_lr")
PPO_EPOCHS = param_key("trainer.ppo_epochs")
MINIBATCH_SIZE = param_key("trainer.minibatch_size")
DEVICE = param_key("trainer.device")
LAG = param_key("trainer.offpolicy.lag", legacy="0")
LAG_MODE = param_key("trainer.offpolicy.lag_mode", legacy="fixed")
ROLLOUT_CORRECTION = param_key("algo.rollout_correction", legacy="none", since="algo.rollout_correction")
CRITIC_WARMSTART = param_key("trainer.critic_warmstart.enabled", legacy="False")
COLLAPSE = "trainer.collapse."  # the collapse rule's section (stppo.diagnostics.CollapseConfig)
schema_field(COLLAPSE.rstrip("."))
