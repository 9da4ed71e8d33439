"""The eight algorithm presets of DESIGN.md §2 — one registry, `PRESETS`.

| preset   | ratio    | correction     | advantage | critic |
|----------|----------|----------------|-----------|--------|
| ppo      | token    | none           | gae       | yes    |
| turn_ppo | turn     | none           | gae       | yes    |
| s_ppo    | token    | clip_bias_norm | gae       | yes    |
| st_ppo   | turn     | clip_bias_norm | gae       | yes    |
| so_ppo   | turn     | clip_triggered | gae       | yes    |
| grpo     | token    | none           | grpo      | no     |
| gspo     | sequence | none           | grpo      | no     |
| so_grpo  | turn     | clip_triggered | grpo      | no     |

Defaults shared by all presets: loss_agg 'seq-mean-token-mean' (the paper's 1/|y| form); τ of the
correction from `stppo.algos.clip_bias.DEFAULT_TAU` (clip_bias_norm 0.5, clip_triggered 2.0 —
this suite's choice, the paper's values are not public), estimator 'token', granularity 'batch'.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Optional

from stppo.algos.advantages import ADVANTAGE_ESTIMATORS
from stppo.algos.aggregation import LOSS_AGGS
from stppo.algos.clip_bias import CORRECTIONS, DEFAULT_TAU, Correction
from stppo.algos.loss import policy_loss
from stppo.algos.ratios import RATIO_LEVELS
from stppo.registry import Registry

DEFAULT_LOSS_AGG = "seq-mean-token-mean"
# The keyword-only arguments of `policy_loss`: what `Preset.loss_kwargs` may fix or override.
POLICY_LOSS_KEYWORDS = frozenset(
    name for name, p in inspect.signature(policy_loss).parameters.items()
    if p.kind is inspect.Parameter.KEYWORD_ONLY)


@dataclass(frozen=True)
class Preset:
    name: str
    ratio_level: str  # RATIO_LEVELS
    correction: str  # CORRECTIONS kind
    advantage: str  # ADVANTAGE_ESTIMATORS
    uses_critic: bool
    loss_agg: str = DEFAULT_LOSS_AGG  # LOSS_AGGS
    tau: Optional[float] = None  # correction τ; None → DEFAULT_TAU[correction]

    def __post_init__(self) -> None:
        for field, value, reg in (("ratio_level", self.ratio_level, RATIO_LEVELS),
                                  ("correction", self.correction, CORRECTIONS),
                                  ("advantage", self.advantage, ADVANTAGE_ESTIMATORS),
                                  ("loss_agg", self.loss_agg, LOSS_AGGS)):
            if value not in reg:
                raise ValueError(f"preset {self.name!r}: {field}={value!r} is not valid; "
                                 f"allowed: {', '.join(reg)}")
        if self.tau is None:
            object.__setattr__(self, "tau", DEFAULT_TAU[self.correction])

    def correction_spec(self, tau: Optional[float] = None, estimator: str = "token",
                        granularity: str = "batch") -> Optional[Correction]:
        """The `correction` argument of `policy_loss` (None for 'none'); τ None → the preset's.
        Invalid knobs raise `Correction`'s one-line ValueError."""
        if self.correction == "none":
            return None
        return Correction(self.correction, self.tau if tau is None else tau, estimator,
                          granularity)

    def loss_kwargs(self, **overrides: Any) -> dict[str, Any]:
        """Every `policy_loss` keyword this preset fixes (ratio_level, loss_agg, correction),
        updated with `overrides` — any keyword of `policy_loss` (clip_low, clip_high, dual_clip,
        a `correction_spec(...)` with other knobs, ...). An unknown name raises ValueError listing
        the valid ones. Callers outside the trainer (the verl plugin) build their call from this,
        so a new preset needs no change there."""
        allowed = POLICY_LOSS_KEYWORDS
        unknown = sorted(set(overrides) - allowed)
        if unknown:
            raise ValueError(f"preset {self.name!r}: {', '.join(unknown)} not keyword(s) of "
                             f"policy_loss; allowed: {', '.join(sorted(allowed))}")
        out = {"ratio_level": self.ratio_level, "loss_agg": self.loss_agg,
               "correction": self.correction_spec()}
        out.update(overrides)
        return out


PRESETS: Registry[Preset] = Registry("algo preset")


def register_preset(preset: Preset) -> Preset:
    """Add a preset under its name; a name registered twice raises ValueError."""
    return PRESETS.register(preset.name, preset)


for _row in (
    ("ppo", "token", "none", "gae", True),
    ("turn_ppo", "turn", "none", "gae", True),
    ("s_ppo", "token", "clip_bias_norm", "gae", True),
    ("st_ppo", "turn", "clip_bias_norm", "gae", True),
    ("so_ppo", "turn", "clip_triggered", "gae", True),
    ("grpo", "token", "none", "grpo", False),
    ("gspo", "sequence", "none", "grpo", False),
    ("so_grpo", "turn", "clip_triggered", "grpo", False),
):
    register_preset(Preset(*_row))
