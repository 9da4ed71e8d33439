"""Collapse of each run, recomputed with the one rule of `stppo.diagnostics` (docs/design.md §4).

Input per run: `env/success_rate` at steps 1..S and non-finite flags `actor/skipped_steps > 0`,
with the run's own collapse settings (params ending in `collapse.<field>`). A run whose recomputed
series shows no collapse but which logged `collapse/detected` = 1 (it stopped early) is collapsed
at its logged `collapse/step` (else the first step where `collapse/detected` = 1).
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from stppo import metric_names as T
from stppo.diagnostics import CollapseDetector

from .load import Study, collapse_config

COLLAPSE_COLUMNS: tuple[str, ...] = (
    "run_id", "algo", "model", "task", "seed", "status", "collapsed", "collapse_step", "reason",
    "logged_step", "last_step",
)
_KEYS = (T.SUCCESS_RATE, T.SKIPPED_STEPS, T.COLLAPSE_DETECTED, T.COLLAPSE_STEP)


def run_collapse(success: pd.Series, skipped: pd.Series, cfg) -> tuple[int | None, str | None]:
    """(collapse step, reason) of one run; `success` and `skipped` are indexed by step."""
    steps = sorted(set(success.index) | set(skipped.index))
    det = CollapseDetector(cfg)
    for s in steps:
        x = success.get(s)
        bad = s in skipped.index and (not math.isfinite(skipped[s]) or skipped[s] > 0)
        if det.update(int(s), None if x is None or not math.isfinite(x) else float(x), bool(bad)):
            break
    return det.collapse_step, det.reason


def collapse_table(study: Study) -> pd.DataFrame:
    """One row per run: collapsed, collapse_step (NaN if none), reason, logged_step, last_step."""
    m = study.metrics
    sub = m[m["metric"].isin(_KEYS)]
    series = {rid: grp for rid, grp in sub.groupby("run_id", observed=True, sort=False)}
    last = m.groupby("run_id", observed=True)["step"].max()
    rows = []
    for _, run in study.runs.iterrows():
        grp = series.get(run["run_id"], sub.iloc[:0])
        per = {k: g.set_index("step")["value"] for k, g in grp.groupby("metric", observed=True)}
        empty = pd.Series(dtype="float64")
        success = per.get(T.SUCCESS_RATE, empty)
        success = success[success.index >= 1]  # step 0 would be the warm start, not an update
        step, reason = run_collapse(success, per.get(T.SKIPPED_STEPS, empty), collapse_config(run))
        logged = _logged_step(per.get(T.COLLAPSE_DETECTED, empty), per.get(T.COLLAPSE_STEP, empty))
        if step is None and logged is not None:
            step, reason = logged, "logged by the trainer (collapse/step)"
        rows.append({"run_id": run["run_id"], "algo": run["algo"], "model": run["model"], "task": run["task"],
                     "seed": run["seed"], "status": run["status"], "collapsed": step is not None,
                     "collapse_step": float(step) if step is not None else np.nan, "reason": reason or "",
                     "logged_step": float(logged) if logged is not None else np.nan,
                     "last_step": float(last.get(run["run_id"], np.nan))})
    return pd.DataFrame(rows, columns=list(COLLAPSE_COLUMNS))


def _logged_step(detected: pd.Series, step: pd.Series) -> int | None:
    if not (detected.fillna(0) > 0).any():
        return None
    if len(step.dropna()):
        return int(step.dropna().iloc[0])
    return int(detected[detected > 0].index.min())
