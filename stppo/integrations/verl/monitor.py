"""While verl trains: read the run's verl-named metrics, write stppo-named copies, apply the
collapse rule, and compute the sweep objective — so that a verl run reads like an own run.

`RunMonitor.poll()` is called every `backend.poll_s` seconds (and once after verl exits). Each
call reads the metric histories of the mapped keys (`metrics.py`) and handles every new training
step in step order: the copies of `TRAIN_COPIES`, `actor/skipped_steps` (1.0 when verl's grad
norm or loss is non-finite), then `CollapseDetector.update(step, success, non-finite)` — the one
collapse rule of `stppo.diagnostics` — and `collapse/detected` (every step) / `collapse/step`
(once), as the own trainer logs them. New validation points are copied to `val/success_rate`.
Copies go through stppo's `Tracker` (retries, buffering while the store is away).
Verl-free and torch-free.
"""

from __future__ import annotations

import logging
import math
from typing import Mapping

from stppo import tracking as K
from stppo.diagnostics import CollapseConfig, CollapseDetector
from stppo.integrations.verl.metrics import NONFINITE_KEYS, STEP_KEY, TRAIN_COPIES, val_key
from stppo.tracker import Tracker
from stppo.tracking_io import call

log = logging.getLogger(__name__)


def late_mean(val_history: list[tuple[int, float]], step: int, total_steps: int) -> float:
    """The sweep objective, the own trainer's rule (`Trainer.objective`): the mean validation
    success over the last 20% of the steps, mean over {v_s : s > step − max(1, round(0.2·S))}
    (at least the last point); NaN without validation."""
    if not val_history:
        return float("nan")
    start = step - max(1, round(0.2 * total_steps))
    tail = [v for s, v in val_history if s > start] or [val_history[-1][1]]
    return sum(tail) / len(tail)


class RunMonitor:
    """Follows one MLflow run that verl writes into (see the module docstring)."""

    def __init__(self, tracker: Tracker, *, data_source: str, total_steps: int,
                 collapse: CollapseConfig | None = None, stop_on_collapse: bool = False) -> None:
        self.tracker = tracker
        self.val_key = val_key(data_source)
        self.total_steps = total_steps
        self.stop_on_collapse = stop_on_collapse
        self.detector = CollapseDetector(collapse)
        self.step = 0  # last training step handled
        self.val_history: list[tuple[int, float]] = []
        self._keys = tuple(dict.fromkeys([STEP_KEY, *(c.verl for c in TRAIN_COPIES), *NONFINITE_KEYS]))

    @property
    def should_stop(self) -> bool:
        """Collapsed and asked to stop (non-finite collapses always stop, as in the own trainer)."""
        d = self.detector
        return d.detected and (self.stop_on_collapse or (d.reason or "").startswith("non-finite"))

    def objective(self) -> float:
        return late_mean(self.val_history, self.step, self.total_steps)

    def poll(self) -> int:
        """Handle what verl logged since the last call; returns the number of new train steps."""
        hist = {k: self._history(k) for k in self._keys}
        new = sorted(s for s in hist[STEP_KEY] if s > self.step)
        for s in new:
            self._train_step(s, {k: h[s] for k, h in hist.items() if s in h})
        for s, v in sorted(self._history(self.val_key).items()):
            if not self.val_history or s > self.val_history[-1][0]:
                self.val_history.append((s, v))
                self.tracker.log(s, {K.VAL_SUCCESS_RATE: v})
        return len(new)

    def _history(self, key: str) -> dict[int, float]:
        """{step: value} of a metric (the last value logged at a step wins)."""
        rows = call(self.tracker.client.get_metric_history, self.tracker.run_id, key)
        return {int(m.step): float(m.value) for m in sorted(rows, key=lambda m: (m.step, m.timestamp))}

    def _train_step(self, step: int, verl: Mapping[str, float]) -> None:
        out = {c.stppo: c.scale * verl[c.verl] for c in TRAIN_COPIES if c.verl in verl}
        bad = any(not math.isfinite(verl[k]) for k in NONFINITE_KEYS if k in verl)
        out[K.SKIPPED_STEPS] = 1.0 if bad else 0.0
        was = self.detector.detected
        self.detector.update(step, out.get(K.SUCCESS_RATE), bad)
        out[K.COLLAPSE_DETECTED] = float(self.detector.detected)
        if self.detector.detected and not was:
            out[K.COLLAPSE_STEP] = float(self.detector.collapse_step)
            log.warning("stppo: verl run collapsed at step %d (%s)", self.detector.collapse_step,
                        self.detector.reason)
        self.tracker.log(step, out)
        self.step = step
