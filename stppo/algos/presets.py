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

The baselines people compare against (DESIGN.md §2; `loss_mode` of `stppo.algos.baselines`), none
with a critic. Where a preset fixes the clip range (ε_low/ε_high), loss_agg or options, so does
its conf/algo/<name>.yaml:

| preset       | ratio    | loss_mode | advantage    | fixes                                          |
|--------------|----------|-----------|--------------|------------------------------------------------|
| dapo         | token    | clip      | grpo         | ε 0.2/0.28, token-mean, dynamic sampling, overlong shaping |
| cispo        | token    | cispo     | grpo         | ε 0.99/0.28 (no lower bound, MiniMax-M1), token-mean |
| gmpo         | sequence | gmpo      | grpo         | ε 0.4/0.4 in log space (GMPO)                  |
| sapo         | token    | sapo      | grpo         | τ_pos 1.0, τ_neg 1.05 (SAPO; verl)             |
| clip_cov     | token    | clip_cov  | grpo         | token-mean; ratio 2e-4, bounds (1, 5) (verl)   |
| kl_cov       | token    | kl_cov    | grpo         | token-mean; ratio 2e-4, coef 0.1 (verl)        |
| bapo         | token    | bapo      | grpo         | a⁻ 0.6, a⁺ 1.2 (ε 0.4/0.2), token-mean; ρ₀ 0.4, b⁻ 0.9, b⁺ 3.0 |
| rloo         | token    | clip      | rloo         | —                                              |
| reinforce_pp | token    | clip      | reinforce_pp | —                                              |
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping, Optional

from stppo.algos.advantages import ADVANTAGE_ESTIMATORS
from stppo.algos.aggregation import LOSS_AGGS
from stppo.algos.baselines import check_loss_mode
from stppo.algos.clip_bias import CORRECTIONS, DEFAULT_TAU, Correction
from stppo.algos.policy import policy_loss
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
    loss_mode: str = "clip"  # stppo.algos.baselines.LOSS_MODES
    options: Optional[Mapping[str, float]] = field(default=None, hash=False)  # → all resolved
    clip_low: Optional[float] = None  # ε_low the preset fixes; None: the caller's
    clip_high: Optional[float] = None  # ε_high the preset fixes; None: the caller's
    dynamic_sampling: bool = False  # DAPO's (conf: algo.dynamic_sampling.enabled)
    overlong: bool = False  # DAPO's overlong reward shaping (conf: algo.overlong.enabled)

    def __post_init__(self) -> None:
        for name, value, reg in (("ratio_level", self.ratio_level, RATIO_LEVELS),
                                 ("correction", self.correction, CORRECTIONS),
                                 ("advantage", self.advantage, ADVANTAGE_ESTIMATORS),
                                 ("loss_agg", self.loss_agg, LOSS_AGGS)):
            if value not in reg:
                raise ValueError(f"preset {self.name!r}: {name}={value!r} is not valid; "
                                 f"allowed: {', '.join(reg)}")
        if self.tau is None:
            object.__setattr__(self, "tau", DEFAULT_TAU[self.correction])
        try:
            opts = check_loss_mode(self.loss_mode, ratio_level=self.ratio_level,
                                   correction_kind=self.correction, options=self.options)
        except ValueError as e:
            raise ValueError(f"preset {self.name!r}: {e}") from None
        object.__setattr__(self, "options", MappingProxyType(opts))

    def correction_spec(self, tau: Optional[float] = None, estimator: str = "token",
                        granularity: str = "batch") -> Optional[Correction]:
        """The `correction` argument of `policy_loss` (None for 'none'); τ None → the preset's.
        Invalid knobs raise `Correction`'s one-line ValueError."""
        if self.correction == "none":
            return None
        return Correction(self.correction, self.tau if tau is None else tau, estimator,
                          granularity)

    def loss_kwargs(self, **overrides: Any) -> dict[str, Any]:
        """Every `policy_loss` keyword this preset fixes (ratio_level, loss_agg, correction,
        loss_mode, options, and clip_low / clip_high where it fixes them), updated with
        `overrides` — any keyword of `policy_loss` (clip_low, clip_high, dual_clip, a
        `correction_spec(...)` with other knobs, ...). An unknown name raises ValueError listing
        the valid ones. Callers outside the trainer (the verl plugin) build their call from this,
        so a new preset needs no change there."""
        allowed = POLICY_LOSS_KEYWORDS
        unknown = sorted(set(overrides) - allowed)
        if unknown:
            raise ValueError(f"preset {self.name!r}: {', '.join(unknown)} not keyword(s) of "
                             f"policy_loss; allowed: {', '.join(sorted(allowed))}")
        out = {"ratio_level": self.ratio_level, "loss_agg": self.loss_agg,
               "correction": self.correction_spec()}
        if self.loss_mode != "clip":
            out.update(loss_mode=self.loss_mode, options=dict(self.options))
        out.update({k: v for k, v in (("clip_low", self.clip_low), ("clip_high", self.clip_high))
                    if v is not None})
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

# The baselines (module docstring): name, ratio level, advantage, and what else each fixes.
TOKEN_MEAN = "token-mean"
for _name, _level, _adv, _fixed in (
    ("dapo", "token", "grpo", dict(clip_low=0.2, clip_high=0.28, loss_agg=TOKEN_MEAN,
                                   dynamic_sampling=True, overlong=True)),
    ("cispo", "token", "grpo", dict(loss_mode="cispo", clip_low=0.99, clip_high=0.28,
                                    loss_agg=TOKEN_MEAN)),
    ("gmpo", "sequence", "grpo", dict(loss_mode="gmpo", clip_low=0.4, clip_high=0.4)),
    ("sapo", "token", "grpo", dict(loss_mode="sapo", options={"tau_pos": 1.0, "tau_neg": 1.05})),
    ("clip_cov", "token", "grpo", dict(loss_mode="clip_cov", loss_agg=TOKEN_MEAN)),
    ("kl_cov", "token", "grpo", dict(loss_mode="kl_cov", loss_agg=TOKEN_MEAN)),
    ("bapo", "token", "grpo", dict(loss_mode="bapo", clip_low=0.4, clip_high=0.2,
                                   loss_agg=TOKEN_MEAN)),
    ("rloo", "token", "rloo", {}),
    ("reinforce_pp", "token", "reinforce_pp", {}),
):
    register_preset(Preset(_name, _level, "none", _adv, False, **_fixed))
