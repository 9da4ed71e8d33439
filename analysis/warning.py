"""Early warning, measured: which indicator warns of a collapse first, how early, how often falsely.

Every indicator of `stppo.alarms` (the one alarm rule: a robust z-score against the run's first
logged values, held for `persist` values) is recomputed offline from each run's logged series, and
compared with the run's collapse onset from `collapse_table` (the one collapse rule). At threshold h:

* onset c — the collapse step of a collapsed run; runs without collapse are the negatives;
* window — a collapsed run's steps s ≤ c (an alarm after the onset is too late to count as a
  warning); every logged step of a run without collapse;
* first alarm a — the first step of the window with alarm statistic a_t ≥ h;
* warned — a collapsed run with an alarm in its window; lead time = c − a steps (0: at the onset);
* false alarm — a run without collapse with ≥ 1 alarm; false-alarm rate = those / runs without
  collapse that logged the indicator (over their whole length: longer runs have more chances);
* score S — max of a_t over the window (−inf when a_t is never defined there: too short for the
  baseline). At any h a run alarms in its window iff S ≥ h, so TPR(h) = share of collapsed runs
  with S ≥ h (= warned / collapsed), FPR(h) = share of the others with S ≥ h (= the false-alarm
  rate), and ROC AUC = P(S_collapsed > S_other) + ½ P(S_collapsed = S_other) over all pairs
  (Mann–Whitney); 0.5 = no better than chance, NaN without both kinds of run.
Runs that never logged any key of an indicator are left out of its row (`runs_without`).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import matplotlib
import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from stppo.alarms import INDICATORS, AlarmConfig, alarm_statistic, get_indicator

from .collapse import collapse_table
from .identical import one_per_unit
from .load import Study

STAT_COLUMNS = ("run_id", "indicator", "key", "step", "stat")
RUN_COLUMNS = ("run_id", "algo", "model", "task", "seed", "indicator", "key", "collapsed", "onset", "last_step",
               "score", "first_alarm", "warned", "lead", "false_alarm")
TABLE_COLUMNS = ("indicator", "metric", "direction", "threshold", "collapsed_runs", "warned", "not_warned",
                 "lead_median", "lead_q1", "lead_q3", "stable_runs", "false_alarms", "false_alarm_rate", "auc",
                 "runs_without")


def run_statistics(study: Study, cfg: AlarmConfig | None = None) -> pd.DataFrame:
    """The alarm statistic a_t of every (run, indicator) at every logged step where it is defined.

    It does not depend on the threshold: one pass serves every h. Columns STAT_COLUMNS."""
    cfg = cfg or AlarmConfig()
    keys = {k for n in cfg.zscore_indicators for k in get_indicator(n).keys}
    m = study.metrics
    sub = m.loc[m["metric"].isin(list(keys)), ["run_id", "metric", "step", "value"]]
    parts: list[pd.DataFrame] = []
    for rid, grp in sub.groupby("run_id", observed=True, sort=False):
        per = {str(k): g.sort_values("step") for k, g in grp.groupby("metric", observed=True)}
        for name in cfg.zscore_indicators:
            key = next((k for k in get_indicator(name).keys if k in per), None)
            if key is None:
                continue
            pts = per[key]
            steps = pts["step"].to_numpy()
            stat = np.asarray(alarm_statistic(steps.tolist(), pts["value"].tolist(), name, cfg))
            ok = np.isfinite(stat)
            parts.append(pd.DataFrame({"run_id": str(rid), "indicator": name, "key": key, "step": steps[ok],
                                       "stat": stat[ok]}))
            if not ok.any():  # logged, but too short for the baseline: keep the run in the row
                parts.append(pd.DataFrame({"run_id": [str(rid)], "indicator": [name], "key": [key],
                                           "step": [-1], "stat": [-np.inf]}))
    if not parts:
        return pd.DataFrame({c: pd.Series(dtype="float64" if c == "stat" else "object") for c in STAT_COLUMNS})
    return pd.concat(parts, ignore_index=True)[list(STAT_COLUMNS)]


def run_warnings(study: Study, stats: pd.DataFrame, cfg: AlarmConfig | None = None,
                 collapse: pd.DataFrame | None = None) -> pd.DataFrame:
    """One row per (run, indicator it logged): onset, score S, first alarm at the indicator's
    threshold, warned and lead time (collapsed runs), false_alarm (the others)."""
    cfg = cfg or AlarmConfig()
    col = (collapse if collapse is not None else collapse_table(study)).copy()
    col["run_id"] = col["run_id"].astype(str)
    col = col.set_index("run_id")
    rows = []
    for (rid, name), grp in stats.groupby(["run_id", "indicator"], sort=False):
        r = col.loc[rid]
        onset = float(r["collapse_step"]) if r["collapsed"] else np.nan
        window = grp[grp["step"] <= onset] if r["collapsed"] else grp
        score = float(window["stat"].max()) if len(window) else -np.inf
        h = cfg.threshold_for(name)
        hits = window.loc[window["stat"] >= h, "step"]
        first = float(hits.min()) if len(hits) else np.nan
        warned = bool(r["collapsed"]) and len(hits) > 0
        rows.append({"run_id": rid, "algo": r["algo"], "model": r["model"], "task": r["task"], "seed": r["seed"],
                     "indicator": name, "key": grp["key"].iloc[0], "collapsed": bool(r["collapsed"]),
                     "onset": onset, "last_step": float(r["last_step"]), "score": score, "first_alarm": first,
                     "warned": warned, "lead": onset - first if warned else np.nan,
                     "false_alarm": (not r["collapsed"]) and len(hits) > 0})
    types = {"collapsed": bool, "warned": bool, "false_alarm": bool, "onset": float, "last_step": float,
             "score": float, "first_alarm": float, "lead": float}
    return pd.DataFrame(rows, columns=list(RUN_COLUMNS)).astype(types)


def roc_auc(positive: Sequence[float], negative: Sequence[float]) -> float:
    """P(X > Y) + ½ P(X = Y) for X a positive's score and Y a negative's, over all pairs (the area
    under the ROC curve, Mann–Whitney U / (n_pos · n_neg)); ±inf scores compare as usual. NaN
    when either side is empty."""
    x = np.asarray(positive, dtype=np.float64)[:, None]  # (P, 1)
    y = np.asarray(negative, dtype=np.float64)[None, :]  # (1, N)
    if x.size == 0 or y.size == 0:
        return float("nan")
    return float(np.mean((x > y) + 0.5 * (x == y)))


def roc_curve(positive: Sequence[float], negative: Sequence[float]) -> pd.DataFrame:
    """(threshold, tpr, fpr) at every distinct score, from the highest threshold (+inf: no alarm)
    down; tpr(h) = share of positives with score ≥ h, fpr likewise."""
    x, y = np.asarray(positive, dtype=np.float64), np.asarray(negative, dtype=np.float64)
    hs = np.unique(np.concatenate([x, y, [np.inf]]))[::-1]
    tpr = [(x >= h).mean() if x.size else np.nan for h in hs]
    fpr = [(y >= h).mean() if y.size else np.nan for h in hs]
    return pd.DataFrame({"threshold": hs, "tpr": tpr, "fpr": fpr})


def warning_table(runs: pd.DataFrame, cfg: AlarmConfig | None = None, *, all_runs: int | None = None) -> pd.DataFrame:
    """Per indicator (registry order): counts, lead time median and IQR over warned runs, false
    alarms and their rate, ROC AUC. `runs` is `run_warnings`; `all_runs` the study's run count."""
    cfg = cfg or AlarmConfig()
    total = all_runs if all_runs is not None else runs["run_id"].nunique()
    rows = []
    for name in cfg.zscore_indicators:
        ind = INDICATORS[name]
        sub = runs[runs["indicator"] == name]
        pos, neg = sub[sub["collapsed"]], sub[~sub["collapsed"]]
        leads = pos.loc[pos["warned"], "lead"].to_numpy(np.float64)
        q1, med, q3 = np.quantile(leads, [0.25, 0.5, 0.75]) if leads.size else (np.nan,) * 3
        fa = int(neg["false_alarm"].sum())
        rows.append({"indicator": name, "metric": ", ".join(sorted(set(sub["key"]))) or ind.keys[0],
                     "direction": ind.direction, "threshold": cfg.threshold_for(name), "collapsed_runs": len(pos),
                     "warned": int(pos["warned"].sum()), "not_warned": int((~pos["warned"]).sum()),
                     "lead_median": med, "lead_q1": q1, "lead_q3": q3, "stable_runs": len(neg),
                     "false_alarms": fa, "false_alarm_rate": fa / len(neg) if len(neg) else np.nan,
                     "auc": roc_auc(pos["score"], neg["score"]), "runs_without": total - len(sub)})
    return pd.DataFrame(rows, columns=list(TABLE_COLUMNS))


def early_warning(study: Study, cfg: AlarmConfig | None = None, *, collapse: pd.DataFrame | None = None,
                  stats: pd.DataFrame | None = None) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(warning_table, run_warnings) of a study, in one call; each identical-run unit once
    (`identical.one_per_unit`)."""
    cfg = cfg or AlarmConfig()
    study = one_per_unit(study)
    stats = stats if stats is not None else run_statistics(study, cfg)
    runs = run_warnings(study, stats, cfg, collapse)
    return warning_table(runs, cfg, all_runs=len(study.runs)), runs


def threshold_sweep(study: Study, thresholds: Sequence[float], cfg: AlarmConfig | None = None, *,
                    collapse: pd.DataFrame | None = None, stats: pd.DataFrame | None = None) -> pd.DataFrame:
    """`warning_table` at each threshold h (one h for every indicator), stacked: how lead time
    and false alarms trade off as h moves. The alarm statistics (`run_statistics`, or `stats`
    when given) are computed once. Each identical-run unit once (`identical.one_per_unit`)."""
    cfg = cfg or AlarmConfig()
    study = one_per_unit(study)
    collapse = collapse if collapse is not None else collapse_table(study)
    stats = stats if stats is not None else run_statistics(study, cfg)
    tables = []
    for h in thresholds:
        at = dataclasses.replace(cfg, threshold=float(h), thresholds={})
        tables.append(warning_table(run_warnings(study, stats, at, collapse), at, all_runs=len(study.runs)))
    return pd.concat(tables, ignore_index=True) if tables else pd.DataFrame(columns=list(TABLE_COLUMNS))


def fig_early_warning(table: pd.DataFrame, runs: pd.DataFrame) -> Figure:
    """Left: lead time per indicator (each warned run a dot, the median a red bar, the IQR a band),
    labelled 'warned k/n · false m/M'. Right: ROC curves of the indicators with both kinds of run."""
    fig = Figure(figsize=(13, 0.5 * max(len(table), 4) + 1.6), layout="constrained")
    ax, roc = fig.subplots(1, 2, width_ratios=[1.1, 1])
    for i, r in enumerate(table.itertuples()):
        leads = runs.loc[(runs["indicator"] == r.indicator) & runs["warned"], "lead"].to_numpy()
        jitter = np.linspace(-0.15, 0.15, leads.size) if leads.size > 1 else np.zeros(leads.size)
        ax.scatter(leads, i + jitter, s=12, color="C0", alpha=0.7, zorder=3)
        if r.warned:
            ax.plot([r.lead_q1, r.lead_q3], [i, i], color="C0", lw=5, alpha=0.3, solid_capstyle="butt")
            ax.plot([r.lead_median] * 2, [i - 0.3, i + 0.3], color="C3", lw=2)
    labels = [f"{r.indicator}\nwarned {r.warned}/{r.collapsed_runs} · false {r.false_alarms}/{r.stable_runs}"
              for r in table.itertuples()]
    ax.set_yticks(range(len(labels)), labels, fontsize=7)
    ax.set_ylim(max(len(labels), 1) - 0.5, -0.5)
    if not labels:
        ax.text(0.5, 0.5, "no run logged any indicator", ha="center", va="center", fontsize=9, color="0.4",
                transform=ax.transAxes)
    ax.set_xlabel("lead time: collapse onset − first alarm (steps)")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_title("lead time per indicator (dots: runs · red: median · band: IQR)", fontsize=10)
    ax.grid(alpha=0.3, axis="x")
    colors = matplotlib.colormaps["tab20"]
    drawn = 0
    for i, r in enumerate(table.itertuples()):
        sub = runs[runs["indicator"] == r.indicator]
        if not (sub["collapsed"].any() and (~sub["collapsed"]).any()):
            continue
        curve = roc_curve(sub.loc[sub["collapsed"], "score"], sub.loc[~sub["collapsed"], "score"])
        roc.plot(curve["fpr"], curve["tpr"], lw=1.3, color=colors(i % 20), marker=".", ms=3,
                 label=f"{r.indicator} (AUC {r.auc:.2f})")
        drawn += 1
    roc.plot([0, 1], [0, 1], color="0.6", ls=":", lw=1)
    roc.set(xlim=(-0.02, 1.02), ylim=(-0.02, 1.02), xlabel="false-alarm rate (runs without collapse)",
            ylabel="warned share of collapsed runs")
    roc.set_title("ROC over thresholds (ties: straight segments)", fontsize=10)
    if drawn:
        roc.legend(fontsize=7, loc="lower right")
    else:
        roc.text(0.5, 0.5, "needs runs with and without collapse", ha="center", va="center", fontsize=9,
                 color="0.4", transform=roc.transAxes)
    fig.suptitle("early warning of collapse", fontsize=11)
    return fig
