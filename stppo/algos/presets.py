"""Every named loss, defined once — one registry, `PRESETS` (docs/design.md §2).

A preset is a partial `LossSpec` (`stppo.algos.spec`): the fields it fixes; every other field
keeps LossSpec's default and a loss mode's options their `@loss_mode` defaults, so each default
is written once. `conf/algo/<name>.yaml` names a preset and nothing else; a run's `algo`
overrides turn the preset into its `LossSpec`. A researcher's own presets are `Preset`s like
these, registered by `register_preset` when their package is loaded (`stppo.plugins`,
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

What none of them fixes is LossSpec's default: loss_agg 'seq-mean-token-mean' (the paper's 1/|y|
form), clip range 0.2/0.2, no dual clip; τ of the clip-bias scale is the kind's default
(`stppo.algos.clip_bias.DEFAULT_TAU`: clip_bias_norm 0.5, clip_triggered 2.0 — this suite's
choice, the paper's values are not public), estimator 'token', granularity 'batch'.

The losses people compare against (docs/design.md §2; their loss modes are in
`stppo.algos.baselines`), none with a critic:

| preset       | ratio    | loss_mode | advantage    | fixes                                          |
|--------------|----------|-----------|--------------|------------------------------------------------|
| dapo         | token    | clip      | grpo         | ε 0.2/0.28, token-mean, dynamic sampling, overlong shaping |
| cispo        | token    | cispo     | grpo         | ε 0.99/0.28 (no lower bound, MiniMax-M1), token-mean |
| gmpo         | sequence | gmpo      | grpo         | ε 0.4/0.4 in log space (GMPO)                  |
| sapo         | token    | sapo      | grpo         | (the mode's τ_pos 1.0, τ_neg 1.05: SAPO; verl) |
| clip_cov     | token    | clip_cov  | grpo         | token-mean (the mode's ratio 2e-4, bounds (1, 5): verl) |
| kl_cov       | token    | kl_cov    | grpo         | token-mean (the mode's ratio 2e-4, coef 0.1: verl) |
| bapo         | token    | bapo      | grpo         | a⁻ 0.6, a⁺ 1.2 (ε 0.4/0.2), token-mean (the mode's ρ₀ 0.4, b⁻ 0.9, b⁺ 3.0) |
| rloo         | token    | clip      | rloo         | —                                              |
| reinforce_pp | token    | clip      | reinforce_pp | —                                              |
| dppo_tv      | token    | dppo_tv   | grpo         | δ 0.15/0.15 (TV), token-mean (the mode's C 20: DPPO; verl) |
| dppo_kl      | token    | dppo_kl   | grpo         | δ 0.05/0.05 (KL), token-mean (the mode's C 20: DPPO; verl) |
| dro          | token    | dro       | grpo         | token-mean (the mode's β 0.05: verl)           |
| sspo         | token    | sspo      | grpo         | subsentence ratios, entropy-scaled ε 0.2/0.2 (the mode's α 1, w ∈ [0.5, 2]) |
| tir_optimal_token_baseline | token | clip | tir_optimal_token_baseline | token-mean (verl's OTB example) |

The ratio column is the level of the clip diagnostics (per-turn breakdown); SSPO's own ratio is
per subsentence. The preset `tir_optimal_token_baseline` is PPO's clip with verl's multi-turn
("tool-integrated reasoning") optimal token baseline, named after the estimator as rloo and
reinforce_pp are; any critic-free preset can also take it
(`algo.advantage=tir_optimal_token_baseline`).
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any

from stppo.algos.spec import LossSpec
from stppo.registry import Registry

SPEC_FIELDS = frozenset(LossSpec.__dataclass_fields__) - {"name"}  # what a preset may fix


class Preset:
    """A named loss: `fixes`, the `LossSpec` fields it sets (a partial LossSpec; the rest keep
    their defaults), and DAPO's trainer-side pieces (`dynamic_sampling`, `overlong`: conf
    `algo.dynamic_sampling.enabled`, `algo.overlong.enabled`). Validated when it is made:

        Preset("st_ppo", ratio_level="turn", clip_bias="clip_bias_norm")

    `spec(**changes)` is its `LossSpec` with `changes` applied. Immutable."""

    __slots__ = ("name", "fixes", "dynamic_sampling", "overlong", "_spec")

    def __init__(self, name: str, *, dynamic_sampling: bool = False, overlong: bool = False,
                 **fixes: Any) -> None:
        unknown = sorted(set(fixes) - SPEC_FIELDS)
        if unknown:
            raise ValueError(f"preset {name!r}: {', '.join(unknown)} is not a LossSpec field; "
                             f"valid: {', '.join(sorted(SPEC_FIELDS))}")
        try:
            spec = LossSpec(name=name, **fixes)
        except ValueError as e:
            raise ValueError(f"preset {name!r}: {e}") from None
        for k, v in (("name", name), ("fixes", MappingProxyType(dict(fixes))),
                     ("dynamic_sampling", bool(dynamic_sampling)), ("overlong", bool(overlong)),
                     ("_spec", spec)):
            object.__setattr__(self, k, v)

    def __setattr__(self, key: str, value: Any) -> None:
        raise AttributeError(f"a Preset is immutable (preset {self.name!r}: {key})")

    def __repr__(self) -> str:
        extra = [f"{k}={v!r}" for k, v in self.fixes.items()]
        extra += [k + "=True" for k in ("dynamic_sampling", "overlong") if getattr(self, k)]
        return f"Preset({', '.join([repr(self.name), *extra])})"

    def spec(self, **changes: Any) -> LossSpec:
        """The preset's `LossSpec`, with `changes` (LossSpec fields) applied and validated."""
        return self._spec.replace(**changes) if changes else self._spec

    def __getattr__(self, key: str) -> Any:
        """Read-only views of `spec()`: every LossSpec field by its name, except that
        `clip_bias` reads as the kind's name ('none' without a scale) and `tau` as its τ (as
        the sweeps and stppo.integrations.verl read a preset)."""
        if key.startswith("_") or key not in SPEC_FIELDS | {"tau"}:
            raise AttributeError(f"Preset has no attribute {key!r}")
        spec = object.__getattribute__(self, "_spec")
        if key == "clip_bias":
            return spec.clip_bias_kind
        if key == "tau":
            return None if spec.clip_bias is None else spec.clip_bias.tau
        return getattr(spec, key)


PRESETS: Registry[Preset] = Registry("algo preset")


def register_preset(preset: Preset) -> Preset:
    """Add a preset under its name; a name registered twice raises ValueError."""
    return PRESETS.register(preset.name, preset)


# The paper's eight (module docstring)
CRITIC_FREE = dict(advantage="grpo", use_critic=False)
TOKEN_MEAN = "token-mean"
for _preset in (
    Preset("ppo"),
    Preset("turn_ppo", ratio_level="turn"),
    Preset("s_ppo", clip_bias="clip_bias_norm"),
    Preset("st_ppo", ratio_level="turn", clip_bias="clip_bias_norm"),
    Preset("so_ppo", ratio_level="turn", clip_bias="clip_triggered"),
    Preset("grpo", **CRITIC_FREE),
    Preset("gspo", ratio_level="sequence", **CRITIC_FREE),
    Preset("so_grpo", ratio_level="turn", clip_bias="clip_triggered", **CRITIC_FREE),
    # the baselines: what each fixes (a loss mode's options keep the mode's defaults)
    Preset("dapo", clip_high=0.28, loss_agg=TOKEN_MEAN, dynamic_sampling=True, overlong=True,
           **CRITIC_FREE),
    Preset("cispo", loss_mode="cispo", clip_low=0.99, clip_high=0.28, loss_agg=TOKEN_MEAN,
           **CRITIC_FREE),
    Preset("gmpo", ratio_level="sequence", loss_mode="gmpo", clip_low=0.4, clip_high=0.4,
           **CRITIC_FREE),
    Preset("sapo", loss_mode="sapo", **CRITIC_FREE),
    Preset("clip_cov", loss_mode="clip_cov", loss_agg=TOKEN_MEAN, **CRITIC_FREE),
    Preset("kl_cov", loss_mode="kl_cov", loss_agg=TOKEN_MEAN, **CRITIC_FREE),
    Preset("bapo", loss_mode="bapo", clip_low=0.4, loss_agg=TOKEN_MEAN, **CRITIC_FREE),
    Preset("rloo", advantage="rloo", use_critic=False),
    Preset("reinforce_pp", advantage="reinforce_pp", use_critic=False),
    Preset("dppo_tv", loss_mode="dppo_tv", clip_low=0.15, clip_high=0.15, loss_agg=TOKEN_MEAN,
           **CRITIC_FREE),
    Preset("dppo_kl", loss_mode="dppo_kl", clip_low=0.05, clip_high=0.05, loss_agg=TOKEN_MEAN,
           **CRITIC_FREE),
    Preset("dro", loss_mode="dro", loss_agg=TOKEN_MEAN, **CRITIC_FREE),
    Preset("sspo", loss_mode="sspo", **CRITIC_FREE),
    Preset("tir_optimal_token_baseline", advantage="tir_optimal_token_baseline", use_critic=False,
           loss_agg=TOKEN_MEAN),
):
    register_preset(_preset)

BUILT_IN: tuple[str, ...] = tuple(PRESETS)  # stppo's own presets (a plugin's register after these)
