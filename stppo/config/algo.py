"""The `algo` group's schema: a preset with the run's overrides, resolved into one `LossSpec`
(`AlgoConfig.spec`, `resolve_loss`), and the loss's trainer-side settings (KL, advantages' γ and
λ, DAPO's dynamic sampling and overlong shaping, SSPO's subsentence ends)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Optional

from omegaconf import MISSING

from stppo.config.checks import one_of, require

KL_ESTIMATORS = ("k1", "k2", "k3")

# SSPO's subsentence ends (stppo.train.prepare): sentence and clause punctuation, and newline
# (written as backslash + n, also on the command line: algo.subsentence_delimiters='.,;:!?\n').
DEFAULT_SUBSENTENCE_DELIMITERS = ".,;:!?\\n"


def delimiter_chars(delimiters: str) -> str:
    """The characters of `algo.subsentence_delimiters`, `\\n` read as a newline."""
    return delimiters.replace("\\n", "\n")


@dataclass
class ClipBiasConfig:
    """The clip-bias scale λ of the loss (S-, ST-, SO-PPO; stppo.algos.clip_bias); null fields:
    the preset's."""
    kind: Optional[str] = None  # none | clip_bias_norm | clip_triggered
    tau: Optional[float] = None  # None: the preset's, else the kind's default (DEFAULT_TAU)
    estimator: str = "token"  # token | grad
    granularity: str = "batch"  # batch | sequence


@dataclass
class KLConfig:
    coef: float = 0.0  # β; 0 disables the reference model entirely
    estimator: str = "k3"
    in_reward: bool = False  # True: per-token penalty in the reward; False: a loss term

    def __post_init__(self) -> None:
        one_of("algo.kl.estimator", self.estimator, KL_ESTIMATORS)
        require(self.coef >= 0, f"algo.kl.coef must be >= 0, got {self.coef}")


@dataclass
class RolloutCorrectionOptions:
    """The arguments of verl's `RolloutCorrectionConfig` classmethod that `algo.rollout_correction`
    names (docs/design.md §2, "Rollout correction"); null: the classmethod's default. At start the
    name's arguments are filled with the values that ran; one it does not take must stay null."""
    threshold: Optional[float] = None  # IS weights' C (…_is, bypass_pg_is), IcePop's upper bound
    threshold_lower: Optional[float] = None  # IcePop's lower bound (…_icepop)
    is_threshold: Optional[float] = None  # IS weights' C beside rejection (…_rs_*_tis, seq_is_rs)
    # rejection: a number, or 'lower_upper' for the k1 (geo, seq_is_rs) options — write both bounds
    # with a decimal point or quote it: Hydra reads 0.5_2 as the number 0.52
    rs_threshold: Any = None
    batch_normalize: Optional[bool] = None  # IS weights / their batch mean (names with IS weights)


@dataclass
class DynamicSamplingConfig:
    """DAPO's dynamic sampling: drop groups whose rewards all agree, roll out more questions to
    refill the batch (verl's algorithm.filter_groups)."""
    enabled: Optional[bool] = None  # None: the preset's (dapo: on)
    max_rounds: int = 4  # refill rollouts per step at most (verl: max_num_gen_batches − 1)
    refill_factor: float = 2.0  # questions rolled out per missing group (verl's replay buffer: 2)

    def __post_init__(self) -> None:
        require(self.max_rounds >= 0, f"algo.dynamic_sampling.max_rounds must be >= 0, got "
                                     f"{self.max_rounds}")
        require(self.refill_factor >= 1, f"algo.dynamic_sampling.refill_factor must be >= 1, got "
                                        f"{self.refill_factor}")


@dataclass
class OverlongConfig:
    """DAPO's soft overlong punishment on the trajectory score (verl's overlong_buffer); the
    length limit is trainer.rollout.max_total_tokens."""
    enabled: Optional[bool] = None  # None: the preset's (dapo: on)
    buffer_len: int = 128  # L_cache: the penalty ramps over the last buffer_len tokens
    penalty_factor: float = 1.0

    def __post_init__(self) -> None:
        require(self.buffer_len >= 1, f"algo.overlong.buffer_len must be >= 1, got {self.buffer_len}")
        require(self.penalty_factor >= 0, f"algo.overlong.penalty_factor must be >= 0, got "
                                         f"{self.penalty_factor}")


@dataclass
class AlgoConfig:
    """The run's loss: a preset (stppo.algos.PRESETS, named by conf/algo/<name>.yaml) — a built-in
    one or a researcher's, registered by their package (stppo.plugins) — with the run's
    overrides. Loss fields left null take the preset's value; `spec` is the one validated
    `LossSpec` that the trainer, data parallelism and the verl backend read."""
    name: str = MISSING  # preset name
    # the module that registers the preset, for a package that is not installed (a plain folder on
    # hydra.searchpath); installed packages are found by their entry point (stppo.plugins)
    plugin: Optional[str] = None
    ratio_level: Optional[str] = None
    advantage: Optional[str] = None
    use_critic: Optional[bool] = None
    loss_agg: Optional[str] = None
    clip_low: Optional[float] = None
    clip_high: Optional[float] = None
    dual_clip: Optional[float] = None
    clip_bias: ClipBiasConfig = field(default_factory=ClipBiasConfig)
    kl: KLConfig = field(default_factory=KLConfig)
    gamma: float = 1.0  # discount
    gae_lambda: float = 1.0  # GAE's λ (the clip-bias scale is another λ: clip_bias/scale)
    whiten_advantages: bool = True
    grpo_eps: float = 1e-6
    entropy_coef: float = 0.0
    vf_clip: float = 0.5
    loss_mode: Optional[str] = None  # stppo.algos.LOSS_MODES
    loss_options: dict[str, float] = field(default_factory=dict)  # over the preset's (mode's) options
    # The sampler/trainer mismatch correction, with any preset: none (metrics only) or a verl
    # RolloutCorrectionConfig preset (stppo.algos.rollout_corr.ROLLOUT_CORRECTIONS), its arguments
    # in rollout_correction_options.
    rollout_correction: str = "none"
    rollout_correction_options: RolloutCorrectionOptions = field(default_factory=RolloutCorrectionOptions)
    dynamic_sampling: DynamicSamplingConfig = field(default_factory=DynamicSamplingConfig)
    overlong: OverlongConfig = field(default_factory=OverlongConfig)
    # the characters whose tokens end a subsentence (loss modes that read subsentences: sspo)
    subsentence_delimiters: str = DEFAULT_SUBSENTENCE_DELIMITERS

    def __post_init__(self) -> None:
        for sub, cls in (("clip_bias", ClipBiasConfig), ("kl", KLConfig),
                         ("dynamic_sampling", DynamicSamplingConfig),
                         ("rollout_correction_options", RolloutCorrectionOptions),
                         ("overlong", OverlongConfig)):
            if isinstance(getattr(self, sub), dict):
                setattr(self, sub, cls(**getattr(self, sub)))
        require(0.0 <= self.gamma <= 1.0 and 0.0 <= self.gae_lambda <= 1.0,
               f"algo.gamma and algo.gae_lambda must be in [0, 1], got {self.gamma}, {self.gae_lambda}")
        require(self.vf_clip > 0, f"algo.vf_clip must be > 0, got {self.vf_clip}")
        require(bool(delimiter_chars(str(self.subsentence_delimiters))),
               "algo.subsentence_delimiters must name at least one character, got ''")
        self._spec = resolve_loss(self)

    @property
    def spec(self):
        """The run's `stppo.algos.LossSpec` (validated at construction)."""
        return self._spec


def resolve_loss(a: AlgoConfig):
    """`a`'s preset with `a`'s overrides as one `LossSpec` — the one place a loss setting is
    validated — and the values that ran written back into `a`'s null fields (the run's params)."""
    from stppo.algos import PRESETS, ClipBias, RolloutCorrection
    from stppo.algos.spec import PLAIN_FIELDS
    from stppo.plugins import import_plugin, load_plugins

    load_plugins()
    if a.plugin is not None:
        import_plugin(a.plugin, f"algo.plugin={a.plugin!r}")
    one_of("algo.name", a.name, tuple(PRESETS))
    p = PRESETS[a.name]
    base = p.spec()
    changes = {f: getattr(a, f) for f in PLAIN_FIELDS if getattr(a, f) is not None}
    mode = changes.get("loss_mode", base.loss_mode)
    changes["options"] = {**(base.options if mode == base.loss_mode else {}), **dict(a.loss_options)}
    try:
        changes["clip_bias"] = _clip_bias(a.clip_bias, base.clip_bias)
    except ValueError as e:
        raise ValueError(f"algo.{e}") from None
    options = {k: v for k, v in asdict(a.rollout_correction_options).items() if v is not None}
    changes["rollout_correction"] = RolloutCorrection(a.rollout_correction, options)
    spec = base.replace(**changes)
    for f in PLAIN_FIELDS:
        setattr(a, f, getattr(spec, f))
    a.loss_options = dict(spec.options)
    a.clip_bias.kind, a.clip_bias.tau = spec.clip_bias_kind, changes["clip_bias"].tau
    for k, v in spec.rollout_correction.options.items():
        setattr(a.rollout_correction_options, k, v)
    if a.dynamic_sampling.enabled is None:
        a.dynamic_sampling.enabled = p.dynamic_sampling
    if a.overlong.enabled is None:
        a.overlong.enabled = p.overlong
    return spec


def _clip_bias(c: ClipBiasConfig, preset: Any):
    """The run's clip-bias scale: the preset's kind and τ where `c` leaves them null (τ: the
    preset's for the preset's kind, else the kind's default)."""
    from stppo.algos import CLIP_BIAS_KINDS, ClipBias

    kind = "none" if preset is None else preset.kind
    if c.kind is not None:
        one_of("clip_bias.kind", c.kind, tuple(CLIP_BIAS_KINDS))
        kind = c.kind
    tau = c.tau
    if tau is None and preset is not None and preset.kind == kind:
        tau = preset.tau
    return ClipBias(kind, tau, c.estimator, c.granularity)
