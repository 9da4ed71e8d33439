"""While verl trains: read the run's verl-named metrics, write stppo-named copies, apply the
collapse rule and the online alarms, and compute the sweep objective — so that a verl run reads
like an own run.

`RunMonitor.poll()` is called every `backend.poll_s` seconds (and once after verl exits). Each
call lists the run's metric keys, reads the histories of the mapped ones present (`metrics.py`)
and handles every new training step in step order, as the own trainer logs a step:

    copies (TRAIN_COPIES, LOSS_COPIES, turn_copies(K))   stppo's names of verl's values
    actor/skipped_steps                                  1.0 when verl's grad norm or loss is non-finite
    CollapseDetector.observe_step(step, non-finite)      the one collapse rule (stppo.diagnostics);
                                                         collapse/detected every step, collapse/step once
    AlarmSet.update(step, view)                          the online alarms (stppo.alarms) on the
                                                         step's stppo-named values; alarm/<name> = 1.0
                                                         at the step one fires

New validation points are copied to `val/success_rate` and `val/live_success_rate`: verl's
validation of the live weights is the live check the collapse rule reads
(`CollapseDetector.observe_validation`; the launcher sets verl's `test_freq` to
`trainer.collapse.every` when that is more often than `val_every`). Training steps and validation
points are handled in step order, a validation after the training step of its number.
`should_stop` / `stop_reason` tell the launcher to stop verl: a collapse with `stop_on_collapse`
(a non-finite collapse always), an alarm with `on_alarm='stop'`. Copies go through stppo's
`Tracker` (retries, buffering while the store is away). Verl-free and torch-free.
"""

from __future__ import annotations

import logging
import math
from typing import Mapping

from stppo import metric_names as K
from stppo.alarms import INDICATORS, AlarmConfig, AlarmSet
from stppo.diagnostics import CollapseConfig, collapse_detector
from stppo.integrations.verl.metrics import (LOSS_COPIES, NONFINITE_KEYS, SAME_NAME, STEP_KEY, TRAIN_COPIES,
                                             copy_values, namespace_copies, turn_copies, val_key)
from stppo.tracker import Tracker
from stppo.mlflow_store import call

log = logging.getLogger(__name__)
# What the alarms may read under the same name in both (actor/grad_norm, response_length/mean, …).
ALARM_KEYS: tuple[str, ...] = tuple(dict.fromkeys(k for ind in INDICATORS.values() for k in ind.keys))


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
                 collapse: CollapseConfig | None = None, stop_on_collapse: bool = False,
                 alarm: AlarmConfig | None = None, on_alarm: str = "none", max_turns: int = 0,
                 namespace: str | None = None) -> None:
        if on_alarm not in ("none", "stop"):
            raise ValueError(f"trainer.on_alarm={on_alarm!r}: with backend=verl use none or stop "
                             "(verl has no rollback)")
        self.tracker = tracker
        self.val_key = val_key(data_source)
        self.total_steps = total_steps
        self.stop_on_collapse = stop_on_collapse
        self.on_alarm = on_alarm
        self.detector = collapse_detector(collapse or CollapseConfig())
        self.alarms = AlarmSet(alarm, (collapse or CollapseConfig()).sampled)
        self.alarm_stop: str | None = None  # 'alarm NAME at step S' once on_alarm=stop fires
        self.step = 0  # last training step handled
        self.val_history: list[tuple[int, float]] = []
        self.copies = (*TRAIN_COPIES, *LOSS_COPIES, *turn_copies(max_turns))
        self.namespace = namespace  # a stabiliser's own metrics: `actor/<namespace>/…` copied back
        self.same = tuple(dict.fromkeys((*SAME_NAME, *ALARM_KEYS)))  # a copy of this step wins over these
        self._keys = tuple(dict.fromkeys([STEP_KEY, *NONFINITE_KEYS, *self.same,
                                          *(k for c in self.copies for k in (c.verl, c.per) if k)]))

    @property
    def stop_reason(self) -> str | None:
        """Why verl should stop now, or None: a collapse with stop_on_collapse (non-finite
        collapses always, as in the own trainer), or an alarm with on_alarm=stop."""
        d = self.detector
        if d.detected and (self.stop_on_collapse or (d.reason or "").startswith("non-finite")):
            return f"collapse at step {d.collapse_step} ({d.reason})"
        return self.alarm_stop

    @property
    def should_stop(self) -> bool:
        return self.stop_reason is not None

    def objective(self) -> float:
        return late_mean(self.val_history, self.step, self.total_steps)

    def poll(self) -> int:
        """Handle what verl logged since the last call; returns the number of new train steps."""
        logged = set(call(self.tracker.client.get_run, self.tracker.run_id).data.metrics)
        if self.namespace:
            own = namespace_copies(self.namespace, logged)
            self.copies = tuple(dict.fromkeys((*self.copies, *own)))
            self._keys = tuple(dict.fromkeys((*self._keys, *(c.verl for c in own))))
        hist = {k: self._history(k) for k in self._keys if k in logged}
        new = sorted(s for s in hist.get(STEP_KEY, {}) if s > self.step)
        last_val = self.val_history[-1][0] if self.val_history else -1
        vals = [(s, v) for s, v in sorted(self._history(self.val_key).items() if self.val_key in logged else ())
                if s > last_val]
        events = sorted([(s, 0, None) for s in new] + [(s, 1, v) for s, v in vals], key=lambda e: e[:2])
        for s, kind, v in events:
            if kind == 0:
                self._train_step(s, {k: h[s] for k, h in hist.items() if s in h})
            else:
                self._validation(s, v)
        return len(new)

    def _validation(self, step: int, v: float) -> None:
        self.val_history.append((step, v))
        out = {K.VAL_SUCCESS_RATE: v, K.VAL_LIVE_SUCCESS_RATE: v}
        was = self.detector.detected
        self.detector.observe_validation(step, v)
        out |= self._collapse_marks(was)
        self.tracker.log(step, out)

    def _history(self, key: str) -> dict[int, float]:
        """{step: value} of a metric (the last value logged at a step wins)."""
        rows = call(self.tracker.client.get_metric_history, self.tracker.run_id, key)
        return {int(m.step): float(m.value) for m in sorted(rows, key=lambda m: (m.step, m.timestamp))}

    def _train_step(self, step: int, verl: Mapping[str, float]) -> None:
        out = copy_values(self.copies, verl)
        bad = any(not math.isfinite(verl[k]) for k in NONFINITE_KEYS if k in verl)
        out[K.SKIPPED_STEPS] = 1.0 if bad else 0.0
        self._collapse(step, out, bad)
        self._alarms(step, out, {**{k: verl[k] for k in self.same if k in verl}, **out})
        self.tracker.log(step, out)
        self.step = step

    def _collapse(self, step: int, out: dict[str, float], bad: bool) -> None:
        was = self.detector.detected
        self.detector.observe_step(step, bad, out.get(K.SUCCESS_RATE))
        out |= self._collapse_marks(was)

    def _collapse_marks(self, was: bool) -> dict[str, float]:
        """collapse/detected, and collapse/step when the detector fired just now."""
        out = {K.COLLAPSE_DETECTED: float(self.detector.detected)}
        if self.detector.detected and not was:
            out[K.COLLAPSE_STEP] = float(self.detector.collapse_step)
            log.warning("stppo: verl run collapsed at step %d (%s)", self.detector.collapse_step,
                        self.detector.reason)
        return out

    def _alarms(self, step: int, out: dict[str, float], view: Mapping[str, float]) -> None:
        """Feed the alarms the step's stppo-named values; log alarm/<name> for those that fire
        (the own trainer's `_on_alarms`, without rollback)."""
        fired = self.alarms.update(step, view)
        out.update({K.alarm_key(n): 1.0 for n in fired})
        if fired and self.on_alarm == "stop" and self.alarm_stop is None:
            self.alarm_stop = f"alarm {', '.join(fired)} at step {step}"
            log.warning("stppo: %s (trainer.on_alarm=stop)", self.alarm_stop)
