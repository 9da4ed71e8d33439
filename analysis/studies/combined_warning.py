"""One alarm from every indicator: a logistic model on the online alarm statistics, measured
out of sample against the best single indicator (docs/design.md §4, "Early warning").

Features. For run r at step t, x_{r,t} = (a_{r,t}^i)_i: the alarm statistic of every indicator i of
`stppo.alarms` at that step (`analysis.warning.run_statistics`: the robust z-score against the
run's first values, held for `persist` values), clipped to [−Z_CLIP, Z_CLIP]; an indicator not yet
defined (baseline) or not logged contributes 0 (no evidence either way). The indicators are every
one of the registry, the mismatch and staleness ones included (`rollout_chi2`, `offpolicy_kl`,
`rollout_is_ess_drop`): runs that did not log their metrics (study v2's, on-policy without
`trainer.offpolicy`) have 0 for them at every step.

Model. c_{r,t} = b + w·(x_{r,t} − μ)/σ, a logistic regression with an L2 penalty (strength `l2`
on w, not on b; μ, σ the training rows' mean and std), fitted on step rows labelled
    1  steps of a collapsed run in [onset − horizon, onset]  (the stretch an alarm should cover),
    0  every step of a run without collapse,
and no label (left out of the fit) for a collapsed run's earlier steps and everything after its
onset. Rows are weighted so that each run counts once: a row's weight is 1 / (its run's labelled
rows), then the two classes are balanced to equal total weight.

Alarm. The combined alarm fires at the first step with c_{r,t} ≥ θ. The run's score S is the max
of c over its window (collapsed: steps ≤ onset; otherwise every step), as for a single indicator
(`analysis.warning`). θ is fixed on the training runs: the smallest threshold whose false-alarm
rate over the training runs without collapse is ≤ `max_false_alarm` (ties broken upward).

Evaluation. Cross-validation grouped by preset (leave one preset out): the fold of a run is its
base preset (`analysis.axes.base_preset` of `algo`; the runs' `algo` tag is the preset already,
a per-run table's label may carry the correction), so the runs of a preset with a rollout
correction or in the coupled form (`grpo+decoupled_geo_rs`, `ppo+bypass_ppo_clip`) are held out
with their preset's: no preset is both fitted and tested on. For every held-out run: its score,
θ of its fold, first alarm, warned, lead time (onset − first alarm) or false alarm. The pooled
ROC AUC ranks the held-out runs by their margin S − θ_fold (the decision each fold actually
makes). The baseline, "best single", is chosen on the training runs of each fold too — the
indicator with the highest training AUC, its own threshold fixed on the training runs the same
way — and evaluated on the held-out runs.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import pandas as pd

from stppo.alarms import AlarmConfig

from ..axes import base_preset
from ..collapse import collapse_table
from ..identical import one_per_unit
from ..logistic import false_alarm_threshold, fit_logistic, run_balanced_weights
from ..store import AnalysisError
from ..warning import roc_auc, roc_curve, run_statistics

Z_CLIP = 10.0
COMBINED = "combined"
BEST_SINGLE = "best single"
RUN_COLUMNS = ("run_id", "algo", "fold", "model", "collapsed", "onset", "score", "threshold", "margin",
               "first_alarm", "warned", "lead", "false_alarm", "indicator")
TABLE_COLUMNS = ("alarm", "runs", "collapsed_runs", "warned", "lead_median", "lead_q1", "lead_q3",
                 "stable_runs", "false_alarms", "false_alarm_rate", "auc", "auc_fold_mean", "folds")


@dataclass(frozen=True)
class Settings:
    horizon: int = 5  # steps before the onset labelled 1
    l2: float = 1.0
    max_false_alarm: float = 0.1
    group: str = "algo"  # the cross-validation's groups (a preset label counts as its base preset)


# --- features and labels ---------------------------------------------------------------------------
def feature_frame(stats: pd.DataFrame, indicators: Sequence[str]) -> pd.DataFrame:
    """Rows (run_id, step) where any indicator is defined, columns `indicators`: a_t clipped to
    ±Z_CLIP, 0 where undefined. `stats` is `analysis.warning.run_statistics` (steps ≥ 0)."""
    s = stats[(stats["step"] >= 0) & np.isfinite(stats["stat"])]
    wide = s.pivot_table(index=["run_id", "step"], columns="indicator", values="stat", aggfunc="max")
    wide = wide.reindex(columns=list(indicators)).clip(-Z_CLIP, Z_CLIP).fillna(0.0)
    wide.columns.name = None
    return wide.sort_index()


def step_labels(index: pd.MultiIndex, collapse: pd.DataFrame, horizon: int) -> pd.Series:
    """1 / 0 / NaN (not in the fit) per (run_id, step) of `index`, by the module's rule."""
    col = collapse.assign(run_id=collapse["run_id"].astype(str)).set_index("run_id")
    rid = index.get_level_values(0).astype(str)
    step = index.get_level_values(1).to_numpy(np.float64)
    collapsed = col["collapsed"].reindex(rid).fillna(False).to_numpy(bool)
    onset = col["collapse_step"].reindex(rid).to_numpy(np.float64)
    y = np.where(collapsed, np.nan, 0.0)
    near = collapsed & (step <= onset) & (step >= onset - horizon)
    y[near] = 1.0
    return pd.Series(y, index=index, name="label")


# --- per-run evaluation ------------------------------------------------------------------------------
def run_outcomes(series: pd.Series, collapse: pd.DataFrame, threshold: float) -> pd.DataFrame:
    """Score, first alarm, warned, lead and false alarm per run of `series` (indexed (run_id,
    step): a decision value per step), at `threshold`, over each run's window."""
    col = collapse.assign(run_id=collapse["run_id"].astype(str)).set_index("run_id")
    rows = []
    for rid, s in series.groupby(level=0, sort=False):
        r = col.loc[str(rid)]
        steps = s.index.get_level_values(1).to_numpy(np.float64)
        vals = s.to_numpy(np.float64)
        onset = float(r["collapse_step"]) if r["collapsed"] else np.nan
        inwin = steps <= onset if r["collapsed"] else np.ones_like(steps, bool)
        score = float(vals[inwin].max()) if inwin.any() else -np.inf
        hits = steps[inwin & (vals >= threshold)]
        first = float(hits.min()) if hits.size else np.nan
        warned = bool(r["collapsed"]) and hits.size > 0
        rows.append({"run_id": str(rid), "collapsed": bool(r["collapsed"]), "onset": onset, "score": score,
                     "threshold": threshold, "margin": score - threshold, "first_alarm": first,
                     "warned": warned, "lead": onset - first if warned else np.nan,
                     "false_alarm": (not r["collapsed"]) and hits.size > 0})
    return pd.DataFrame(rows)


def _scores(series: pd.Series, collapse: pd.DataFrame) -> pd.DataFrame:
    return run_outcomes(series, collapse, np.inf)[["run_id", "collapsed", "score"]]


def _threshold_on(series: pd.Series, collapse: pd.DataFrame, max_rate: float) -> float:
    sc = _scores(series, collapse)
    return false_alarm_threshold(sc.loc[~sc["collapsed"], "score"], max_rate)


def cross_validate(features: pd.DataFrame, collapse: pd.DataFrame, runs: pd.DataFrame,
                   settings: Settings = Settings()) -> pd.DataFrame:
    """Held-out outcomes of the combined alarm and of the best single indicator per fold
    (columns RUN_COLUMNS; `indicator` = the combined model or the fold's chosen indicator)."""
    groups = runs.assign(run_id=runs["run_id"].astype(str)).set_index("run_id")[settings.group].astype(str)
    if settings.group == "algo":
        groups = groups.map(base_preset)
    rid = features.index.get_level_values(0).astype(str)
    fold_of = groups.reindex(rid).astype(str).to_numpy()
    labels = step_labels(features.index, collapse, settings.horizon).to_numpy()
    x = features.to_numpy(np.float64)
    info = runs.assign(run_id=runs["run_id"].astype(str)).set_index("run_id")
    out = []
    for fold in sorted(set(fold_of)):
        test, train = fold_of == fold, fold_of != fold
        fit_rows = train & np.isfinite(labels)
        y = labels[fit_rows]
        if not (y == 1).any() or not (y == 0).any():
            continue  # the training folds need both kinds of run
        model = fit_logistic(x[fit_rows], y, run_balanced_weights(rid[fit_rows], y), settings.l2)
        dec = pd.Series(model.decision(x), index=features.index)
        theta = _threshold_on(dec[train], collapse, settings.max_false_alarm)
        res = run_outcomes(dec[test], collapse, theta).assign(alarm=COMBINED, indicator=COMBINED)
        best, best_auc = None, -np.inf
        for name in features.columns:
            sc = _scores(features[name][train], collapse)
            auc = roc_auc(sc.loc[sc["collapsed"], "score"], sc.loc[~sc["collapsed"], "score"])
            if np.isfinite(auc) and auc > best_auc:
                best, best_auc = name, auc
        single = features[best]
        th = _threshold_on(single[train], collapse, settings.max_false_alarm)
        res_s = run_outcomes(single[test], collapse, th).assign(alarm=BEST_SINGLE, indicator=best)
        for frame in (res, res_s):
            frame["fold"] = fold
            frame["algo"] = info["algo"].reindex(frame["run_id"]).to_numpy()
            frame["model"] = info["model"].reindex(frame["run_id"]).to_numpy()
        out += [res, res_s]
    if not out:
        raise AnalysisError("no fold has training runs both with and without collapse")
    return pd.concat(out, ignore_index=True)[["alarm", *RUN_COLUMNS]]


def summary_table(outcomes: pd.DataFrame) -> pd.DataFrame:
    """Per alarm (combined, best single): held-out counts, lead median/IQR over warned runs,
    false alarms, pooled AUC of the margins and the mean per-fold AUC (folds with both kinds)."""
    rows = []
    for alarm, sub in outcomes.groupby("alarm", sort=False):
        pos, neg = sub[sub["collapsed"]], sub[~sub["collapsed"]]
        leads = pos.loc[pos["warned"], "lead"].to_numpy(np.float64)
        q1, med, q3 = np.quantile(leads, [0.25, 0.5, 0.75]) if leads.size else (np.nan,) * 3
        per_fold = [roc_auc(g.loc[g["collapsed"], "score"], g.loc[~g["collapsed"], "score"])
                    for _, g in sub.groupby("fold")]
        per_fold = [a for a in per_fold if np.isfinite(a)]
        fa = int(neg["false_alarm"].sum())
        rows.append({"alarm": alarm, "runs": len(sub), "collapsed_runs": len(pos), "warned": int(pos["warned"].sum()),
                     "lead_median": med, "lead_q1": q1, "lead_q3": q3, "stable_runs": len(neg),
                     "false_alarms": fa, "false_alarm_rate": fa / len(neg) if len(neg) else np.nan,
                     "auc": roc_auc(pos["margin"], neg["margin"]),
                     "auc_fold_mean": float(np.mean(per_fold)) if per_fold else np.nan,
                     "folds": sub["fold"].nunique()})
    return pd.DataFrame(rows, columns=list(TABLE_COLUMNS))


def coefficients(features: pd.DataFrame, collapse: pd.DataFrame, settings: Settings = Settings()) -> pd.Series:
    """The model fitted on every run (standardised weights, for reading; not an evaluation)."""
    labels = step_labels(features.index, collapse, settings.horizon).to_numpy()
    rows = np.isfinite(labels)
    rid = features.index.get_level_values(0).astype(str)
    model = fit_logistic(features.to_numpy(np.float64)[rows], labels[rows],
                         run_balanced_weights(rid[rows], labels[rows]), settings.l2)
    return pd.Series(np.append(model.w, model.b), index=[*features.columns, "(intercept)"], name="weight")


def fig_combined_roc(outcomes: pd.DataFrame):
    """Held-out ROC curves (pooled margins) of the combined alarm and the best single indicator."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(5.2, 4.6), layout="constrained")
    ax = fig.subplots()
    for i, (alarm, sub) in enumerate(outcomes.groupby("alarm", sort=False)):
        pos, neg = sub.loc[sub["collapsed"], "margin"], sub.loc[~sub["collapsed"], "margin"]
        if not (len(pos) and len(neg)):
            continue
        c = roc_curve(pos, neg)
        ax.plot(c["fpr"], c["tpr"], marker=".", ms=3, lw=1.4, color=f"C{i}",
                label=f"{alarm} (AUC {roc_auc(pos, neg):.2f})")
        op = sub[~sub["collapsed"]]["false_alarm"].mean(), sub[sub["collapsed"]]["warned"].mean()
        ax.plot(*op, "o", color=f"C{i}", ms=7, mfc="none")
    ax.plot([0, 1], [0, 1], color="0.6", ls=":", lw=1)
    ax.set(xlim=(-0.02, 1.02), ylim=(-0.02, 1.02), xlabel="false-alarm rate (held-out runs without collapse)",
           ylabel="warned share of held-out collapsed runs")
    ax.set_title("early warning, held out by preset (circles: θ fixed on training folds)", fontsize=9)
    ax.legend(fontsize=8, loc="lower right")
    return fig


def evaluate(study, settings: Settings = Settings(), cfg: AlarmConfig | None = None,
             min_onset: int | None = None) -> tuple[pd.DataFrame, pd.DataFrame, pd.Series]:
    """(summary_table, held-out outcomes, coefficients) of a study, each identical-run unit once
    (`identical.one_per_unit`: two runs of one training run would otherwise sit in two folds).
    `min_onset`: leave out collapsed runs whose onset is before that step (they cannot be warned
    by construction)."""
    cfg = cfg or AlarmConfig()
    study = one_per_unit(study)
    collapse = collapse_table(study)
    if min_onset is not None:
        early = collapse["collapsed"] & (collapse["collapse_step"] < min_onset)
        keep = set(collapse.loc[~early, "run_id"].astype(str))
        collapse = collapse[~early]
    else:
        keep = set(collapse["run_id"].astype(str))
    stats = run_statistics(study, cfg)
    stats = stats[stats["run_id"].astype(str).isin(keep)]
    features = feature_frame(stats, cfg.zscore_indicators)
    runs = study.runs[study.runs["run_id"].astype(str).isin(keep)]
    outcomes = cross_validate(features, collapse, runs, settings)
    return summary_table(outcomes), outcomes, coefficients(features, collapse, settings)


def main(argv: Sequence[str] | None = None) -> int:
    from ..export import load_exported

    p = argparse.ArgumentParser(prog="python -m analysis.studies.combined_warning", description=__doc__.splitlines()[0])
    p.add_argument("--data", nargs="+", required=True, help="exported study folders (analysis.export)")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--horizon", type=int, default=Settings.horizon)
    p.add_argument("--l2", type=float, default=Settings.l2)
    p.add_argument("--max-false-alarm", type=float, default=Settings.max_false_alarm)
    p.add_argument("--min-onset", type=int, default=None)
    a = p.parse_args(argv)
    try:
        study = load_exported(a.data)
        table, outcomes, coef = evaluate(study, Settings(a.horizon, a.l2, a.max_false_alarm), min_onset=a.min_onset)
    except AnalysisError as e:
        print(f"python -m analysis.studies.combined_warning: error: {e}", file=sys.stderr)
        return 2
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    table.to_csv(out / "combined_warning.csv", index=False)
    outcomes.to_csv(out / "combined_warning_runs.csv", index=False)
    coef.to_csv(out / "combined_warning_weights.csv")
    fig = fig_combined_roc(outcomes)
    for ext in ("png", "pdf"):
        fig.savefig(out / f"fig_combined_warning.{ext}", dpi=150)
    with pd.option_context("display.width", 160, "display.max_columns", 20):
        print(table.to_string(index=False))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
