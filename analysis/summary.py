"""The Markdown summary of a report: the paper's claims answered with numbers."""

from __future__ import annotations

import math
from typing import Sequence

import pandas as pd

from stppo import metric_names as T


def fmt_number(x, digits: int = 3) -> str:
    if isinstance(x, (bool,)) or x is None:
        return str(x)
    if isinstance(x, (int,)):
        return str(x)
    try:
        v = float(x)
    except (TypeError, ValueError):
        return str(x)
    if math.isnan(v):
        return "–"
    return f"{v:.{digits}g}" if abs(v) < 1e-3 or abs(v) >= 1e4 else f"{v:.{digits}f}"


def md_table(frame: pd.DataFrame, columns: Sequence[str], headers: Sequence[str] | None = None) -> str:
    """A GitHub Markdown table of `columns` (numbers to 3 decimals, NaN as –)."""
    headers = list(headers or columns)
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    for _, row in frame.iterrows():
        lines.append("| " + " | ".join(fmt_number(row[c]) for c in columns) + " |")
    return "\n".join(lines)


def _pm(mean: float, low: float, high: float, n: int) -> str:
    if math.isnan(mean):
        return "–"
    return f"{mean:.3f} [{low:.3f}, {high:.3f}] (n={n})" if not math.isnan(low) else f"{mean:.3f} (n={n})"


def growth_sentences(summary: pd.DataFrame, window: int) -> list[str]:
    out = []
    for (algo, model, task), grp in summary.groupby(["algo", "model", "task"], sort=True):
        parts = []
        for collapsed, label in ((True, "before collapse"), (False, "runs without collapse")):
            row = grp[grp["collapsed"] == collapsed]
            if row.empty:
                continue
            r = row.iloc[0]
            b = r["median_growth_rate"]
            factor = f"×{math.exp(b):.3f}/step" if not math.isnan(b) else "–"
            parts.append(f"{label}: b = {fmt_number(b)} per step ({factor}), "
                         f"median R² = {fmt_number(r['median_r2'])}, {int(r['runs'])} run(s)")
        out.append(f"- **{algo}** ({model}, {task}) — " + "; ".join(parts) + ".")
    if not out:
        out.append(f"- no `{T.CLIP_BIAS_NORM}` logged: the growth fit needs it.")
    return out


def warning_lines(warning: pd.DataFrame, alarm) -> list[str]:
    """The early-warning section: the rule, then one row per indicator that some run logged."""
    logged = warning[warning["collapsed_runs"] + warning["stable_runs"] > 0]
    lines = ["## Early warning of collapse", "",
             f"Alarm rule of `stppo.alarms`: robust z-score of each indicator against the run's first "
             f"{alarm.baseline_steps} logged values, at or beyond h = {alarm.threshold:g} on {alarm.persist} "
             "consecutive values. Lead time = collapse onset − first alarm, over collapsed runs warned at or "
             "before the onset; false alarms = runs without collapse with any alarm; AUC over thresholds of the "
             "max statistic before the onset (before the end). Table: warning.csv; per run: warning_runs.csv.", ""]
    if logged.empty:
        return lines + ["No run logged any indicator.", ""]
    rows = logged.assign(
        warned_k=[f"{w}/{n}" for w, n in zip(logged["warned"], logged["collapsed_runs"])],
        lead=[_lead(m, a, b) for m, a, b in zip(logged["lead_median"], logged["lead_q1"], logged["lead_q3"])],
        false=[f"{f}/{n}" for f, n in zip(logged["false_alarms"], logged["stable_runs"])])
    return lines + [md_table(rows, ["indicator", "metric", "warned_k", "lead", "false", "auc"],
                             ["indicator", "metric", "warned k/n", "lead steps: median [IQR]",
                              "false alarms", "ROC AUC"]), ""]


def _lead(median: float, q1: float, q3: float) -> str:
    return "–" if math.isnan(median) else f"{median:g} [{q1:g}, {q3:g}]"


def write_summary(*, uri: str, experiments: Sequence[str], runs: pd.DataFrame, presets: pd.DataFrame,
                  significance: pd.DataFrame, growth_summary: pd.DataFrame, window: int,
                  figures: Sequence[str], skipped: Sequence[str], warning: pd.DataFrame | None = None,
                  alarm=None) -> str:
    """The report's summary.md text."""
    lines = [f"# Stability report: {', '.join(experiments)}", "",
             f"Tracking store `{uri}`; {len(runs)} run{'' if len(runs) == 1 else 's'}; presets: {', '.join(sorted(runs['algo'].unique()))}.", ""]
    lines += ["## Collapses per preset", "",
              "Collapse = the rule of `stppo.diagnostics` (success EMA below drop × its peak for `patience` "
              "steps, or non-finite loss/gradient), recomputed from `env/success_rate` and "
              "`actor/skipped_steps` with each run's collapse settings.", ""]
    lines += [md_table(presets, ["algo", "model", "task", "collapsed", "collapse_rate", "median_collapse_step"],
                       ["preset", "model", "task", "collapsed k/n", "rate", "median collapse step"]), ""]
    lines += [f"## Clipping-bias growth (`{T.CLIP_BIAS_NORM}`)", "",
              f"Fit log(norm) = a + b·step over the {window} steps before each collapse; for runs that did not "
              "collapse the same fit over the control window (see growth.csv). b > 0 with R² near 1 is the "
              "exponential growth of the paper's Fig. 3d.", ""]
    lines += growth_sentences(growth_summary, window) + [""]
    lines += ["## Clip ratio and KL", "",
              md_table(presets, ["algo", "model", "task", "clip_ratio", "ppo_kl", "kl_ref", "peak_grad_norm"],
                       ["preset", "model", "task", "mean clip ratio", "mean ppo_kl", "mean kl_ref",
                        "peak grad norm (mean over runs)"]), ""]
    fin = presets.assign(final=[_pm(m, lo, hi, int(n)) for m, lo, hi, n in zip(
        presets["final_success_mean"], presets["final_success_ci_low"], presets["final_success_ci_high"],
        presets["final_success_n"])])
    lines += [f"## Final success (last `{T.VAL_SUCCESS_RATE}`, mean [95% bootstrap CI] across seeds)", "",
              md_table(fin, ["algo", "model", "task", "final"], ["preset", "model", "task", "final success"]), ""]
    if len(significance):
        lines += [f"Test: {significance['test'].iloc[0]}.", "",
                  md_table(significance,
                           ["model", "task", "a", "b", "diff", "diff_ci_low", "diff_ci_high", "t", "df", "p"],
                           ["model", "task", "a", "b", "mean a − b", "CI low", "CI high", "t", "df", "p"]), ""]
    else:
        lines += ["No pair of presets to compare (one preset per model/task).", ""]
    if warning is not None and alarm is not None:
        lines += warning_lines(warning, alarm)
    lines += ["## Figures", ""] + [f"- [{f}]({f})" for f in figures]
    if skipped:
        lines += ["", "Notes:"] + [f"- {s}" for s in skipped]
    return "\n".join(lines) + "\n"
