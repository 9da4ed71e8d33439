"""Early warning of collapse: every candidate indicator as an online alarm under one rule
(docs/design.md §4), used by the trainer (`trainer.alarm`, `trainer.on_alarm`) and, offline over logged
series, by `analysis.warning`, which measures lead time, false alarms and ROC AUC per indicator.

The rule — a robust z-score against the run's own first steps, held for `persist` values:

    y_t = transform(x_t)        level: x_t;  log: log(max(x_t, 0) + ε);
                                growth: (log(x_t + ε) − log(x_{t−L} + ε)) / L  (log growth per step)
    m, s = median(B), 1.4826 · median(|B − m|)   over B = the first `baseline_steps` values of y
    z_t  = d · (y_t − m) / max(s, min_scale)      d = +1 ('up'), −1 ('down'); |y_t − m| / … for 'both'
    a_t  = min(z_t, z_{t−1}, …, z_{t−P+1})        the alarm statistic, P = `persist`
    the alarm fires at the first t after the baseline with a_t ≥ h  (h = `threshold`)

Values are counted in the order they are observed; a missing or non-finite value is skipped (it is
neither baseline nor a step of the streak). 1.4826 · MAD estimates the standard deviation of
normal noise (Rousseeuw & Croux 1993); `min_scale`, per indicator in the units of y, keeps a flat
baseline (MAD = 0) from turning every wiggle into an alarm.

Why this rule: each run is its own control, so one threshold is meaningful across models, tasks
and presets whose metrics live on different scales (no calibration over other runs, which an
online alarm does not have); median and MAD are not moved by one bad batch among the baseline
steps; `persist` consecutive values keep a single noisy batch from firing; and a_t does not
depend on h, so one pass over a logged series gives the first alarm at every threshold (the ROC
curve). A one-sided CUSUM was the alternative: it accumulates small sustained shifts sooner, but
its statistic mixes size and duration through a drift parameter, so "how far from normal" has no
direct reading and lead times depend on that extra knob.
Defaults: W = 5 baseline values, P = 2, h = 4 (two consecutive values four robust standard
deviations beyond the run's start; under normal noise P(z ≥ 4) ≈ 3e-5 per value). The first
possible alarm is at the (W + P)-th logged value (+ L for growth): collapses within the first steps
cannot be warned by construction. Pure Python: no torch, no numpy.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Mapping, Sequence

from stppo import metric_names as T
from stppo.diagnostics import SampledCollapseConfig, SampledCollapseDetector

DIRECTIONS = ("up", "down", "both")
TRANSFORMS = ("level", "log", "growth")
MAD_TO_SD = 1.4826


@dataclass(frozen=True)
class Indicator:
    name: str
    keys: tuple[str, ...]  # metric keys in order of preference: a run uses the first one it logs
    direction: str  # up | down | both: which way is bad
    transform: str  # level | log | growth
    min_scale: float  # floor of the baseline scale, in the units of the transformed value
    eps: float = 0.0  # offset inside the log (log and growth)
    lag: int = 1  # L of the growth transform, in logged values
    doc: str = ""

    def __post_init__(self) -> None:
        if not self.keys:
            raise ValueError(f"indicator {self.name!r} needs at least one metric key")
        if self.direction not in DIRECTIONS:
            raise ValueError(f"indicator {self.name!r}: direction must be one of {DIRECTIONS}, got {self.direction!r}")
        if self.transform not in TRANSFORMS:
            raise ValueError(f"indicator {self.name!r}: transform must be one of {TRANSFORMS}, got {self.transform!r}")
        if self.min_scale <= 0 or self.eps < 0 or self.lag < 1:
            raise ValueError(f"indicator {self.name!r}: min_scale > 0, eps >= 0 and lag >= 1 are required")


INDICATORS: dict[str, Indicator] = {}


def register_indicator(ind: Indicator) -> Indicator:
    """Add an indicator to the registry; a name registered twice raises."""
    if ind.name in INDICATORS:
        raise ValueError(f"indicator {ind.name!r} is already registered")
    INDICATORS[ind.name] = ind
    return ind


def get_indicator(name: str) -> Indicator:
    if name not in INDICATORS:
        raise ValueError(f"unknown alarm indicator {name!r}; valid: {', '.join(INDICATORS)}")
    return INDICATORS[name]


for _ind in (
    Indicator("clip_bias_growth", (T.CLIP_BIAS_NORM,), "up", "growth", 0.02, 1e-12, 2,
              "log growth per step of the clipping-bias norm (the paper's exponential growth)"),
    Indicator("grad_norm_spike", (T.GRAD_NORM,), "up", "log", 0.2, 1e-12, doc="pre-clip gradient norm"),
    Indicator("entropy_fall", (T.ENTROPY,), "down", "log", 0.1, 1e-3, doc="policy entropy falls"),
    Indicator("entropy_rise", (T.ENTROPY,), "up", "log", 0.1, 1e-3, doc="policy entropy rises"),
    Indicator("clip_frac", (T.PG_CLIPFRAC,), "up", "level", 0.02, doc="fraction of clipped tokens"),
    Indicator("ppo_kl", (T.PPO_KL,), "up", "log", 0.2, 1e-4, doc="KL between the old and the new policy"),
    Indicator("kl_ref", (T.KL_REF,), "up", "log", 0.2, 1e-4, doc="KL to the reference policy"),
    Indicator("valid_action_drop", (T.VALID_ACTION_RATIO,), "down", "level", 0.02,
              doc="share of well-formed actions falls"),
    Indicator("response_length", (T.RESPONSE_LENGTH_MEAN,), "both", "log", 0.1, 1.0,
              doc="mean response length moves either way"),
    Indicator("rollout_mismatch", (T.ROLLOUT_CORR_K3_KL, T.ROLLOUT_CORR_ABS_DIFF_MEAN), "up", "log", 0.2, 1e-6,
              doc="sampler vs trainer log-prob mismatch"),
    Indicator("zero_signal_groups", (T.ZERO_STD_GROUP_FRAC,), "up", "level", 0.05,
              doc="share of groups whose rewards all agree"),
    Indicator("explained_var_drop", (T.VF_EXPLAINED_VAR,), "down", "level", 0.05,
              doc="critic explained variance falls"),
    # sampler vs trainer and stale rollouts (docs/design.md §4): χ² = E[w²] − 1 of w = π_old / π_rollout is
    # 0 on-policy, so ε = 1e-3 keeps float noise below it flat in log units; verl warns at χ² > 1
    Indicator("rollout_chi2", (T.ROLLOUT_CORR_CHI2_TOKEN, T.ROLLOUT_CORR_CHI2_SEQ), "up", "log", 0.2, 1e-3,
              doc="χ² divergence of the trainer's π_old from the sampler's π_rollout"),
    Indicator("offpolicy_kl", (T.OFFPOLICY_KL_TO_CURRENT,), "up", "log", 0.2, 1e-4,
              doc="KL of the stale sampling policy to the current one (trainer.offpolicy)"),
    Indicator("rollout_is_ess_drop", (T.ROLLOUT_IS_ESS,), "down", "level", 0.05,
              doc="effective sample size of the truncated IS weights falls (verl warns below 0.3)"),
):
    register_indicator(_ind)


# The sampled-success rule of stppo.diagnostics (the collapse definition of studies v2 and v3)
# as an alarm, on the settings `trainer.collapse.sampled`: it fires when the training rollouts'
# success falls by that rule (its non-finite part is the collapse rule's, not the alarm's), which
# lags the live policy by k + 1 updates under stale rollouts.
SAMPLED_COLLAPSE = "sampled_collapse"


def alarm_names() -> list[str]:
    return [*INDICATORS, SAMPLED_COLLAPSE]


@dataclass
class AlarmConfig:
    indicators: list[str] = field(default_factory=alarm_names)  # which alarms to watch
    threshold: float = 4.0  # h: robust z-score the alarm statistic must reach
    persist: int = 2  # P: consecutive values at or beyond h
    baseline_steps: int = 5  # W: first logged values of each indicator that form its baseline
    thresholds: dict[str, float] = field(default_factory=dict)  # per-indicator overrides of h

    def __post_init__(self) -> None:
        self.indicators, self.thresholds = list(self.indicators), dict(self.thresholds)
        bad = [n for n in self.indicators if n not in alarm_names()]
        bad += [n for n in self.thresholds if n not in INDICATORS]
        if bad:
            raise ValueError(f"alarm: unknown indicator {bad[0]!r}; valid: {', '.join(alarm_names())}")
        if not self.threshold > 0 or not all(v > 0 for v in self.thresholds.values()):
            raise ValueError(f"alarm.threshold and alarm.thresholds must be > 0, got {self.threshold}, "
                             f"{self.thresholds}")
        if self.persist < 1:
            raise ValueError(f"alarm.persist must be >= 1, got {self.persist}")
        if self.baseline_steps < 3:
            raise ValueError(f"alarm.baseline_steps must be >= 3 (a median absolute deviation needs 3 "
                             f"values), got {self.baseline_steps}")

    @property
    def zscore_indicators(self) -> list[str]:
        """The watched indicators of the robust z-score rule (all but `sampled_collapse`)."""
        return [n for n in self.indicators if n in INDICATORS]

    def threshold_for(self, name: str) -> float:
        return float(self.thresholds.get(name, self.threshold))


def transform_value(ind: Indicator, x: float) -> float:
    """y of the level and log transforms (growth needs history: `Monitor`); −inf for log(0)."""
    if ind.transform == "level":
        return x
    return _log(ind, x)


def _log(ind: Indicator, x: float) -> float:
    v = max(x, 0.0) + ind.eps
    return math.log(v) if v > 0 else -math.inf


def _median(xs: Sequence[float]) -> float:
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])


def robust_baseline(values: Sequence[float], min_scale: float) -> tuple[float, float]:
    """(m, max(1.4826 · MAD, min_scale)) of the baseline values."""
    m = _median(values)
    mad = _median([abs(v - m) for v in values])
    return m, max(MAD_TO_SD * mad, min_scale)


class Monitor:
    """One indicator, online: `update(step, x)` returns True at the step its alarm first fires."""

    def __init__(self, ind: Indicator, threshold: float, persist: int, baseline_steps: int) -> None:
        self.ind, self.threshold, self.persist, self.baseline_steps = ind, threshold, persist, baseline_steps
        self.logs: list[float] = []  # the last L log values (growth transform)
        self.baseline: list[float] = []
        self.center: float | None = None
        self.scale: float | None = None
        self.recent: list[float] = []  # the last P z-scores
        self.stat = math.nan  # a_t of the last observed value (NaN until defined)
        self.fired_step: int | None = None

    def _y(self, x: float) -> float | None:
        if self.ind.transform != "growth":
            return transform_value(self.ind, x)
        lx = _log(self.ind, x)
        if not math.isfinite(lx):
            return None
        self.logs.append(lx)
        if len(self.logs) <= self.ind.lag:
            return None
        y = (lx - self.logs[0]) / self.ind.lag
        self.logs.pop(0)
        return y

    def _z(self, y: float) -> float:
        d = y - self.center
        if self.ind.direction == "both":
            d = abs(d)
        elif self.ind.direction == "down":
            d = -d
        return d / self.scale

    def observe(self, x: float | None) -> float:
        """Feed one logged value; returns its a_t (NaN while undefined). A missing or non-finite
        value returns NaN and changes nothing."""
        if x is None or not math.isfinite(x):
            return math.nan
        y = self._y(float(x))
        if y is None or not math.isfinite(y):
            return math.nan
        if self.center is None:
            self.baseline.append(y)
            if len(self.baseline) >= self.baseline_steps:
                self.center, self.scale = robust_baseline(self.baseline, self.ind.min_scale)
            return math.nan
        self.recent = (self.recent + [self._z(y)])[-self.persist:]
        self.stat = min(self.recent) if len(self.recent) == self.persist else math.nan
        return self.stat

    def update(self, step: int, x: float | None) -> bool:
        """Feed one logged value; True only at the step the alarm first fires."""
        a = self.observe(x)
        if self.fired_step is None and a >= self.threshold:
            self.fired_step = int(step)
            return True
        return False

    def state_dict(self) -> dict:
        return {k: v for k, v in vars(self).items() if k != "ind"}

    def load_state_dict(self, state: Mapping) -> None:
        for k, v in state.items():
            setattr(self, k, list(v) if isinstance(v, (list, tuple)) else v)


class AlarmSet:
    """The online alarms of one run: `update(step, metrics)` once per training step, in order.

    Each indicator reads the first of its keys present in `metrics` (and keeps that key for the
    run). `update` returns the indicators whose alarm fires at this step (first firing only);
    `fired` maps every indicator that has fired to its step."""

    def __init__(self, cfg: AlarmConfig | None = None, sampled: SampledCollapseConfig | None = None) -> None:
        self.cfg = cfg or AlarmConfig()
        self.sampled_cfg = sampled or SampledCollapseConfig()
        self.keys: dict[str, str] = {}
        self.monitors = {n: Monitor(get_indicator(n), self.cfg.threshold_for(n), self.cfg.persist,
                                    self.cfg.baseline_steps)
                         for n in self.cfg.zscore_indicators}
        self.sampled = (SampledCollapseDetector(self.sampled_cfg)
                        if SAMPLED_COLLAPSE in self.cfg.indicators else None)
        self.sampled_step: int | None = None  # the step the sampled_collapse alarm fired

    def update(self, step: int, metrics: Mapping[str, float]) -> list[str]:
        fired = []
        for name, mon in self.monitors.items():
            key = self.keys.get(name) or next((k for k in mon.ind.keys if k in metrics), None)
            if key is None:
                continue
            self.keys[name] = key
            if mon.update(step, metrics.get(key)):
                fired.append(name)
        if self.sampled is not None and T.SUCCESS_RATE in metrics and self.sampled_step is None:
            if self.sampled.update(step, metrics[T.SUCCESS_RATE]):
                self.sampled_step = int(step)
                fired.append(SAMPLED_COLLAPSE)
        return fired

    @property
    def fired(self) -> dict[str, int]:
        out = {n: m.fired_step for n, m in self.monitors.items() if m.fired_step is not None}
        return out | ({SAMPLED_COLLAPSE: self.sampled_step} if self.sampled_step is not None else {})

    def rearm(self, names: Sequence[str]) -> None:
        """Let these indicators fire again (after an intervention, e.g. a rollback): their streak
        and firing are cleared, their baseline — the run's own first values — is kept."""
        for n in names:
            if n == SAMPLED_COLLAPSE:
                self.sampled.rearm()
                self.sampled_step = None
                continue
            mon = self.monitors[n]
            mon.fired_step, mon.recent, mon.stat = None, [], math.nan

    def statistics(self) -> dict[str, float]:
        """The alarm statistic a_t of each indicator at its last logged value (NaN when undefined)."""
        return {n: m.stat for n, m in self.monitors.items()}

    def state_dict(self) -> dict:
        return {"cfg": asdict(self.cfg), "sampled_cfg": asdict(self.sampled_cfg), "keys": dict(self.keys),
                "monitors": {n: m.state_dict() for n, m in self.monitors.items()},
                "sampled": self.sampled.state_dict() if self.sampled is not None else None,
                "sampled_step": self.sampled_step}

    def load_state_dict(self, state: Mapping) -> None:
        self.__init__(AlarmConfig(**state["cfg"]), SampledCollapseConfig(**state.get("sampled_cfg", {})))
        self.keys = dict(state["keys"])
        for n, s in state["monitors"].items():
            self.monitors[n].load_state_dict(s)
        if self.sampled is not None and state.get("sampled") is not None:
            self.sampled.load_state_dict(state["sampled"])
            self.sampled_step = state["sampled_step"]


def alarm_statistic(steps: Sequence[int], values: Sequence[float | None], indicator: str,
                    cfg: AlarmConfig | None = None) -> list[float]:
    """Offline form: a_t at every position of a logged series (NaN where undefined: baseline, skipped
    values, the first P − 1 values after the baseline). Same rule as the online alarm."""
    cfg = cfg or AlarmConfig()
    if len(steps) != len(values):
        raise ValueError("steps and values must have the same length")
    mon = Monitor(get_indicator(indicator), math.inf, cfg.persist, cfg.baseline_steps)
    return [mon.observe(x) for x in values]


def first_alarm(steps: Sequence[int], values: Sequence[float | None], indicator: str,
                cfg: AlarmConfig | None = None) -> int | None:
    """Offline form: the step at which the alarm of `indicator` first fires on a logged series."""
    cfg = cfg or AlarmConfig()
    h = cfg.threshold_for(indicator)
    for s, a in zip(steps, alarm_statistic(steps, values, indicator, cfg)):
        if a >= h:
            return int(s)
    return None
