"""Collapse of each run, recomputed with the one rule of `stppo.diagnostics` (docs/design.md §4).

A run's rule is its own (`Study.runs.collapse_rule`, with its settings):
* `live` — the live policy's greedy checks `val/live_success_rate` (step 0 on) and non-finite
  flags `actor/skipped_steps > 0` at steps 1..S;
* `sampled` — runs from before the live checks (studies v2 and v3): `env/success_rate` at steps
  1..S and the same non-finite flags, by the sampled-success rule they were run with.
A run whose recomputed series shows no collapse but which logged `collapse/detected` = 1 (it
stopped early) is collapsed at its logged `collapse/step` (else the first step where
`collapse/detected` = 1). `source` says which series decided: `live`, `sampled`, `non-finite` or
`logged`.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from stppo import metric_names as T
from stppo.diagnostics import CollapseConfig, detect_collapse, detect_sampled_collapse

from .load import Study, collapse_config

COLLAPSE_COLUMNS: tuple[str, ...] = (
    "run_id", "algo", "model", "task", "seed", "status", "collapsed", "collapse_step", "reason",
    "source", "logged_step", "last_step",
)
_KEYS = (T.SUCCESS_RATE, T.VAL_LIVE_SUCCESS_RATE, T.SKIPPED_STEPS, T.COLLAPSE_DETECTED, T.COLLAPSE_STEP)


def _flags(skipped: pd.Series) -> list[tuple[int, bool]]:
    return [(int(s), not math.isfinite(v) or v > 0) for s, v in skipped.items()]


def _values(x: pd.Series) -> list[tuple[int, float | None]]:
    return [(int(s), float(v) if math.isfinite(v) else None) for s, v in x.items()]


def run_collapse(per: dict[str, pd.Series], cfg: CollapseConfig) -> tuple[int | None, str | None]:
    """(collapse step, reason) of one run from its series {metric: values by step} under its rule
    `cfg` (`cfg.rule`: live, or sampled)."""
    empty = pd.Series(dtype="float64")
    skipped = per.get(T.SKIPPED_STEPS, empty).sort_index()
    if cfg.rule == "live":
        checks = per.get(T.VAL_LIVE_SUCCESS_RATE, empty).sort_index()
        return detect_collapse(_values(checks), _flags(skipped), cfg)
    success = per.get(T.SUCCESS_RATE, empty)
    success = success[success.index >= 1]  # step 0 would be the warm start, not an update
    steps = sorted(set(success.index) | set(skipped.index))
    flags = dict(_flags(skipped))
    x = [success.get(s) for s in steps]
    return detect_sampled_collapse(steps, [None if v is None or not math.isfinite(v) else float(v) for v in x],
                                   [flags.get(s, False) for s in steps], cfg.sampled, cfg.nonfinite_patience)


def collapse_table(study: Study) -> pd.DataFrame:
    """One row per run: collapsed, collapse_step (NaN if none), reason, source, logged_step,
    last_step."""
    m = study.metrics
    sub = m[m["metric"].isin(_KEYS)]
    series = {rid: grp for rid, grp in sub.groupby("run_id", observed=True, sort=False)}
    last = m.groupby("run_id", observed=True)["step"].max()
    rows = []
    for _, run in study.runs.iterrows():
        grp = series.get(run["run_id"], sub.iloc[:0])
        per = {k: g.set_index("step")["value"] for k, g in grp.groupby("metric", observed=True)}
        cfg = collapse_config(run)
        step, reason = run_collapse(per, cfg)
        source = None if step is None else "non-finite" if reason.startswith("non-finite") else cfg.rule
        empty = pd.Series(dtype="float64")
        logged = _logged_step(per.get(T.COLLAPSE_DETECTED, empty), per.get(T.COLLAPSE_STEP, empty))
        if step is None and logged is not None:
            step, reason, source = logged, "logged by the trainer (collapse/step)", "logged"
        rows.append({"run_id": run["run_id"], "algo": run["algo"], "model": run["model"], "task": run["task"],
                     "seed": run["seed"], "status": run["status"], "collapsed": step is not None,
                     "collapse_step": float(step) if step is not None else np.nan, "reason": reason or "",
                     "source": source or "", "logged_step": float(logged) if logged is not None else np.nan,
                     "last_step": float(last.get(run["run_id"], np.nan))})
    return pd.DataFrame(rows, columns=list(COLLAPSE_COLUMNS))


def _logged_step(detected: pd.Series, step: pd.Series) -> int | None:
    if not (detected.fillna(0) > 0).any():
        return None
    if len(step.dropna()):
        return int(step.dropna().iloc[0])
    return int(detected[detected > 0].index.min())
