"""Tables per preset: collapse rate, final success with its t-interval, peak gradient norm, clip
ratio and KL; Welch's t-test between presets on final success; the exponential-growth fit of the
clipping-bias norm before collapse (the paper's Fig. 3d claim as a number).
"""

from __future__ import annotations

from itertools import combinations
from typing import Sequence

import numpy as np
import pandas as pd

from stppo import metric_names as T

from .collapse import collapse_table
from .identical import unit_column
from .load import Study
from .stats import GROUP, WELCH_TEST, bootstrap_diff_ci, bootstrap_mean_ci, fit_exponential, t_interval, welch_test

BOOTSTRAP = "95% percentile bootstrap CI of mean(a) - mean(b), {n} resamples per group"
# per-run means of the sampler vs trainer and staleness metrics (column of `per_run_table` -> metric;
# NaN for a run that did not log it: on-policy runs log no offpolicy/*, runs before them no rollout_corr/*)
MISMATCH_MEANS: dict[str, str] = {"mean_rollout_kl": T.ROLLOUT_CORR_KL,
                                  "mean_offpolicy_kl": T.OFFPOLICY_KL_TO_CURRENT,
                                  "mean_rollout_chi2": T.ROLLOUT_CORR_CHI2_TOKEN}


def per_run_value(study: Study, metric: str, how: str) -> pd.Series:
    """One number per run_id: how = 'last' (value at the last step), 'max' or 'mean' over steps."""
    m = study.metrics
    sub = m.loc[m["metric"] == metric, ["run_id", "step", "value"]]
    sub = sub[np.isfinite(sub["value"])]
    g = sub.sort_values(["run_id", "step"]).groupby("run_id", observed=True)["value"]
    out = {"last": g.last, "max": g.max, "mean": g.mean}[how]()
    out.index = out.index.astype(str)
    return out.reindex(study.runs["run_id"].astype(str))


def final_success(study: Study) -> pd.Series:
    """The last logged `val/success_rate` of each run (NaN when a run has none)."""
    return per_run_value(study, T.VAL_SUCCESS_RATE, "last")


def validation_auc(study: Study) -> pd.Series:
    """Area under each run's validation curve per step — the trapezoid mean of the live checks
    `val/live_success_rate` (of `val/success_rate` for runs without them) from its first to its
    last point; NaN with fewer than two points."""
    m = study.metrics
    out = {}
    for key in (T.VAL_SUCCESS_RATE, T.VAL_LIVE_SUCCESS_RATE):  # the live checks win where logged
        sub = m.loc[(m["metric"] == key) & np.isfinite(m["value"]), ["run_id", "step", "value"]]
        for rid, g in sub.sort_values(["run_id", "step"]).groupby("run_id", observed=True):
            x, y = g["step"].to_numpy(float), g["value"].to_numpy(float)
            if len(x) >= 2 and x[-1] > x[0]:
                out[str(rid)] = float(np.sum((y[1:] + y[:-1]) / 2 * np.diff(x)) / (x[-1] - x[0]))
    return pd.Series(out, dtype="float64").reindex(study.runs["run_id"].astype(str))


def _grad_peak(study: Study) -> pd.Series:
    peak = per_run_value(study, T.GRAD_NORM_MAX, "max")
    return peak.fillna(per_run_value(study, T.GRAD_NORM, "max"))


def per_run_table(study: Study, collapse: pd.DataFrame | None = None) -> pd.DataFrame:
    """One row per run: tags, status, its unit (`analysis.identical`), collapse (its onset
    `collapse_step` and what decided it, `collapse_source`), final success, the area under its
    validation curve (`val_auc`), the stability summaries (the mean step KL `mean_step_kl` among
    them, and `clip_bias_triggered`: how often a clipping-bias scale acted) and the mean of each
    mismatch metric (`MISMATCH_MEANS`)."""
    col = (collapse if collapse is not None else collapse_table(study)).set_index("run_id")
    runs = study.runs.set_index("run_id")
    out = runs[["experiment", "run_name", "algo", "model", "task", "seed", "sweep", "git_commit", "status"]].copy()
    out["unit"] = unit_column(study).reindex(out.index.astype(str)).to_numpy()
    out["collapsed"] = col["collapsed"]
    out["collapse_step"] = col["collapse_step"]
    out["collapse_source"] = col["source"]
    out["last_step"] = col["last_step"]
    out["final_success"] = final_success(study).to_numpy()
    out["val_auc"] = validation_auc(study).to_numpy()
    out["final_train_success"] = per_run_value(study, T.SUCCESS_RATE, "last").to_numpy()
    out["peak_grad_norm"] = _grad_peak(study).to_numpy()
    out["mean_clipfrac"] = per_run_value(study, T.PG_CLIPFRAC, "mean").to_numpy()
    out["mean_ppo_kl"] = per_run_value(study, T.PPO_KL, "mean").to_numpy()
    out["mean_step_kl"] = per_run_value(study, T.STEP_KL, "mean").to_numpy()
    out["mean_kl_ref"] = per_run_value(study, T.KL_REF, "mean").to_numpy()
    # how often the clipping-bias scale acted (the fraction of minibatches with λ < 1; NaN without one)
    out["clip_bias_triggered"] = per_run_value(study, T.CLIP_BIAS_TRIGGERED, "mean").to_numpy()
    for column, metric in MISMATCH_MEANS.items():
        out[column] = per_run_value(study, metric, "mean").to_numpy()
    return out.reset_index()


def preset_table(study: Study, *, by: Sequence[str] = GROUP, confidence: float = 0.95,
                 runs: pd.DataFrame | None = None) -> pd.DataFrame:
    """Per (*by): collapse k/n and rate, median collapse step, final success mean with its t-interval
    half-width (`final_success_ci`) and a range-respecting 95% bootstrap interval
    (`final_success_ci_low/high`, within [0, 1]), mean over runs of the peak grad norm, of the mean
    clip ratio and of the mean KL values."""
    runs = runs if runs is not None else per_run_table(study)
    rows = []
    for key, grp in runs.groupby(list(by), sort=True):
        k, n = int(grp["collapsed"].sum()), len(grp)
        mean, half, n_final = t_interval(grp["final_success"], confidence)
        low, high = bootstrap_mean_ci(grp["final_success"], confidence=confidence)
        steps = grp.loc[grp["collapsed"], "collapse_step"]
        rows.append({**dict(zip(by, key)), "runs": n, "collapsed": f"{k}/{n}", "collapse_rate": k / n,
                     "median_collapse_step": float(steps.median()) if len(steps) else np.nan,
                     "final_success_mean": mean, "final_success_ci": half, "final_success_n": n_final,
                     "final_success_ci_low": low, "final_success_ci_high": high,
                     "peak_grad_norm": _mean(grp["peak_grad_norm"]), "clip_ratio": _mean(grp["mean_clipfrac"]),
                     "ppo_kl": _mean(grp["mean_ppo_kl"]), "kl_ref": _mean(grp["mean_kl_ref"])})
    return pd.DataFrame(rows)


def _mean(x: pd.Series) -> float:
    x = x[np.isfinite(x.astype("float64"))]
    return float(x.mean()) if len(x) else np.nan


def significance_table(study: Study, *, within: Sequence[str] = ("model", "task"), n_boot: int = 10_000,
                       seed: int = 0, runs: pd.DataFrame | None = None) -> pd.DataFrame:
    """Every pair of presets within each (*within): Welch's t-test on final success and a bootstrap
    CI of the difference of means; the `test` column names both."""
    runs = runs if runs is not None else per_run_table(study)
    rows = []
    for key, grp in runs.groupby(list(within), sort=True):
        samples = {a: g["final_success"].to_numpy(float) for a, g in grp.groupby("algo", sort=True)}
        for a, b in combinations(sorted(samples), 2):
            x, y = samples[a], samples[b]
            res = welch_test(x, y)
            low, high = bootstrap_diff_ci(x, y, n_boot=n_boot, seed=seed)
            rows.append({**dict(zip(within, key)), "a": a, "b": b, "n_a": int(np.isfinite(x).sum()),
                         "n_b": int(np.isfinite(y).sum()), "mean_a": _mean(pd.Series(x)),
                         "mean_b": _mean(pd.Series(y)), "diff": _mean(pd.Series(x)) - _mean(pd.Series(y)),
                         "diff_ci_low": low, "diff_ci_high": high, **res,
                         "test": f"{WELCH_TEST}; {BOOTSTRAP.format(n=n_boot)}"})
    return pd.DataFrame(rows)


def growth_table(study: Study, *, window: int = 20, control: str = "last",
                 collapse: pd.DataFrame | None = None, metric: str = T.CLIP_BIAS_NORM) -> pd.DataFrame:
    """Fit log(`clip_bias/norm`) = a + b·step per run over a window of `window` steps.

    Collapsed runs: steps c−window ≤ s < c before the collapse step c. Others (`control`):
    'last' — their last `window` steps; 'matched' — the window of the median collapse step of the
    collapsed runs with the same (model, task) (their last steps when there is none)."""
    if control not in ("last", "matched"):
        raise ValueError(f"control must be one of 'last', 'matched', got {control!r}")
    if window < 3:
        raise ValueError(f"window must be >= 3 steps, got {window}")
    col = collapse if collapse is not None else collapse_table(study)
    m = study.metrics
    sub = m[m["metric"] == metric]
    curves = {str(r): g[["step", "value"]] for r, g in sub.groupby("run_id", observed=True)}
    median_c = col[col["collapsed"]].groupby(["model", "task"])["collapse_step"].median()
    rows = []
    for _, r in col.iterrows():
        curve = curves.get(str(r["run_id"]))
        if r["collapsed"]:
            end, kind = r["collapse_step"], "before collapse"
        elif control == "matched" and (r["model"], r["task"]) in median_c.index:
            end, kind = median_c[(r["model"], r["task"])], "matched window"
        else:
            end, kind = (curve["step"].max() + 1 if curve is not None else np.nan), "last steps"
        start = end - window
        if curve is None:
            pts = pd.DataFrame({"step": [], "value": []})
        else:
            pts = curve[(curve["step"] >= start) & (curve["step"] < end)]
        fit = fit_exponential(pts["step"], pts["value"])
        rows.append({"run_id": r["run_id"], "algo": r["algo"], "model": r["model"], "task": r["task"],
                     "seed": r["seed"], "collapsed": r["collapsed"], "window": kind,
                     "window_start": start, "window_end": end - 1, "growth_rate": fit["b"], "r2": fit["r2"],
                     "doubling_steps": fit["doubling_steps"], "points": fit["n"]})
    return pd.DataFrame(rows)


def growth_summary(growth: pd.DataFrame) -> pd.DataFrame:
    """Per (algo, model, task, collapsed): runs, median growth rate per step and median R²."""
    if growth.empty:
        cols = ["algo", "model", "task", "collapsed", "runs", "median_growth_rate", "median_r2"]
        return pd.DataFrame(columns=cols)
    g = growth.groupby(["algo", "model", "task", "collapsed"], sort=True)
    return g.agg(runs=("run_id", "count"), median_growth_rate=("growth_rate", "median"),
                 median_r2=("r2", "median")).reset_index()


def repeated_seeds(runs: pd.DataFrame, study: Study, key: Sequence[str]) -> pd.Series:
    """Per run of a per-run table: whether an earlier-started run has the same values of `key` (a
    cell's seed run twice — a multirun repeated — is one replicate, not two: the first is kept)."""
    start = runs["run_id"].map(study.runs.set_index("run_id")["start_time"])
    return runs.assign(_start=start).sort_values("_start", kind="stable").duplicated(
        list(key), keep="first").reindex(runs.index)

