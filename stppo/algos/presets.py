"""Every named loss, defined once — one registry, `PRESETS` (docs/design.md §2).

`conf/algo/<name>.yaml` names a preset and nothing else; a run's `algo` overrides turn the preset
into its `LossSpec` (`stppo.algos.spec`). A researcher's own presets are rows of the same shape
in their own package, registered by `register_preset` when the package is loaded (`stppo.plugins`,
docs/extending.md). The paper's eight:

| preset   | ratio    | clip_bias      | advantage | critic |
|----------|----------|----------------|-----------|--------|
| ppo      | token    | none           | gae       | yes    |
| turn_ppo | turn     | none           | gae       | yes    |
| s_ppo    | token    | clip_bias_norm | gae       | yes    |
| st_ppo   | turn     | clip_bias_norm | gae       | yes    |
| so_ppo   | turn     | clip_triggered | gae       | yes    |
| grpo     | token    | none           | grpo      | no     |
| gspo     | sequence | none           | grpo      | no     |
| so_grpo  | turn     | clip_triggered | grpo      | no     |

Defaults shared by all presets: loss_agg 'seq-mean-token-mean' (the paper's 1/|y| form), clip
range 0.2/0.2; τ of the clip-bias scale from `stppo.algos.clip_bias.DEFAULT_TAU` (clip_bias_norm 0.5,
clip_triggered 2.0 — this suite's choice, the paper's values are not public), estimator 'token',
granularity 'batch'.

The losses people compare against (docs/design.md §2; their loss modes are in
`stppo.algos.baselines`), none with a critic:

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
| dppo_tv      | token    | dppo_tv   | grpo         | δ 0.15/0.15 (TV), token-mean; C 20 (DPPO; verl) |
| dppo_kl      | token    | dppo_kl   | grpo         | δ 0.05/0.05 (KL), token-mean; C 20 (DPPO; verl) |
| dro          | token    | dro       | grpo         | token-mean; β 0.05 (verl)                      |
| sspo         | token    | sspo      | grpo         | subsentence ratios, entropy-scaled ε 0.2/0.2; α 1, w ∈ [0.5, 2] |
| tir_optimal_token_baseline | token | clip | tir_optimal_token_baseline | token-mean (verl's OTB example) |

The ratio column is the level of the clip diagnostics (per-turn breakdown); SSPO's own ratio is
per subsentence. The preset `tir_optimal_token_baseline` is PPO's clip with verl's multi-turn
("tool-integrated reasoning") optimal token baseline, named after the estimator as rloo and
reinforce_pp are; any critic-free preset can also take it
(`algo.advantage=tir_optimal_token_baseline`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

from stppo.algos.clip_bias import CLIP_BIAS_KINDS, ClipBias
from stppo.algos.spec import DEFAULT_CLIP, DEFAULT_LOSS_AGG, LossSpec
from stppo.registry import Registry


@dataclass(frozen=True)
class Preset:
    """The one definition of a named loss (conf/algo/<name>.yaml only names it). Every field a
    run does not override comes from here (`stppo.config.AlgoConfig`); `spec()` is the preset's
    own `LossSpec`, validated when the preset is defined."""

    name: str
    ratio_level: str  # RATIO_LEVELS
    clip_bias: str  # CLIP_BIAS_KINDS kind
    advantage: str  # ADVANTAGE_ESTIMATORS
    use_critic: bool
    loss_agg: str = DEFAULT_LOSS_AGG  # LOSS_AGGS
    tau: Optional[float] = None  # the clip-bias scale's τ; None → the kind's default (DEFAULT_TAU)
    loss_mode: str = "clip"  # stppo.algos.modes.LOSS_MODES
    options: Optional[Mapping[str, float]] = field(default=None, hash=False)  # the mode's, over its defaults
    clip_low: float = DEFAULT_CLIP  # ε_low
    clip_high: float = DEFAULT_CLIP  # ε_high
    dual_clip: Optional[float] = None  # c > 1 for the modes that have a dual clip, or None
    dynamic_sampling: bool = False  # DAPO's (conf: algo.dynamic_sampling.enabled)
    overlong: bool = False  # DAPO's overlong reward shaping (conf: algo.overlong.enabled)

    def __post_init__(self) -> None:
        if self.clip_bias not in CLIP_BIAS_KINDS:
            raise ValueError(f"preset {self.name!r}: clip_bias={self.clip_bias!r} is not valid; "
                             f"allowed: {', '.join(CLIP_BIAS_KINDS)}")
        if self.tau is None:
            object.__setattr__(self, "tau", CLIP_BIAS_KINDS[self.clip_bias].default_tau)
        try:
            spec = self.spec()
        except ValueError as e:
            raise ValueError(f"preset {self.name!r}: {e}") from None
        object.__setattr__(self, "options", spec.options)

    def spec(self, **changes: Any) -> LossSpec:
        """The preset's `LossSpec`, with `changes` (LossSpec fields) applied."""
        base = LossSpec(
            name=self.name, ratio_level=self.ratio_level, clip_low=self.clip_low,
            clip_high=self.clip_high, dual_clip=self.dual_clip, loss_agg=self.loss_agg,
            clip_bias=None if self.clip_bias == "none" else ClipBias(self.clip_bias, self.tau),
            loss_mode=self.loss_mode, options=dict(self.options or {}), advantage=self.advantage,
            use_critic=self.use_critic)
        return base.replace(**changes) if changes else base


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
    ("dppo_tv", "token", "grpo", dict(loss_mode="dppo_tv", clip_low=0.15, clip_high=0.15,
                                      loss_agg=TOKEN_MEAN, options={"clip_ratio_c": 20.0})),
    ("dppo_kl", "token", "grpo", dict(loss_mode="dppo_kl", clip_low=0.05, clip_high=0.05,
                                      loss_agg=TOKEN_MEAN, options={"clip_ratio_c": 20.0})),
    ("dro", "token", "grpo", dict(loss_mode="dro", loss_agg=TOKEN_MEAN, options={"beta": 0.05})),
    ("sspo", "token", "grpo", dict(loss_mode="sspo", options={"entropy_alpha": 1.0,
                                                             "scale_min": 0.5, "scale_max": 2.0})),
    ("tir_optimal_token_baseline", "token", "tir_optimal_token_baseline", dict(loss_agg=TOKEN_MEAN)),
):
    register_preset(Preset(_name, _level, "none", _adv, False, **_fixed))

BUILT_IN: tuple[str, ...] = tuple(PRESETS)  # stppo's own presets (a plugin's register after these)
