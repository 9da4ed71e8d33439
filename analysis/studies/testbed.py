"""The testbed's calibration table (docs/results/testbed): one row per run, and the targets.

    python -m analysis.studies.testbed --tracking-uri sqlite:///testbed.db [--tracking-uri URI …] --out docs/results/testbed

Per run (experiments `testbed` — on-policy — and `testbed_reuse` — the minibatch-reuse regime —
and any other given): the preset, model, seed and actor lr; the warm start's greedy validation
(step 0, `val/success_rate`) and the final one; the gain; the live checks' peak, the step of the
peak and the lowest check after it; `shape` — the live checks rise by ≥ 0.2 above the warm start
and then fall below half of their peak (the paper's picture); the collapse onset by the live rule;
the area under the validation curve; the run's wall time (MLflow's start to end, warm start
loaded from the cache) and its steps' time. The targets (docs/results/testbed/README.md) are
checked on these rows and printed with the numbers they rest on.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Sequence

import numpy as np
import pandas as pd

from stppo import metric_names as T
from stppo.config import param_names as P
from stppo.tracker import resolve_uri

from ..export import merge_stores
from ..load import Study
from ..params import param_column
from ..store import AnalysisError
from ..tables import per_run_table

ON_POLICY, REUSE = "testbed", "testbed_reuse"
RISE, FALL = 0.2, 0.5  # the paper's shape: a rise of ≥ RISE, then below FALL × the peak
TABLE_COLUMNS = ("experiment", "algo", "model", "seed", "lr", "warm_start", "final", "gain", "peak",
                 "peak_step", "low_after_peak", "shape", "collapsed", "collapse_step", "val_auc", "wall_s",
                 "steps_s", "steps")


def live_shape(live: pd.Series) -> dict:
    """Peak, its step, the lowest check after it, and whether the series rose by ≥ RISE above
    its first value and then fell below FALL × its peak. `live`: value by step, sorted."""
    if live.empty:
        return {"peak": np.nan, "peak_step": np.nan, "low_after_peak": np.nan, "shape": False}
    peak_step = int(live.idxmax())
    peak = float(live.max())
    after = live[live.index > peak_step]
    low = float(after.min()) if len(after) else np.nan
    shape = peak - float(live.iloc[0]) >= RISE and bool(len(after)) and low < FALL * peak
    return {"peak": peak, "peak_step": peak_step, "low_after_peak": low, "shape": shape}


def calibration_table(study: Study) -> pd.DataFrame:
    """One row per run (module docstring)."""
    runs = per_run_table(study)
    runs["lr"] = pd.to_numeric(param_column(runs, study.params, P.ACTOR_LR)).to_numpy()
    m = study.metrics
    rows = []
    times = study.runs.set_index("run_id")[["start_time", "end_time"]]
    for r in runs.itertuples():
        mine = m[m["run_id"] == r.run_id]

        def series(key: str) -> pd.Series:
            s = mine[mine["metric"] == key].sort_values("step")
            return pd.Series(s["value"].to_numpy(float), index=s["step"].to_numpy(int))

        val, steps = series(T.VAL_SUCCESS_RATE), series(T.STEP_TIME)
        start, end = times.loc[r.run_id, "start_time"], times.loc[r.run_id, "end_time"]
        wall = (pd.Timestamp(end) - pd.Timestamp(start)).total_seconds() if pd.notna(end) else np.nan
        warm = float(val.get(0, np.nan))
        rows.append({"experiment": r.experiment, "algo": r.algo, "model": r.model, "seed": int(r.seed), "lr": r.lr,
                     "warm_start": warm, "final": r.final_success, "gain": r.final_success - warm,
                     **live_shape(series(T.VAL_LIVE_SUCCESS_RATE)), "collapsed": bool(r.collapsed),
                     "collapse_step": r.collapse_step, "val_auc": r.val_auc, "wall_s": wall,
                     "steps_s": float(steps.sum()), "steps": int(steps.index.max()) if len(steps) else 0})
    return pd.DataFrame(rows, columns=list(TABLE_COLUMNS)).sort_values(
        ["experiment", "model", "algo", "lr", "seed"], ignore_index=True)


def targets(table: pd.DataFrame) -> list[str]:
    """One line per calibration target: what it asks, what the runs show, met or not."""
    lines = []
    tiny = table[table["model"] == "tiny"]
    on = tiny[tiny["experiment"] == ON_POLICY]
    warm = on["warm_start"]
    if len(warm):
        lines.append(_line(warm.between(0.20, 0.40).all(), "tiny's warm start in [0.20, 0.40]",
                           f"greedy validation {warm.min():.3f}–{warm.max():.3f} on 200 held-out questions"))
    for algo in ("ppo", "grpo"):
        g = on[on["algo"] == algo]
        if len(g):
            lines.append(_line(g["final"].mean() >= 0.75 and (g["gain"] >= 0.25).all(),
                               f"on-policy {algo}: final ≥ 0.75 (mean), every seed gains ≥ 0.25",
                               f"final {g['final'].mean():.3f} over {len(g)} seeds "
                               f"({', '.join(f'{x:.2f}' for x in g['final'])}); gains ≥ {g['gain'].min():.2f}"))
    if len(on):
        med = on.groupby("algo")["wall_s"].median()
        lines.append(_line(bool((med <= 240).all()), "one run ≤ 4 min on one thread (2 jobs on 2 cores)",
                           "median wall " + ", ".join(f"{a} {s / 60:.1f} min" for a, s in med.items())))
    reuse = tiny[(tiny["experiment"] == REUSE) & (tiny["algo"] == "ppo")]
    if len(reuse):
        for lr, g in reuse.groupby("lr"):
            k = int(g["shape"].sum())
            lines.append(_line(k >= 3, f"reuse regime, ppo at lr {lr:g}: rise ≥ {RISE}, then below {FALL} × "
                                       "peak, in ≥ 3 of 5 seeds", f"{k} of {len(g)} seeds"))
    for model in sorted(set(table["model"]) - {"tiny"}):
        g = table[(table["model"] == model) & (table["experiment"] == ON_POLICY)]
        if len(g) and len(warm):
            ok = abs(g["warm_start"].mean() - warm.mean()) <= 0.05 and (g["gain"] >= 0.25).all()
            lines.append(_line(ok, f"{model}: warm start within ±0.05 of tiny's, and it learns (gain ≥ 0.25)",
                               f"warm start {g['warm_start'].mean():.3f} (tiny {warm.mean():.3f}), gains "
                               f"{', '.join(f'{x:.2f}' for x in g['gain'])} in {int(g['steps'].max())} steps"))
    return lines


def _line(ok: bool, what: str, shown: str) -> str:
    return f"[{'met' if ok else 'NOT met'}] {what}: {shown}"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m analysis.studies.testbed", description=__doc__.splitlines()[0])
    p.add_argument("--tracking-uri", action="append", default=None,
                   help="a calibration store (default: MLFLOW_TRACKING_URI); repeat to merge stores")
    p.add_argument("--experiment", nargs="+", default=[ON_POLICY, REUSE])
    p.add_argument("--out", required=True, type=Path)
    a = p.parse_args(argv)
    try:
        study = merge_stores(a.experiment, [resolve_uri(u) for u in (a.tracking_uri or [None])], finished_only=True)
    except AnalysisError as e:
        print(f"python -m analysis.studies.testbed: error: {e}", file=sys.stderr)
        return 2
    table = calibration_table(study)
    a.out.mkdir(parents=True, exist_ok=True)
    table.to_csv(a.out / "calibration.csv", index=False)
    lines = targets(table)
    (a.out / "targets.txt").write_text("".join(f"{line}\n" for line in lines))
    print("\n".join(lines))
    print(f"wrote calibration.csv ({len(table)} runs) and targets.txt to {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
