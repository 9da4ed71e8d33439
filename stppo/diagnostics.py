"""Collapse detection: the one definition (docs/design.md §4) used by the trainer's early stop, sweep
pruning, analysis and the dashboard.

A run has collapsed at step s when
  * the EMA of its success rate falls below `drop` × its running maximum (once that maximum
    exceeds `min_peak`) at step s and stays there for `patience` consecutive steps, or
  * a loss or gradient is non-finite at step s and at the `nonfinite_patience - 1` steps after it
    (with `nonfinite_patience=1`, any non-finite step is a collapse).
The collapse step is the first step of the streak. Pure Python: no torch, no numpy.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Iterable, Sequence


@dataclass
class CollapseConfig:
    ema: float = 0.3  # weight of the newest success rate in the EMA
    drop: float = 0.5  # collapsed when EMA < drop * running max of the EMA
    min_peak: float = 0.2  # the running max must exceed this before a drop counts
    patience: int = 5  # consecutive steps below the threshold
    nonfinite_patience: int = 3  # consecutive steps with a non-finite loss or gradient

    def __post_init__(self) -> None:
        if not 0.0 < self.ema <= 1.0:
            raise ValueError(f"collapse.ema must be in (0, 1], got {self.ema}")
        if not 0.0 < self.drop < 1.0:
            raise ValueError(f"collapse.drop must be in (0, 1), got {self.drop}")
        if not 0.0 <= self.min_peak < 1.0:
            raise ValueError(f"collapse.min_peak must be in [0, 1), got {self.min_peak}")
        if self.patience < 1 or self.nonfinite_patience < 1:
            raise ValueError("collapse.patience and collapse.nonfinite_patience must be >= 1")


class CollapseDetector:
    """Online detector; `update` once per training step, in step order."""

    def __init__(self, cfg: CollapseConfig | None = None) -> None:
        self.cfg = cfg or CollapseConfig()
        self.ema: float | None = None
        self.peak = -math.inf
        self.low_start: int | None = None
        self.low_count = 0
        self.nonfinite_start: int | None = None
        self.nonfinite_count = 0
        self.collapse_step: int | None = None
        self.reason: str | None = None

    @property
    def detected(self) -> bool:
        return self.collapse_step is not None

    def update(self, step: int, success_rate: float | None, nonfinite: bool = False) -> bool:
        """Feed one step; returns True when the run is (now or already) collapsed."""
        if self.detected:
            return True
        cfg = self.cfg
        if nonfinite:
            if self.nonfinite_count == 0:
                self.nonfinite_start = step
            self.nonfinite_count += 1
            if self.nonfinite_count >= cfg.nonfinite_patience:
                self._mark(self.nonfinite_start, "non-finite loss or gradient")
                return True
        else:
            self.nonfinite_count, self.nonfinite_start = 0, None
        if success_rate is None or not math.isfinite(success_rate):
            return False
        x = float(success_rate)
        self.ema = x if self.ema is None else cfg.ema * x + (1.0 - cfg.ema) * self.ema
        self.peak = max(self.peak, self.ema)
        if self.peak > cfg.min_peak and self.ema < cfg.drop * self.peak:
            if self.low_count == 0:
                self.low_start = step
            self.low_count += 1
            if self.low_count >= cfg.patience:
                self._mark(self.low_start, f"success EMA fell below {cfg.drop:g} x its peak {self.peak:.3f}")
                return True
        else:
            self.low_count, self.low_start = 0, None
        return False

    def _mark(self, step: int | None, reason: str) -> None:
        self.collapse_step, self.reason = step, reason

    def state_dict(self) -> dict:
        return {k: v for k, v in vars(self).items() if k != "cfg"} | {"cfg": asdict(self.cfg)}

    def load_state_dict(self, state: dict) -> None:
        state = dict(state)
        self.cfg = CollapseConfig(**state.pop("cfg"))
        for k, v in state.items():
            setattr(self, k, v)


def detect_collapse(
    steps: Sequence[int],
    success_rate: Sequence[float | None],
    nonfinite: Iterable[bool] | None = None,
    cfg: CollapseConfig | None = None,
) -> int | None:
    """Offline form: the collapse step of a logged run, or None. Same rule as the online one."""
    det = CollapseDetector(cfg)
    flags = list(nonfinite) if nonfinite is not None else [False] * len(steps)
    if not (len(steps) == len(success_rate) == len(flags)):
        raise ValueError("steps, success_rate and nonfinite must have the same length")
    for s, x, bad in zip(steps, success_rate, flags):
        if det.update(int(s), x, bool(bad)):
            break
    return det.collapse_step
