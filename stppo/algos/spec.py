"""`LossSpec`: everything that fixes a run's policy loss, validated once (docs/design.md §2).

A preset (`stppo.algos.presets`) is the one definition of a named loss; a run's `algo` config
turns it — with the run's overrides (clip range, τ, options, …) — into one frozen `LossSpec` at
start (`stppo.config.AlgoConfig.spec`). The own trainer, data parallelism, the verl plugin and
every check read that object; `policy_loss(..., spec)` takes it. An invalid value is one
`ValueError` naming the field (`algo.<field>`), raised here and nowhere else.
"""

from __future__ import annotations

import dataclasses
import numbers
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping, Optional

from stppo.algos.advantages import ADVANTAGE_ESTIMATORS
from stppo.algos.aggregation import LOSS_AGGS
from stppo.algos.clip_bias import Correction
from stppo.algos.ratios import RATIO_LEVELS
from stppo.algos.rollout_is import ROLLOUT_IS_KINDS

DEFAULT_LOSS_AGG = "seq-mean-token-mean"
DEFAULT_CLIP = 0.2
# the others need a critic
CRITIC_FREE_ADVANTAGES = ("grpo", "rloo", "reinforce_pp", "tir_optimal_token_baseline")


def _fail(name: str, message: str) -> None:
    raise ValueError(f"algo.{name}{message}")


def _one_of(name: str, value: Any, allowed) -> None:
    if value not in allowed:
        _fail(name, f"={value!r} is not valid; allowed: {', '.join(map(str, allowed))}")


def _number(x: Any) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


@dataclass(frozen=True)
class RolloutIS:
    """Truncated importance sampling between the sampler's and the trainer's log-probs (verl's
    `algorithm.rollout_correction` rollout_is / rollout_is_threshold): ω = min(π_old/π_rollout, C)."""

    kind: str = "none"  # none | token
    threshold: float = 2.0  # C

    def __post_init__(self) -> None:
        _one_of("rollout_is.kind", self.kind, ROLLOUT_IS_KINDS)
        if not (_number(self.threshold) and self.threshold > 0):
            _fail("rollout_is.threshold", f" must be > 0, got {self.threshold}")


@dataclass(frozen=True)
class LossSpec:
    """A run's policy loss. `correction`: None or a `Correction` (kind, τ, estimator,
    granularity); `options`: the loss mode's resolved options (its defaults updated with the
    given ones); `advantage` and `use_critic`: the estimator that feeds the loss."""

    name: str
    ratio_level: str = "token"
    clip_low: float = DEFAULT_CLIP
    clip_high: float = DEFAULT_CLIP
    dual_clip: Optional[float] = None
    loss_agg: str = DEFAULT_LOSS_AGG
    correction: Optional[Correction] = None
    loss_mode: str = "clip"
    options: Mapping[str, float] = field(default_factory=dict, hash=False)
    rollout_is: RolloutIS = RolloutIS()
    advantage: str = "gae"
    use_critic: bool = True

    def __post_init__(self) -> None:
        from stppo.algos.modes import LOSS_MODES, check_loss_mode

        _one_of("ratio_level", self.ratio_level, RATIO_LEVELS)
        _one_of("loss_agg", self.loss_agg, LOSS_AGGS)
        _one_of("advantage", self.advantage, ADVANTAGE_ESTIMATORS)
        if not (_number(self.clip_low) and 0.0 <= self.clip_low < 1.0):
            _fail("clip_low", f" must be in [0, 1), got {self.clip_low}")
        if not (_number(self.clip_high) and self.clip_high > 0.0):
            _fail("clip_high", f" must be > 0, got {self.clip_high}")
        if self.dual_clip is not None and not (_number(self.dual_clip) and self.dual_clip > 1.0):
            _fail("dual_clip", f" must be null or > 1, got {self.dual_clip}")
        if not (self.advantage in CRITIC_FREE_ADVANTAGES or self.use_critic):
            _fail("advantage", f"={self.advantage} needs a critic: set algo.use_critic=true")
        if self.correction is not None and not isinstance(self.correction, Correction):
            raise ValueError(f"algo.correction must be a Correction or None, got "
                             f"{type(self.correction).__name__}")
        if self.correction is not None and self.correction.kind == "none":
            object.__setattr__(self, "correction", None)
        if not isinstance(self.rollout_is, RolloutIS):
            raise ValueError(f"algo.rollout_is must be a RolloutIS, got {type(self.rollout_is).__name__}")
        _one_of("loss_mode", self.loss_mode, tuple(LOSS_MODES))
        try:
            opts = check_loss_mode(self.loss_mode, ratio_level=self.ratio_level,
                                   correction_kind=self.correction_kind, dual_clip=self.dual_clip,
                                   options=dict(self.options))
        except ValueError as e:
            raise ValueError(f"algo: {e}") from None
        object.__setattr__(self, "options", MappingProxyType(opts))

    @property
    def correction_kind(self) -> str:
        return "none" if self.correction is None else self.correction.kind

    @property
    def separable(self) -> bool:
        """Whether the loss of a batch is the sum of its parts' losses under the batch's
        denominators (gradient accumulation may backward each part's own share): no statistic
        of the whole batch enters a token's term — no single λ of a correction (granularity
        'batch'), no batch-level choice of the loss mode (`LossMode.separable`)."""
        from stppo.algos.modes import LOSS_MODES

        c = self.correction
        return LOSS_MODES[self.loss_mode].separable and (c is None or c.granularity == "sequence")

    def replace(self, **changes: Any) -> "LossSpec":
        """A copy with `changes` (validated again)."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """Plain values (JSON-able): what travels to verl's workers (`from_dict` inverts it)."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["correction"] = None if self.correction is None else dataclasses.asdict(self.correction)
        d["rollout_is"] = dataclasses.asdict(self.rollout_is)
        d["options"] = dict(self.options)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "LossSpec":
        d = dict(d)
        c = d.get("correction")
        d["correction"] = None if c is None else Correction(**c)
        d["rollout_is"] = RolloutIS(**(d.get("rollout_is") or {}))
        return cls(**d)
