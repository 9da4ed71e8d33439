"""The stability frontier of a study over off-policyness levels (docs/results/frontier/).

A *level* is one MLflow experiment of the study (`frontier_l1`, …, in order of off-policyness);
a *cell* is (level, preset). Per cell:

    collapse probability  k/n with the Wilson score interval (Wilson 1927), which stays in [0, 1]
                          and is not degenerate at k = 0 or k = n:
                          (p̂ + z²/2n ± z √(p̂(1−p̂)/n + z²/4n²)) / (1 + z²/n)
    final success         mean of the runs' last greedy val/success_rate, percentile bootstrap CI
    peak grad norm        mean of the runs' maximal pre-clip gradient norm, bootstrap CI (≥ 0)
    clip fraction, KL     mean over runs of each run's mean actor/pg_clipfrac and actor/ppo_kl

Pairwise comparisons within a level, for every pair of presets: Fisher's exact test of the
collapse counts and Welch's t-test of final success; the p-values of each family (one level, one
test) are adjusted with Holm's step-down method (Holm 1979), which controls the family-wise error
rate under any dependence:  p_(i) ↦ max_{j ≤ i} min(1, (m − j + 1) p_(j)).
Pooled contrasts (`contrast_table`, contrasts.csv): pre-specified groups of presets (critic vs
critic-free, token vs turn ratio, uncorrected vs corrected), the same two tests per level (the
row `_two_group_tests` builds for a pair too), Holm over the whole table.

The critic warm-start comparison (`critic_table`): per (level, GAE preset), runs with
`trainer.critic_warmstart` (experiments `critic_ws_<level>`) against the same cells of the grid:
collapse counts (Fisher's exact test), the warm start's held-out explained variance before and
after its fit, and the mean over training steps of `critic/vf_explained_var`.

`python -m analysis.frontier --parquet DIR [--parquet DIR2 …] --out DIR` writes cells.csv,
pairwise.csv and fig_frontier (PNG, PDF) for the levels found (`--level-prefix`, default
`frontier_`), critic.csv when critic warm-start experiments (`critic_ws_<level>`) are there, and
the early warning over every run of the levels (`analysis.warning`, default alarm rule):
warning.csv, warning_runs.csv, fig_early_warning and warning_thresholds.csv (the table at each
threshold of `--thresholds`); with `--warning-min-onset N` also both tables without the collapsed
runs whose onset is before step N (they cannot be warned: the alarm needs its baseline first).
"""

from __future__ import annotations

import argparse
import math
import sys
from itertools import combinations
from pathlib import Path
from typing import Sequence

import numpy as np
import pandas as pd
import scipy.stats as sps
from matplotlib.figure import Figure

from .collapse import collapse_table
from .figures import PRESET_ORDER, preset_color, preset_marker
from .load import Study
from .stats import bootstrap_mean_ci, welch_test
from .store import AnalysisError
from stppo import metric_names as T

from .tables import per_run_table, per_run_value
from .warning import early_warning, fig_early_warning, run_statistics, threshold_sweep


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


def holm(pvalues: Sequence[float]) -> np.ndarray:
    """Holm's step-down adjusted p-values (NaNs stay NaN and do not count in the family)."""
    p = np.asarray(pvalues, dtype=float)
    out = np.full(p.shape, np.nan)
    ok = np.flatnonzero(np.isfinite(p))
    if ok.size == 0:
        return out
    order = ok[np.argsort(p[ok], kind="stable")]
    m = order.size
    adjusted = np.minimum(1.0, (m - np.arange(m)) * p[order])
    out[order] = np.maximum.accumulate(adjusted)
    return out


def level_order(names: Sequence[str], prefix: str = "frontier_") -> list[str]:
    """The study's levels (experiments named prefix + level), sorted by their level name."""
    return sorted({n for n in names if str(n).startswith(prefix)})


LEVEL_KEYS = (("trainer.actor_lr", "lr {}"), ("trainer.ppo_epochs", "{} ep"), ("trainer.minibatch_size", "mb {}"))


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


def _finite_mean(values) -> float:
    x = np.asarray(values, dtype=float)
    x = x[np.isfinite(x)]
    return float(x.mean()) if x.size else float("nan")


def cell_table(runs: pd.DataFrame, *, confidence: float = 0.95) -> pd.DataFrame:
    """One row per (experiment = level, algo) of a per-run table (`per_run_table`)."""
    rows = []
    for (level, algo), grp in runs.groupby(["experiment", "algo"], sort=True):
        k, n = int(grp["collapsed"].sum()), len(grp)
        low, high = wilson_interval(k, n, confidence)
        s_low, s_high = bootstrap_mean_ci(grp["final_success"], confidence=confidence)
        g_low, g_high = bootstrap_mean_ci(grp["peak_grad_norm"], confidence=confidence)
        onset = grp.loc[grp["collapsed"], "collapse_step"]
        rows.append({"level": level, "algo": algo, "runs": n, "collapsed": k, "collapse_p": k / n,
                     "collapse_p_low": low, "collapse_p_high": high,
                     "median_onset": float(onset.median()) if len(onset) else np.nan,
                     "final_success": _finite_mean(grp["final_success"]),
                     "final_success_low": s_low, "final_success_high": s_high,
                     "peak_grad_norm": _finite_mean(grp["peak_grad_norm"]),
                     "peak_grad_norm_low": g_low, "peak_grad_norm_high": g_high,
                     "mean_clipfrac": _finite_mean(grp["mean_clipfrac"]),
                     "mean_ppo_kl": _finite_mean(grp["mean_ppo_kl"])})
    return pd.DataFrame(rows)


def _two_group_tests(a: pd.DataFrame, b: pd.DataFrame) -> dict:
    """Two groups of runs: collapse counts and Fisher's exact test, mean final success and Welch's
    t-test (the row of `pairwise_table` and of `contrast_table`, before Holm)."""
    ka, kb = int(a["collapsed"].sum()), int(b["collapsed"].sum())
    w = welch_test(a["final_success"], b["final_success"])
    return {"collapsed_a": f"{ka}/{len(a)}", "collapsed_b": f"{kb}/{len(b)}",
            "fisher_p": float(sps.fisher_exact([[ka, len(a) - ka], [kb, len(b) - kb]])[1]),
            "success_a": _finite_mean(a["final_success"]), "success_b": _finite_mean(b["final_success"]),
            "welch_t": w["t"], "welch_p": w["p"]}


def pairwise_table(runs: pd.DataFrame) -> pd.DataFrame:
    """Every pair of presets within each level: Fisher's exact test on the collapse counts and
    Welch's t-test on final success, with Holm-adjusted p-values per (level, test) family."""
    rows = []
    for level, grp in runs.groupby("experiment", sort=True):
        by = {a: g for a, g in grp.groupby("algo", sort=True)}
        for a, b in combinations(sorted(by), 2):
            rows.append({"level": level, "a": a, "b": b, **_two_group_tests(by[a], by[b])})
    out = pd.DataFrame(rows)
    if out.empty:
        return out
    for test in ("fisher", "welch"):
        out[f"{test}_p_holm"] = np.nan
        for level, idx in out.groupby("level").groups.items():
            out.loc[idx, f"{test}_p_holm"] = holm(out.loc[idx, f"{test}_p"].to_numpy())
    return out


GAE_PRESETS = ("ppo", "turn_ppo", "s_ppo", "st_ppo", "so_ppo")
# Pre-specified pooled contrasts (group a vs group b), the paper's claims at the level of families:
CONTRASTS = {
    "critic (GAE) vs critic-free": (GAE_PRESETS, ("grpo", "gspo", "so_grpo", "cispo", "gmpo", "sapo", "dapo", "rloo")),
    "token vs turn ratio (GAE)": (("ppo", "s_ppo"), ("turn_ppo", "st_ppo", "so_ppo")),
    "uncorrected vs corrected (GAE)": (("ppo", "turn_ppo"), ("s_ppo", "st_ppo", "so_ppo")),
    "ppo vs s_ppo + st_ppo": (("ppo",), ("s_ppo", "st_ppo")),
}


def contrast_table(runs: pd.DataFrame, contrasts: dict[str, tuple[Sequence[str], Sequence[str]]] | None = None
                   ) -> pd.DataFrame:
    """Per (level, contrast): the pooled collapse counts of the two preset groups, Fisher's exact
    test, the groups' mean final success and Welch's t-test; Holm-adjusted over every row of the
    table (one family per test)."""
    rows = []
    for level, lv in runs.groupby("experiment", sort=True):
        for name, (ga, gb) in (contrasts or CONTRASTS).items():
            a, b = lv[lv["algo"].isin(ga)], lv[lv["algo"].isin(gb)]
            if a.empty or b.empty:
                continue
            rows.append({"level": level, "contrast": name, **_two_group_tests(a, b)})
    out = pd.DataFrame(rows)
    if len(out):
        out["fisher_p_holm"] = holm(out["fisher_p"].to_numpy())
        out["welch_p_holm"] = holm(out["welch_p"].to_numpy())
    return out


def critic_table(study, runs: pd.DataFrame, *, prefix: str = "frontier_",
                 warm_prefix: str = "critic_ws_") -> pd.DataFrame:
    """One row per (level, algo) that has warm-started runs: with vs without the critic warm start
    (module docstring). `runs` is `per_run_table(study)` over both kinds of experiments."""
    ev_before = per_run_value(study, T.CRITIC_WS_EV_BEFORE, "last")
    ev_after = per_run_value(study, T.CRITIC_WS_EV_AFTER, "last")
    ev_train = per_run_value(study, T.VF_EXPLAINED_VAR, "mean")
    runs = runs.assign(ev_before=runs["run_id"].map(ev_before), ev_after=runs["run_id"].map(ev_after),
                       ev_train=runs["run_id"].map(ev_train))
    rows = []
    warm = runs[runs["experiment"].str.startswith(warm_prefix)]
    for (exp, algo), w in warm.groupby(["experiment", "algo"], sort=True):
        level = exp[len(warm_prefix):]
        base = runs[(runs["experiment"] == prefix + level) & (runs["algo"] == algo)]
        kw, nw, kb, nb = int(w["collapsed"].sum()), len(w), int(base["collapsed"].sum()), len(base)
        p = float(sps.fisher_exact([[kw, nw - kw], [kb, nb - kb]])[1]) if nb else float("nan")
        rows.append({"level": prefix + level, "algo": algo, "collapsed_warm": f"{kw}/{nw}",
                     "collapsed_cold": f"{kb}/{nb}", "fisher_p": p,
                     "ws_ev_before": float(np.nanmean(w["ev_before"])),
                     "ws_ev_after": float(np.nanmean(w["ev_after"])),
                     "train_ev_warm": float(np.nanmean(w["ev_train"])),
                     "train_ev_cold": float(np.nanmean(base["ev_train"])) if nb else float("nan"),
                     "final_success_warm": float(np.nanmean(w["final_success"])),
                     "final_success_cold": float(np.nanmean(base["final_success"])) if nb else float("nan")})
    return pd.DataFrame(rows)


def fig_frontier(cells: pd.DataFrame, levels: Sequence[str], *, labels: dict[str, str] | None = None) -> Figure:
    """Collapse probability (Wilson 95% bars) against the level, one line per preset."""
    fig = Figure(figsize=(9.5, 5.2), constrained_layout=True)
    ax = fig.subplots()
    x = {lv: i for i, lv in enumerate(levels)}
    rank = {a: i for i, a in enumerate(PRESET_ORDER)}
    algos = sorted(cells["algo"].unique(), key=lambda a: (rank.get(a, len(rank)), a))
    offsets = np.linspace(-0.22, 0.22, max(1, len(algos)))
    for off, algo in zip(offsets, algos):
        c = cells[cells["algo"] == algo].copy()
        c = c[c["level"].isin(levels)]
        c["x"] = c["level"].map(x) + off
        c = c.sort_values("x")
        err = np.vstack([c["collapse_p"] - c["collapse_p_low"],
                         c["collapse_p_high"] - c["collapse_p"]]).clip(min=0.0)  # float noise at 0, 1
        ax.errorbar(c["x"], c["collapse_p"], yerr=err, marker=preset_marker(algo), ms=5, lw=1.2, capsize=2,
                    color=preset_color(algo), label=algo)
    ax.set_xticks(range(len(levels)), [(labels or {}).get(lv, lv) for lv in levels], fontsize=8)
    ax.set_ylim(-0.03, 1.03)
    ax.set_xlabel("off-policyness level")
    ax.set_ylabel("P(collapse)  (Wilson 95%)")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), title="preset", title_fontsize=7)
    ax.grid(alpha=0.3)
    return fig


def _write_warning(study, collapse: pd.DataFrame, levels: Sequence[str], out: Path, thresholds: str,
                   min_onset: int = 0) -> None:
    """The early-warning table over every run of the levels (default alarm rule), its per-run
    rows and figure, and the table at each threshold of `thresholds` (warning_thresholds.csv).
    With `min_onset` > 0 the same two tables again without the collapsed runs whose onset comes
    before step `min_onset` (`warning_onset_ge<N>*.csv`): an alarm needs its baseline and its
    streak first, so those runs cannot be warned by construction."""
    try:
        hs = [float(h) for h in thresholds.split(",") if h.strip()]
    except ValueError:
        raise AnalysisError(f"--thresholds must be comma-separated numbers, got {thresholds!r}") from None
    if not hs or min(hs) <= 0:
        raise AnalysisError(f"--thresholds must be positive numbers, got {thresholds!r}")
    ids = set(study.runs.loc[study.runs["experiment"].isin(levels), "run_id"].astype(str))
    sub, col = _subset(study, collapse, ids, levels)
    stats = run_statistics(sub)  # the alarm statistics of every run, shared by the tables below
    table, per_run = early_warning(sub, collapse=col, stats=stats)
    table.to_csv(out / "warning.csv", index=False)
    per_run.to_csv(out / "warning_runs.csv", index=False)
    fig = fig_early_warning(table, per_run)
    for ext in ("png", "pdf"):
        fig.savefig(out / f"fig_early_warning.{ext}", dpi=120)
    threshold_sweep(sub, hs, collapse=col, stats=stats).to_csv(out / "warning_thresholds.csv", index=False)
    if min_onset > 0:
        early = col["collapsed"].astype(bool) & (col["collapse_step"].astype(float) < min_onset)
        keep = ids - set(col.loc[early, "run_id"].astype(str))
        sub, col = _subset(study, collapse, keep, levels)
        kept = stats[stats["run_id"].isin(keep)]
        early_warning(sub, collapse=col, stats=kept)[0].to_csv(out / f"warning_onset_ge{min_onset}.csv", index=False)
        threshold_sweep(sub, hs, collapse=col, stats=kept).to_csv(
            out / f"warning_onset_ge{min_onset}_thresholds.csv", index=False)


def _subset(study, collapse: pd.DataFrame, ids: set[str], levels: Sequence[str]) -> tuple[Study, pd.DataFrame]:
    def mine(frame: pd.DataFrame) -> pd.DataFrame:
        return frame[frame["run_id"].astype(str).isin(ids)]

    return (Study(study.uri, tuple(levels), mine(study.runs), mine(study.metrics), mine(study.params)),
            mine(collapse))


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m analysis.frontier", description=__doc__.splitlines()[0])
    p.add_argument("--parquet", action="append", required=True, type=Path,
                   help="a folder written by `python -m analysis.export` (repeatable)")
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--level-prefix", default="frontier_")
    p.add_argument("--thresholds", default="2,3,4,6,8",
                   help="alarm thresholds h of warning_thresholds.csv (comma-separated; default 2,3,4,6,8)")
    p.add_argument("--no-warning", action="store_true", help="skip the early-warning tables")
    p.add_argument("--warning-min-onset", type=int, default=0,
                   help="also write the warning tables without collapsed runs whose onset is before this step")
    a = p.parse_args(argv)
    from .export import load_exported

    try:
        study = load_exported(a.parquet)
        levels = level_order(study.experiments, a.level_prefix)
        if not levels:
            raise AnalysisError(f"no experiment named {a.level_prefix}* in {', '.join(map(str, a.parquet))}")
        collapse = collapse_table(study)
        every = per_run_table(study, collapse)
        runs = every[every["experiment"].isin(levels)]
        a.out.mkdir(parents=True, exist_ok=True)
        if every["experiment"].str.startswith("critic_ws_").any():
            critic_table(study, every, prefix=a.level_prefix).to_csv(a.out / "critic.csv", index=False)
        cells = cell_table(runs)
        cells.to_csv(a.out / "cells.csv", index=False)
        pairwise_table(runs).to_csv(a.out / "pairwise.csv", index=False)
        contrast_table(runs).to_csv(a.out / "contrasts.csv", index=False)
        fig = fig_frontier(cells, levels, labels=level_labels(study.runs, study.params, levels))
        for ext in ("png", "pdf"):
            fig.savefig(a.out / f"fig_frontier.{ext}", dpi=120)
        if not a.no_warning:
            _write_warning(study, collapse, levels, a.out, a.thresholds, a.warning_min_onset)
    except AnalysisError as e:
        print(f"analysis.frontier: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote cells.csv, pairwise.csv, fig_frontier.png/pdf{'' if a.no_warning else ', warning*'} to {a.out} ({len(runs)} runs, "
          f"{len(levels)} levels)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
