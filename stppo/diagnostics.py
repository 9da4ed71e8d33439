"""Collapse detection: the one definition (docs/design.md §4) used by the trainer's early stop,
sweep pruning, analysis and the dashboard.

A run has collapsed at step s when
  * the greedy success of its live policy — the weights being trained, on a fixed held-out
    subset (`every` steps and at step 0; the trainer's `val/live_success_rate`) — falls below
    `drop` × its running peak (once that peak is at least `min_peak`) on `patience` consecutive
    checks; s is the step of the first check of that streak, or
  * a loss or gradient is non-finite at step s and at the `nonfinite_patience - 1` steps after
    it (with `nonfinite_patience=1`, any non-finite step is a collapse).
Nothing here reads the rollouts' success, which under stale rollouts is the success of a policy
k updates old: the rule is the same at every lag.

`SampledCollapseDetector` is the rule studies v2 and v3 used: the EMA of the training
rollouts' success below `drop` × its running peak for `patience` consecutive steps (and the same
non-finite rule). It lags by k + 1 updates under lag k; the trainer keeps it as an online alarm
(`sampled_collapse`, stppo.alarms) and analysis reads it for runs without live checks. Pure
Python: no torch, no numpy.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Iterable, Sequence


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


@dataclass
class SampledCollapseConfig:
    """The sampled-success rule (studies v2, v3; now the `sampled_collapse` alarm)."""
    ema: float = 0.3  # weight of the newest success rate in the EMA
    drop: float = 0.5  # fires when EMA < drop * running max of the EMA
    min_peak: float = 0.2  # the running max must exceed this before a drop counts
    patience: int = 5  # consecutive steps below the threshold

    def __post_init__(self) -> None:
        _check(0.0 < self.ema <= 1.0, f"trainer.collapse.sampled.ema must be in (0, 1], got {self.ema}")
        _check(0.0 < self.drop < 1.0, f"trainer.collapse.sampled.drop must be in (0, 1), got {self.drop}")
        _check(0.0 <= self.min_peak < 1.0,
               f"trainer.collapse.sampled.min_peak must be in [0, 1), got {self.min_peak}")
        _check(self.patience >= 1, f"trainer.collapse.sampled.patience must be >= 1, got {self.patience}")


COLLAPSE_RULES = ("live", "sampled")


@dataclass
class CollapseConfig:
    # live: the definition; sampled: the rule of studies v2 and v3 (their experiments reproduce
    # with it), on `sampled`'s settings — the live checks still run and are logged
    rule: str = "live"
    every: int = 5  # live checks every k steps (and at step 0); 0: none (non-finite rule only)
    questions: int = 64  # the first N validation questions, greedy
    drop: float = 0.5  # collapsed when a check < drop * the running peak of the checks
    min_peak: float = 0.2  # the peak must reach this before a drop counts
    patience: int = 2  # consecutive checks below the threshold
    nonfinite_patience: int = 3  # consecutive steps with a non-finite loss or gradient
    # the sampled-success rule's settings: the `sampled_collapse` alarm's, and the definition's
    # with rule=sampled
    sampled: SampledCollapseConfig = field(default_factory=SampledCollapseConfig)

    def __post_init__(self) -> None:
        if isinstance(self.sampled, dict):
            self.sampled = SampledCollapseConfig(**self.sampled)
        _check(self.rule in COLLAPSE_RULES,
               f"trainer.collapse.rule={self.rule!r} is not valid; allowed: {', '.join(COLLAPSE_RULES)}")
        _check(self.every >= 0, f"trainer.collapse.every must be >= 0, got {self.every}")
        _check(self.questions >= 1, f"trainer.collapse.questions must be >= 1, got {self.questions}")
        _check(0.0 < self.drop < 1.0, f"trainer.collapse.drop must be in (0, 1), got {self.drop}")
        _check(0.0 <= self.min_peak < 1.0, f"trainer.collapse.min_peak must be in [0, 1), got {self.min_peak}")
        _check(self.patience >= 1 and self.nonfinite_patience >= 1,
               "trainer.collapse.patience and trainer.collapse.nonfinite_patience must be >= 1")


class _NonFinite:
    """Consecutive non-finite steps; `update` returns the streak's first step once it is long
    enough."""

    def __init__(self, patience: int) -> None:
        self.patience, self.start, self.count = patience, None, 0

    def update(self, step: int, nonfinite: bool) -> int | None:
        if not nonfinite:
            self.start, self.count = None, 0
            return None
        if self.count == 0:
            self.start = step
        self.count += 1
        return self.start if self.count >= self.patience else None


class _Drop:
    """A value below `drop` × its running peak (peak ≥ `min_peak`) `patience` times in a row;
    `update` returns the streak's first step once it is long enough."""

    def __init__(self, drop: float, min_peak: float, patience: int, strict: bool) -> None:
        self.drop, self.min_peak, self.patience, self.strict = drop, min_peak, patience, strict
        self.peak = -math.inf
        self.start: int | None = None
        self.count = 0

    def update(self, step: int, x: float) -> int | None:
        self.peak = max(self.peak, x)
        armed = self.peak > self.min_peak if self.strict else self.peak >= self.min_peak
        if armed and x < self.drop * self.peak:
            if self.count == 0:
                self.start = step
            self.count += 1
            return self.start if self.count >= self.patience else None
        self.start, self.count = None, 0
        return None


class CollapseDetector:
    """The live-policy rule, online: `observe_validation` at each live check, `observe_step`
    once per training step, both in step order."""

    def __init__(self, cfg: CollapseConfig | None = None) -> None:
        self.cfg = cfg or CollapseConfig()
        self.drops = _Drop(self.cfg.drop, self.cfg.min_peak, self.cfg.patience, strict=False)
        self.nonfinite = _NonFinite(self.cfg.nonfinite_patience)
        self.collapse_step: int | None = None
        self.reason: str | None = None

    @property
    def detected(self) -> bool:
        return self.collapse_step is not None

    @property
    def peak(self) -> float:
        return self.drops.peak

    def observe_validation(self, step: int, success: float | None) -> bool:
        """Feed one live check; True when the run is (now or already) collapsed."""
        if self.detected or success is None or not math.isfinite(success):
            return self.detected
        at = self.drops.update(step, float(success))
        if at is not None:
            self._mark(at, f"live greedy success fell below {self.cfg.drop:g} x its peak "
                           f"{self.drops.peak:.3f} on {self.cfg.patience} check(s)")
        return self.detected

    def observe_step(self, step: int, nonfinite: bool, success: float | None = None) -> bool:
        """Feed one training step's non-finite flag (its rollouts' `success` is not read);
        True when the run is (now or already) collapsed."""
        if self.detected:
            return True
        at = self.nonfinite.update(step, nonfinite)
        if at is not None:
            self._mark(at, "non-finite loss or gradient")
        return self.detected

    def _mark(self, step: int, reason: str) -> None:
        self.collapse_step, self.reason = step, reason

    def state_dict(self) -> dict:
        return {"cfg": asdict(self.cfg), "drops": dict(vars(self.drops)),
                "nonfinite": dict(vars(self.nonfinite)), "collapse_step": self.collapse_step,
                "reason": self.reason}

    def load_state_dict(self, state: dict) -> None:
        self.__init__(CollapseConfig(**state["cfg"]))
        vars(self.drops).update(state["drops"])
        vars(self.nonfinite).update(state["nonfinite"])
        self.collapse_step, self.reason = state["collapse_step"], state["reason"]


def collapse_detector(cfg: CollapseConfig) -> "CollapseDetector | SampledRule":
    """The detector of the run's rule (`trainer.collapse.rule`), with one interface."""
    return CollapseDetector(cfg) if cfg.rule == "live" else SampledRule(cfg)


def detect_collapse(checks: Sequence[tuple[int, float | None]],
                    nonfinite: Iterable[tuple[int, bool]] = (),
                    cfg: CollapseConfig | None = None) -> tuple[int | None, str | None]:
    """Offline form over a logged run: (collapse step, reason), or (None, None). `checks` are
    the live checks (step, success), `nonfinite` the training steps' (step, flag); both are fed
    in step order (a check at step s after the training step s, as the trainer does)."""
    det = CollapseDetector(cfg)
    events = sorted([(int(s), 0, bool(bad)) for s, bad in nonfinite]
                    + [(int(s), 1, x) for s, x in checks], key=lambda e: (e[0], e[1]))
    for step, kind, value in events:
        done = det.observe_step(step, value) if kind == 0 else det.observe_validation(step, value)
        if done:
            break
    return det.collapse_step, det.reason


class SampledCollapseDetector:
    """The sampled-success rule, online; `update` once per training step, in step order (with the
    non-finite rule of `nonfinite_patience` steps)."""

    def __init__(self, cfg: SampledCollapseConfig | None = None, nonfinite_patience: int = 3) -> None:
        self.cfg = cfg or SampledCollapseConfig()
        self.ema: float | None = None
        self.drops = _Drop(self.cfg.drop, self.cfg.min_peak, self.cfg.patience, strict=True)
        self.nonfinite = _NonFinite(nonfinite_patience)
        self.collapse_step: int | None = None
        self.reason: str | None = None

    @property
    def detected(self) -> bool:
        return self.collapse_step is not None

    def update(self, step: int, success_rate: float | None, nonfinite: bool = False) -> bool:
        """Feed one step; returns True when the rule has fired (now or before)."""
        if self.detected:
            return True
        at = self.nonfinite.update(step, nonfinite)
        if at is not None:
            self.collapse_step, self.reason = at, "non-finite loss or gradient"
            return True
        if success_rate is None or not math.isfinite(success_rate):
            return False
        x, a = float(success_rate), self.cfg.ema
        self.ema = x if self.ema is None else a * x + (1.0 - a) * self.ema
        at = self.drops.update(step, self.ema)
        if at is not None:
            self.collapse_step = at
            self.reason = f"success EMA fell below {self.cfg.drop:g} x its peak {self.drops.peak:.3f}"
        return self.detected

    def rearm(self) -> None:
        """Let the rule fire again (after a rollback): streaks cleared, EMA and peak kept."""
        self.collapse_step = self.reason = None
        self.drops.start, self.drops.count = None, 0
        self.nonfinite.start, self.nonfinite.count = None, 0

    def state_dict(self) -> dict:
        return {"cfg": asdict(self.cfg), "ema": self.ema, "drops": dict(vars(self.drops)),
                "nonfinite": dict(vars(self.nonfinite)), "collapse_step": self.collapse_step,
                "reason": self.reason}

    def load_state_dict(self, state: dict) -> None:
        self.__init__(SampledCollapseConfig(**state["cfg"]), state["nonfinite"]["patience"])
        self.ema = state["ema"]
        vars(self.drops).update(state["drops"])
        vars(self.nonfinite).update(state["nonfinite"])
        self.collapse_step, self.reason = state["collapse_step"], state["reason"]


class SampledRule:
    """rule=sampled as the trainer's detector: the sampled-success rule fed by `observe_step`;
    the live checks are logged but decide nothing."""

    def __init__(self, cfg: CollapseConfig) -> None:
        self.cfg, self.rule = cfg, SampledCollapseDetector(cfg.sampled, cfg.nonfinite_patience)

    detected = property(lambda self: self.rule.detected)
    collapse_step = property(lambda self: self.rule.collapse_step)
    reason = property(lambda self: self.rule.reason)

    def observe_step(self, step: int, nonfinite: bool, success: float | None = None) -> bool:
        return self.rule.update(step, success, nonfinite)

    def observe_validation(self, step: int, success: float | None) -> bool:
        return self.rule.detected

    def state_dict(self) -> dict:
        return self.rule.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.rule.load_state_dict(state)


def detect_sampled_collapse(steps: Sequence[int], success_rate: Sequence[float | None],
                            nonfinite: Iterable[bool] | None = None,
                            cfg: SampledCollapseConfig | None = None,
                            nonfinite_patience: int = 3) -> tuple[int | None, str | None]:
    """Offline form of the sampled-success rule over a logged run: (step, reason) or (None, None)."""
    det = SampledCollapseDetector(cfg, nonfinite_patience)
    flags = list(nonfinite) if nonfinite is not None else [False] * len(steps)
    if not (len(steps) == len(success_rate) == len(flags)):
        raise ValueError("steps, success_rate and nonfinite must have the same length")
    for s, x, bad in zip(steps, success_rate, flags):
        if det.update(int(s), x, bool(bad)):
            break
    return det.collapse_step, det.reason
