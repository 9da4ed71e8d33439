"""`LossSpec`: everything that fixes a run's policy loss, validated once (docs/design.md §2).

A preset (`stppo.algos.presets`) is a partial LossSpec: the fields one named loss fixes; a run's
`algo` config turns it — with the run's overrides (clip range, τ, options, …) — into one frozen
`LossSpec` at start (`stppo.config.AlgoConfig.spec`). Every default of a loss is written once:
the fields' here, a loss mode's options in its `@loss_mode` declaration, a clip-bias kind's τ
in its registration (`stppo.algos.clip_bias`). The own trainer, data parallelism, the verl plugin and
every check read that object; `policy_loss(..., spec)` takes it, and a loss mode reads its
fields (`stppo.algos.contract`). An invalid value — a field out of range, or one the loss mode
does not declare it can take (ratio level, dual clip, clip-bias scale, options) — is one
`ValueError` naming the field (`algo.<field>`), raised here and nowhere else.
"""

from __future__ import annotations

import dataclasses
import numbers
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping, Optional, Union

from stppo.algos.advantages import ADVANTAGE_ESTIMATORS, OLD_POLICY_ESTIMATORS
from stppo.algos.aggregation import LOSS_AGGS
from stppo.algos.clip_bias import CLIP_BIAS_KINDS, ClipBias
from stppo.algos.ratios import RATIO_LEVELS
from stppo.algos.rollout_corr import RolloutCorrection

DEFAULT_LOSS_AGG = "seq-mean-token-mean"
DEFAULT_CLIP = 0.2
# the others need a critic
CRITIC_FREE_ADVANTAGES = ("grpo", "rloo", "reinforce_pp", "tir_optimal_token_baseline")
REINFORCE = "reinforce"  # the loss mode of a bypass REINFORCE correction


def _fail(name: str, message: str) -> None:
    raise ValueError(f"algo.{name}{message}")


def _one_of(name: str, value: Any, allowed) -> None:
    if value not in allowed:
        _fail(name, f"={value!r} is not valid; allowed: {', '.join(map(str, allowed))}")


def _number(x: Any) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


@dataclass(frozen=True)
class LossSpec:
    """A run's policy loss. `clip_bias`: None or a `ClipBias` (kind, τ, estimator,
    granularity; a kind's name is read as `ClipBias(kind)`); `options`: the loss mode's resolved
    options (its defaults updated with the given ones); `advantage` and `use_critic`: the
    estimator that feeds the loss. `runs` is the loss mode that runs: `loss_mode`, or
    `reinforce` under a bypass rollout correction with loss_type 'reinforce'."""

    name: str
    ratio_level: str = "token"
    clip_low: float = DEFAULT_CLIP
    clip_high: float = DEFAULT_CLIP
    dual_clip: Optional[float] = None
    loss_agg: str = DEFAULT_LOSS_AGG
    clip_bias: Union[ClipBias, str, None] = None
    loss_mode: str = "clip"
    options: Mapping[str, float] = field(default_factory=dict, hash=False)
    rollout_correction: RolloutCorrection = RolloutCorrection()
    advantage: str = "gae"
    use_critic: bool = True

    def __post_init__(self) -> None:
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
        if isinstance(self.clip_bias, str):
            _one_of("clip_bias.kind", self.clip_bias, tuple(CLIP_BIAS_KINDS))
            object.__setattr__(self, "clip_bias", ClipBias(self.clip_bias))
        if self.clip_bias is not None and not isinstance(self.clip_bias, ClipBias):
            raise ValueError(f"algo.clip_bias must be a ClipBias, a kind or None, got "
                             f"{type(self.clip_bias).__name__}")
        if self.clip_bias is not None and self.clip_bias.kind == "none":
            object.__setattr__(self, "clip_bias", None)
        if not isinstance(self.rollout_correction, RolloutCorrection):
            raise ValueError(f"algo.rollout_correction must be a RolloutCorrection, got "
                             f"{type(self.rollout_correction).__name__}")
        rc = self.rollout_correction
        if rc.mode == "bypass" and self.advantage in OLD_POLICY_ESTIMATORS:
            _fail("rollout_correction", f"={rc.name} takes the sampler's log-probs as π_old (no "
                  f"old-policy forward), but advantage={self.advantage} reads that forward's "
                  f"Σπ²: use a decoupled correction (e.g. decoupled_token_is) or none")
        self._check_mode()

    def _check_mode(self) -> None:
        """The loss mode that runs (`runs`) takes this spec: what its `@loss_mode` declares it
        can take (ratio level, clip-bias scale, dual clip, options), the options resolved."""
        from stppo.algos.modes import LOSS_MODES, resolve_options

        _one_of("loss_mode", self.loss_mode, tuple(LOSS_MODES))
        rc = self.rollout_correction
        plain = (self.ratio_level, self.clip_bias) == ("token", None)
        if rc.reinforce and not (plain and self.loss_mode in ("clip", REINFORCE)):
            _fail("rollout_correction", f"={rc.name} replaces the policy loss with verl's bypass "
                  f"REINFORCE loss (no ratio, no clip); it needs a preset on the plain clip path "
                  f"(loss_mode clip, ratio_level token, no clip_bias), got loss_mode "
                  f"{self.loss_mode}, ratio_level {self.ratio_level}, clip_bias {self.clip_bias_kind}")
        name = self.runs
        mode = LOSS_MODES[name]
        if self.ratio_level not in mode.ratio_levels:
            raise ValueError(f"algo: loss_mode={name!r} is defined at ratio_level "
                             f"{' | '.join(mode.ratio_levels)}, got {self.ratio_level!r}")
        if self.clip_bias is not None and not mode.clip_bias:
            raise ValueError(f"algo: loss_mode={name!r} takes no clip-bias scale (got "
                             f"{self.clip_bias.kind!r}); the scales apply to loss_mode='clip'")
        if self.dual_clip is not None and not mode.dual_clip:
            raise ValueError(f"algo: loss_mode={name!r} has no dual clip; set dual_clip to null")
        try:
            opts = resolve_options(name, dict(self.options))
        except ValueError as e:
            raise ValueError(f"algo: {e}") from None
        object.__setattr__(self, "options", MappingProxyType(opts))

    @property
    def runs(self) -> str:
        """The loss mode that runs: `loss_mode`, or `reinforce` — verl's bypass-mode REINFORCE
        loss, which replaces the plain clip path — under a bypass rollout correction with
        loss_type 'reinforce' (`RolloutCorrection.reinforce`)."""
        return REINFORCE if self.rollout_correction.reinforce else self.loss_mode

    @property
    def clip_bias_kind(self) -> str:
        return "none" if self.clip_bias is None else self.clip_bias.kind

    @property
    def separable(self) -> bool:
        """Whether the loss of a batch is the sum of its parts' losses under the batch's
        denominators (gradient accumulation may backward each part's own share): no statistic
        of the whole batch enters a token's term — no single λ of a clip-bias scale (granularity
        'batch'), no batch-level choice of the loss mode (`LossMode.separable`)."""
        from stppo.algos.modes import LOSS_MODES

        c = self.clip_bias
        return (LOSS_MODES[self.runs].separable and (c is None or c.granularity == "sequence")
                and not self.rollout_correction.batch_normalized_weights)

    def replace(self, **changes: Any) -> "LossSpec":
        """A copy with `changes` (validated again)."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """Plain values (JSON-able): what travels to verl's workers (`from_dict` inverts it)."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["clip_bias"] = None if self.clip_bias is None else dataclasses.asdict(self.clip_bias)
        d["rollout_correction"] = self.rollout_correction.to_dict()
        d["options"] = dict(self.options)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "LossSpec":
        d = dict(d)
        c = d.get("clip_bias")
        d["clip_bias"] = None if c is None else ClipBias(**c)
        d["rollout_correction"] = RolloutCorrection(**(d.get("rollout_correction") or {}))
        return cls(**d)


# The fields a run's config may set one by one (`stppo.config.AlgoConfig`: null = the preset's);
# the others have a shape of their own there (the clip bias's group, the options' mapping, the
# rollout correction's name and options).
PLAIN_FIELDS: tuple[str, ...] = tuple(
    f.name for f in dataclasses.fields(LossSpec)
    if f.name not in ("name", "clip_bias", "options", "rollout_correction"))
