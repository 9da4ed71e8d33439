"""The stability frontier of a study along an axis of off-policyness (docs/results/frontier/).

The axes (`analysis.axes`): the *level* — one MLflow experiment of the study (`frontier_l1`, …,
in order of off-policyness of the update); the *lag* — the runs' `trainer.offpolicy.lag` (stale
rollouts: the batch of step t was sampled by the policy after step t − k), each `lag_mode` its
own cell; or *both* (level × lag). A *cell* is (x, preset), x = level, (lag, lag_mode) or (level,
lag, lag_mode), and the preset label carries the rollout correction when one is set
(`grpo+decoupled_geo_rs`). Per cell:

    collapse probability  k/n with the Wilson score interval (Wilson 1927), which stays in [0, 1]
                          and is not degenerate at k = 0 or k = n:
                          (p̂ + z²/2n ± z √(p̂(1−p̂)/n + z²/4n²)) / (1 + z²/n)
    final success         mean of the runs' last greedy val/success_rate, percentile bootstrap CI
    peak grad norm        mean of the runs' maximal pre-clip gradient norm, bootstrap CI (≥ 0)
    clip fraction, KL     mean over runs of each run's mean actor/pg_clipfrac and actor/ppo_kl

Pairwise comparisons within an x, for every pair of presets: Fisher's exact test of the
collapse counts and Welch's t-test of final success; the p-values of each family (one x, one
test) are adjusted with Holm's step-down method (Holm 1979), which controls the family-wise error
rate under any dependence:  p_(i) ↦ max_{j ≤ i} min(1, (m − j + 1) p_(j)).
Pooled contrasts (`contrast_table`, contrasts.csv): pre-specified groups of presets (critic vs
critic-free, token vs turn ratio, uncorrected vs corrected) and each corrected preset against
its uncorrected one, the same two tests per x (the row `two_group_tests` builds for a pair
too), Holm over the whole table. The critic warm-start comparison: `analysis.studies.critic_warmstart`.

`python -m analysis.studies.frontier (--parquet DIR … | --experiment NAME … [--tracking-uri URI])
[--axis level|lag|both] --out DIR` writes cells.csv, pairwise.csv, contrasts.csv and
fig_frontier (PNG, PDF; along both one panel per level) for the levels found (`--level-prefix`,
default `frontier_`) or the lags, critic.csv when warm-started critics are there (experiments
`critic_ws_<level>`, or the param), and the early warning over every run of the frontier
(`analysis.warning`, default alarm rule): warning.csv, warning_runs.csv, fig_early_warning and
warning_thresholds.csv (the table at each threshold of `--thresholds`), along the lag also
warning_by_<axis>.csv (the table at each x); with `--warning-min-onset N` also both tables
without the collapsed runs whose onset is before step N (they cannot be warned: the alarm
needs its baseline first).
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass
from itertools import combinations
from pathlib import Path
from typing import Sequence

import numpy as np
import pandas as pd
import scipy.stats as sps
from matplotlib.figure import Figure

from stppo.config import param_names as P
from stppo.tracker import resolve_uri

from ..axes import AXES, as_tuple, axis_columns, axis_names, base_preset, lag_label, lag_order, with_axes
from ..collapse import collapse_table
from .critic_warmstart import critic_table, critic_table_by
from ..figures import fig_frontier, fig_frontier_grid
from ..group_tests import holm, two_group_tests
from ..identical import once
from ..load import Study, load_study
from ..stats import bootstrap_mean_ci, finite_mean
from ..store import AnalysisError
from ..tables import per_run_table
from ..warning import early_warning, fig_early_warning, run_statistics, threshold_sweep, warning_table


def wilson_interval(k: int, n: int, confidence: float = 0.95) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion k/n (NaNs for n = 0)."""
    if n <= 0:
        return float("nan"), float("nan")
    if not 0 <= k <= n:
        raise ValueError(f"wilson_interval: need 0 <= k <= n, got k={k}, n={n}")
    z = float(sps.norm.ppf(0.5 + confidence / 2))
    p = k / n
    center = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    # at k = 0 (k = n) the bound is exactly 0 (1); the formula leaves float noise there
    return (0.0 if k == 0 else max(0.0, center - half)), (1.0 if k == n else min(1.0, center + half))


def level_order(names: Sequence[str], prefix: str = "frontier_") -> list[str]:
    """The study's levels (experiments named prefix + level), sorted by their level name."""
    return sorted({n for n in names if str(n).startswith(prefix)})


LEVEL_KEYS = ((P.ACTOR_LR.path, "lr {}"), (P.PPO_EPOCHS.path, "{} ep"), (P.MINIBATCH_SIZE.path, "mb {}"))


def level_labels(runs: pd.DataFrame, params: pd.DataFrame, levels: Sequence[str]) -> dict[str, str]:
    """Tick label per level: its name and the settings that define it (actor lr, PPO epochs,
    minibatch size), read from the runs' params; a setting that differs between a level's runs
    is shown as `?`."""
    out = {}
    for lv in levels:
        ids = set(runs.loc[runs["experiment"] == lv, "run_id"])
        mine = params[params["run_id"].isin(ids)]
        parts = []
        for key, fmt in LEVEL_KEYS:
            vals = set(mine.loc[mine["key"] == key, "value"].astype(str))
            if vals:
                parts.append(fmt.format(vals.pop() if len(vals) == 1 else "?"))
        out[lv] = "\n".join([lv, " x ".join(parts)]) if parts else lv
    return out


def cell_table(runs: pd.DataFrame, *, confidence: float = 0.95, x: Sequence[str] = ("experiment",),
               means: Sequence[str] = (), intervals: Sequence[str] = ()) -> pd.DataFrame:
    """One row per (x, algo) of a per-run table (`per_run_table`; x the columns of an axis of
    `analysis.axes.AXES`: by default the experiment = level). `means`: per-run columns whose mean
    over the cell's runs (finite values only) is added under the same name
    (`tables.MISMATCH_MEANS`); `intervals`: those of them that also get the bootstrap interval of
    the mean (`{column}_low`, `{column}_high`)."""
    rows = []
    for key, grp in runs.groupby([*x, "algo"], sort=True):
        *xs, algo = as_tuple(key)
        grp = once(grp)
        k, n = int(grp["collapsed"].sum()), len(grp)
        low, high = wilson_interval(k, n, confidence)
        s_low, s_high = bootstrap_mean_ci(grp["final_success"], confidence=confidence)
        g_low, g_high = bootstrap_mean_ci(grp["peak_grad_norm"], confidence=confidence)
        onset = grp.loc[grp["collapsed"], "collapse_step"]
        rows.append({**dict(zip(axis_names(x), xs)), "algo": algo, "runs": n, "collapsed": k, "collapse_p": k / n,
                     "collapse_p_low": low, "collapse_p_high": high,
                     "median_onset": float(onset.median()) if len(onset) else np.nan,
                     "final_success": finite_mean(grp["final_success"]),
                     "final_success_low": s_low, "final_success_high": s_high,
                     "peak_grad_norm": finite_mean(grp["peak_grad_norm"]),
                     "peak_grad_norm_low": g_low, "peak_grad_norm_high": g_high,
                     "mean_clipfrac": finite_mean(grp["mean_clipfrac"]),
                     "mean_ppo_kl": finite_mean(grp["mean_ppo_kl"]),
                     **{c: finite_mean(grp[c]) for c in means},
                     **{f"{c}_{side}": v for c in intervals
                        for side, v in zip(("low", "high"), bootstrap_mean_ci(grp[c], confidence=confidence))}})
    return pd.DataFrame(rows)


def pairwise_table(runs: pd.DataFrame, *, x: Sequence[str] = ("experiment",)) -> pd.DataFrame:
    """Every pair of presets within each x (by default each level): Fisher's exact test on the
    collapse counts and Welch's t-test on final success, with Holm-adjusted p-values per (x, test)
    family."""
    rows, names = [], axis_names(x)
    for key, grp in runs.groupby(list(x), sort=True):
        at = dict(zip(names, as_tuple(key)))
        by = {a: g for a, g in grp.groupby("algo", sort=True)}
        for a, b in combinations(sorted(by), 2):
            rows.append({**at, "a": a, "b": b, **two_group_tests(by[a], by[b])})
    out = pd.DataFrame(rows)
    if out.empty:
        return out
    for test in ("fisher", "welch"):
        out[f"{test}_p_holm"] = np.nan
        for _, family in out.groupby(names, sort=False):
            out.loc[family.index, f"{test}_p_holm"] = holm(family[f"{test}_p"].to_numpy())
    return out


GAE_PRESETS = ("ppo", "turn_ppo", "s_ppo", "st_ppo", "so_ppo")
# Pre-specified pooled contrasts (group a vs group b), the paper's claims at the level of families:
CONTRASTS = {
    "critic (GAE) vs critic-free": (GAE_PRESETS, ("grpo", "gspo", "so_grpo", "cispo", "gmpo", "sapo", "dapo", "rloo")),
    "token vs turn ratio (GAE)": (("ppo", "s_ppo"), ("turn_ppo", "st_ppo", "so_ppo")),
    "uncorrected vs corrected (GAE)": (("ppo", "turn_ppo"), ("s_ppo", "st_ppo", "so_ppo")),
    "ppo vs s_ppo + st_ppo": (("ppo",), ("s_ppo", "st_ppo")),
}


def correction_contrasts(presets: Sequence[str]) -> dict[str, tuple[tuple[str, ...], tuple[str, ...]]]:
    """`preset vs preset+correction` for every corrected preset label whose preset is there too."""
    have = set(presets)
    return {f"{base_preset(p)} vs {p}": ((base_preset(p),), (p,)) for p in sorted(have)
            if "+" in p and base_preset(p) in have}


def contrast_table(runs: pd.DataFrame, contrasts: dict[str, tuple[Sequence[str], Sequence[str]]] | None = None,
                   *, x: Sequence[str] = ("experiment",)) -> pd.DataFrame:
    """Per (x, contrast): the pooled collapse counts of the two preset groups, Fisher's exact
    test, the groups' mean final success and Welch's t-test; Holm-adjusted over every row of the
    table (one family per test). Groups name preset labels: a corrected preset
    (`grpo+decoupled_geo_rs`) is in none of CONTRASTS' groups, and has its own row against its
    uncorrected preset (`correction_contrasts`) when `contrasts` is not given."""
    contrasts = contrasts or {**CONTRASTS, **correction_contrasts(runs["algo"].astype(str).unique())}
    rows, names = [], axis_names(x)
    for key, lv in runs.groupby(list(x), sort=True):
        at = dict(zip(names, as_tuple(key)))
        for name, (ga, gb) in contrasts.items():
            a, b = lv[lv["algo"].isin(ga)], lv[lv["algo"].isin(gb)]
            if a.empty or b.empty:
                continue
            rows.append({**at, "contrast": name, **two_group_tests(a, b)})
    out = pd.DataFrame(rows)
    if len(out):
        out["fisher_p_holm"] = holm(out["fisher_p"].to_numpy())
        out["welch_p_holm"] = holm(out["welch_p"].to_numpy())
    return out


@dataclass
class Frontier:
    """The stability frontier of a study along one axis of `analysis.axes.AXES` (`build_frontier`)."""
    axis: str
    x: tuple[str, ...]  # the per-run columns that make a cell's x
    levels: list[str]  # the level experiments (axes level and both)
    lags: list[int]  # the lags of the cells' runs, ascending
    runs: pd.DataFrame  # per-run table with the axis columns, the cells' runs only
    cells: pd.DataFrame
    pairwise: pd.DataFrame
    contrasts: pd.DataFrame
    critic: pd.DataFrame  # warm-started critic against the cold one (empty without warm-started runs)


def build_frontier(study: Study, every: pd.DataFrame | None = None, *, axis: str = "level",
                   prefix: str = "frontier_") -> Frontier:
    """Cells, tests and the critic table of `study` along `axis`. `every` is the per-run table
    with the axis columns (`with_axes(per_run_table(study), study.params)` when None; a filtered
    one restricts the frontier to its runs). Level and both: the experiments named `prefix`*
    are the levels; lag and both: runs with a warm-started critic are left out of the cells."""
    x = axis_columns(axis)
    every = with_axes(every if every is not None else per_run_table(study), study.params)
    levels = level_order(every["experiment"].astype(str), prefix) if "experiment" in x else []
    if "experiment" in x and not levels:
        raise AnalysisError(f"no experiment named {prefix}* among {', '.join(map(str, study.experiments))}")
    keep = every["experiment"].isin(levels) if levels else pd.Series(True, index=every.index)
    runs = every[keep & ~every["critic_warmstart"]] if axis != "level" else every[keep]
    if runs.empty:
        raise AnalysisError(f"no runs for the {axis} frontier in {', '.join(map(str, study.experiments))}")
    if axis == "level":
        warm = every["experiment"].astype(str).str.startswith("critic_ws_").any()
        critic = critic_table(study, every, prefix=prefix) if warm else pd.DataFrame()
    else:
        mine = every[keep | every["critic_warmstart"]]
        critic = critic_table_by(study, mine, x=x, prefix=prefix) if mine["critic_warmstart"].any() else pd.DataFrame()
    return Frontier(axis, x, levels, lag_order(runs["lag"]), runs, cell_table(runs, x=x),
                    pairwise_table(runs, x=x), contrast_table(runs, x=x), critic)


def frontier_figure(front: Frontier, study: Study) -> Figure:
    """fig_frontier over the levels or the lags, or fig_frontier_grid (level × lag)."""
    if front.axis == "lag":
        return fig_frontier(front.cells, front.lags, x="lag", labels={k: lag_label(k) for k in front.lags},
                            xlabel="lag k: the batch of step t was sampled by the policy after step t − k")
    labels = level_labels(study.runs, study.params, front.levels)
    if front.axis == "both":
        return fig_frontier_grid(front.cells, front.levels, front.lags, labels=labels)
    return fig_frontier(front.cells, front.levels, labels=labels)


def warning_by(per_run: pd.DataFrame, runs: pd.DataFrame, x: Sequence[str]) -> pd.DataFrame:
    """`warning_table` at each x of the cells' `runs` (per lag: does an indicator warn as well at
    every staleness?), x columns first; `per_run` is `run_warnings` of those runs."""
    tables = []
    for key, ids in runs.groupby(list(x), sort=True)["run_id"]:
        table = warning_table(per_run[per_run["run_id"].isin(set(ids.astype(str)))], all_runs=len(ids))
        for name, value in reversed(list(zip(axis_names(x), as_tuple(key)))):
            table.insert(0, name, value)
        tables.append(table)
    return pd.concat(tables, ignore_index=True) if tables else pd.DataFrame()


def _write_warning(study, collapse: pd.DataFrame, front: Frontier, out: Path, thresholds: str,
                   min_onset: int = 0) -> None:
    """The early-warning table over every run of the frontier (default alarm rule), its per-run
    rows and figure, and the table at each threshold of `thresholds` (warning_thresholds.csv);
    along the lag (and level × lag) also the table at each x (warning_by_<axis>.csv), and the
    per-run rows carry the lag, its mode and the correction.
    With `min_onset` > 0 the same two tables again without the collapsed runs whose onset comes
    before step `min_onset` (`warning_onset_ge<N>*.csv`): an alarm needs its baseline and its
    streak first, so those runs cannot be warned by construction."""
    try:
        hs = [float(h) for h in thresholds.split(",") if h.strip()]
    except ValueError:
        raise AnalysisError(f"--thresholds must be comma-separated numbers, got {thresholds!r}") from None
    if not hs or min(hs) <= 0:
        raise AnalysisError(f"--thresholds must be positive numbers, got {thresholds!r}")
    ids = set(front.runs["run_id"].astype(str))
    sub, col = _subset(study, collapse, ids)
    stats = run_statistics(sub)  # the alarm statistics of every run, shared by the tables below
    table, per_run = early_warning(sub, collapse=col, stats=stats)
    table.to_csv(out / "warning.csv", index=False)
    if front.axis != "level":
        warning_by(per_run, front.runs, front.x).to_csv(out / f"warning_by_{front.axis}.csv", index=False)
        per_run = per_run.merge(front.runs[["run_id", "lag", "lag_mode", "correction"]].astype({"run_id": str}),
                                on="run_id", how="left")
    per_run.to_csv(out / "warning_runs.csv", index=False)
    fig = fig_early_warning(table, per_run)
    for ext in ("png", "pdf"):
        fig.savefig(out / f"fig_early_warning.{ext}", dpi=120)
    threshold_sweep(sub, hs, collapse=col, stats=stats).to_csv(out / "warning_thresholds.csv", index=False)
    if min_onset > 0:
        early = col["collapsed"].astype(bool) & (col["collapse_step"].astype(float) < min_onset)
        keep = ids - set(col.loc[early, "run_id"].astype(str))
        sub, col = _subset(study, collapse, keep)
        kept = stats[stats["run_id"].isin(keep)]
        early_warning(sub, collapse=col, stats=kept)[0].to_csv(out / f"warning_onset_ge{min_onset}.csv", index=False)
        threshold_sweep(sub, hs, collapse=col, stats=kept).to_csv(
            out / f"warning_onset_ge{min_onset}_thresholds.csv", index=False)


def _subset(study, collapse: pd.DataFrame, ids: set[str]) -> tuple[Study, pd.DataFrame]:
    return study.only(ids), collapse[collapse["run_id"].astype(str).isin({str(i) for i in ids})]


def _load(a) -> Study:
    """The study of the command line: exported folders (only the `--experiment`s when given too),
    else the experiments from the tracking store."""
    if a.parquet:
        from ..export import load_exported

        return load_exported(a.parquet, a.experiment)
    return load_study(a.experiment, resolve_uri(a.tracking_uri))


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m analysis.studies.frontier", description=__doc__.splitlines()[0])
    p.add_argument("--parquet", action="append", type=Path,
                   help="a folder written by `python -m analysis.export` (repeatable)")
    p.add_argument("--experiment", action="append",
                   help="an MLflow experiment (repeatable): read from --tracking-uri, or kept from --parquet")
    p.add_argument("--tracking-uri", default=None, help="default: $MLFLOW_TRACKING_URI or sqlite:///mlflow.db")
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--axis", choices=tuple(AXES), default="level",
                   help="the frontier's x: level (the experiments named --level-prefix*, default), lag (the runs' "
                        f"{P.LAG.path}, cells per lag mode), or both (one panel per level, lag across)")
    p.add_argument("--level-prefix", default="frontier_")
    p.add_argument("--thresholds", default="2,3,4,6,8",
                   help="alarm thresholds h of warning_thresholds.csv (comma-separated; default 2,3,4,6,8)")
    p.add_argument("--no-warning", action="store_true", help="skip the early-warning tables")
    p.add_argument("--warning-min-onset", type=int, default=0,
                   help="also write the warning tables without collapsed runs whose onset is before this step")
    a = p.parse_args(argv)
    if not a.parquet and not a.experiment:
        p.error("give the study: --parquet DIR (exported) or --experiment NAME (from the tracking store)")
    try:
        study = _load(a)
        collapse = collapse_table(study)
        front = build_frontier(study, per_run_table(study, collapse), axis=a.axis, prefix=a.level_prefix)
        a.out.mkdir(parents=True, exist_ok=True)
        if len(front.critic):
            front.critic.to_csv(a.out / "critic.csv", index=False)
        front.cells.to_csv(a.out / "cells.csv", index=False)
        front.pairwise.to_csv(a.out / "pairwise.csv", index=False)
        front.contrasts.to_csv(a.out / "contrasts.csv", index=False)
        fig = frontier_figure(front, study)
        for ext in ("png", "pdf"):
            fig.savefig(a.out / f"fig_frontier.{ext}", dpi=120)
        if not a.no_warning:
            _write_warning(study, collapse, front, a.out, a.thresholds, a.warning_min_onset)
    except AnalysisError as e:
        print(f"analysis.studies.frontier: error: {e}", file=sys.stderr)
        return 2
    where = {"level": f"{len(front.levels)} levels", "lag": f"lags {', '.join(map(str, front.lags))}",
             "both": f"{len(front.levels)} levels × lags {', '.join(map(str, front.lags))}"}[a.axis]
    print(f"wrote cells.csv, pairwise.csv, fig_frontier.png/pdf{'' if a.no_warning else ', warning*'} to {a.out} "
          f"({len(front.runs)} runs, {where})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
