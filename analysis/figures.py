"""The paper's figures as functions tidy DataFrame -> matplotlib Figure. No pyplot state: figures
are plain `matplotlib.figure.Figure` (thread-safe in a server, never leaked, never shown), and
`savefig` renders them with Agg (PNG) or the PDF backend whatever the session's backend is.

* `fig_collapse_diagnosis` — one run: advantages, valid actions, grad norm, success (Fig. 2);
* `fig_token_vs_turn` — success, grad norm, pg-loss norm, clipping-bias norm per preset (Fig. 3);
* `fig_success_by_preset` — validation success per preset, one panel per model size (Fig. 4);
* `fig_clip_kl` — clip ratio and KL per preset (Fig. 5);
* `fig_frontier`, `fig_frontier_grid` — collapse probability per cell of the stability frontier
  (`analysis.studies.frontier`) against the level or the lag, and per level against the lag.
Curves across seeds are the mean with a 95% band that stays in the quantity's range (`stats.aggregate`:
bootstrap for rates and non-negative quantities, t otherwise); where seeds drop out the points are
marked and the new count is written ("n=2"). Step axes have integer ticks. A metric a run did not
log gets a panel with a note, never an exception.
"""

from __future__ import annotations

from typing import Sequence

import matplotlib
import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from stppo import metric_names as T

from .axes import DEFAULT_LAG_MODE, base_preset
from .stats import aggregate

PRESET_ORDER = ("ppo", "turn_ppo", "s_ppo", "st_ppo", "so_ppo", "grpo", "gspo", "so_grpo",
                "cispo", "gmpo", "sapo", "dapo", "rloo")
MARKERS = ("o", "s", "^", "v", "D", "P", "X", "*", "<", ">", "h", "p", "d")
STYLES = ("-", "--", ":", "-.")
FIG3_METRICS = (T.SUCCESS_RATE, T.GRAD_NORM, T.PG_LOSS_NORM, T.CLIP_BIAS_NORM)
FIG5_METRICS = (T.PG_CLIPFRAC, T.PPO_KL, T.KL_REF)
ADVANTAGES = (T.ADV_MEAN, T.ADV_STD, T.ADV_MAX, T.ADV_MIN)
# Sampler vs trainer mismatch and stale rollouts next to Fig. 2's panels (title, keys; a panel shows
# the keys a run logged): verl's rollout_corr/* and stppo's offpolicy/* (docs/design.md §4)
MISMATCH_PANELS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("sampler vs trainer KL", (T.ROLLOUT_CORR_KL, T.ROLLOUT_CORR_K3_KL, T.ROLLOUT_CORR_LOG_PPL_DIFF,
                               T.ROLLOUT_CORR_LOG_PPL_ABS_DIFF)),
    ("χ² of π_old / π_rollout", (T.ROLLOUT_CORR_CHI2_TOKEN, T.ROLLOUT_CORR_CHI2_SEQ)),
    ("perplexity (trainer, sampler)", (T.ROLLOUT_CORR_TRAINING_PPL, T.ROLLOUT_CORR_ROLLOUT_PPL,
                                       T.ROLLOUT_CORR_PPL_RATIO)),
    ("IS weights", (T.ROLLOUT_IS_MEAN, T.ROLLOUT_IS_MAX)),
    ("IS effective sample size, out-of-bound shares", (T.ROLLOUT_IS_ESS, T.ROLLOUT_IS_FRACTION_HIGH,
                                                       T.ROLLOUT_IS_FRACTION_LOW)),
    ("staleness: lag of the sampling policy (steps)", (T.OFFPOLICY_LAG_MEAN, T.OFFPOLICY_LAG_MAX)),
    ("KL of the stale policy to the current one", (T.OFFPOLICY_KL_TO_CURRENT,)),
)
TURN_MISMATCH = "rollout_kl"  # the per-turn sampler/trainer KL `turn/k{k}/rollout_kl`


def preset_color(algo: str):
    """A fixed colour per preset, so every figure colours a preset the same way: tab10 for the
    first ten presets, the light halves of tab20 after them."""
    i = PRESET_ORDER.index(algo) if algo in PRESET_ORDER else len(PRESET_ORDER) + sum(map(ord, algo)) % 4
    return matplotlib.colormaps["tab10"](i) if i < 10 else matplotlib.colormaps["tab20"](2 * (i - 10) + 1)


def preset_marker(algo: str) -> str:
    """A fixed marker per preset (with `preset_color`, tells 13 presets apart in one panel)."""
    i = PRESET_ORDER.index(algo) if algo in PRESET_ORDER else sum(map(ord, algo))
    return MARKERS[i % len(MARKERS)]


def _note(ax, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, fontsize=9, color="0.4", wrap=True)
    ax.set_xticks([])
    ax.set_yticks([])


def panel_grid(n: int, ncols: int, width: float = 5.2, height: float = 3.0) -> tuple[Figure, list]:
    ncols = max(1, min(ncols, n))
    nrows = -(-n // ncols)
    fig = Figure(figsize=(width * ncols, height * nrows), layout="constrained")
    axes = [fig.add_subplot(nrows, ncols, i + 1) for i in range(n)]
    return fig, axes


def int_steps(ax) -> None:
    """Integer ticks on a step axis."""
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def _one(metrics: pd.DataFrame, run_id: str, metric: str) -> pd.DataFrame:
    sub = metrics[(metrics["run_id"] == run_id) & (metrics["metric"] == metric)]
    return sub[["step", "value"]].sort_values("step")


def fig_collapse_diagnosis(metrics: pd.DataFrame, run_id: str, *, collapse_step: float | None = None,
                           extra_metrics: Sequence[str] = (), title: str | None = None) -> Figure:
    """Fig. 2 for one run: advantage statistics, valid-action ratio, grad norm, train and val
    success, plus one panel per `extra_metrics`; a dashed red line marks `collapse_step`."""
    panels: list[tuple[str, tuple[str, ...]]] = [
        ("advantages", ADVANTAGES), ("valid action ratio", (T.VALID_ACTION_RATIO,)),
        ("grad norm (pre-clip)", (T.GRAD_NORM, T.GRAD_NORM_MAX)),
        ("success rate", (T.SUCCESS_RATE, T.VAL_SUCCESS_RATE)),
    ] + [(m, (m,)) for m in extra_metrics]
    fig, axes = panel_grid(len(panels), 2)
    run = metrics[metrics["run_id"] == run_id]
    for ax, (name, keys) in zip(axes, panels):
        drawn = 0
        for key in keys:
            pts = _one(run, run_id, key)
            if pts.empty:
                continue
            marker = "o" if key == T.VAL_SUCCESS_RATE else None
            ax.plot(pts["step"], pts["value"].where(np.isfinite(pts["value"])), marker=marker, ms=3, lw=1.2,
                    label=key)
            drawn += 1
        if not drawn:
            _note(ax, f"{name}: not logged by this run ({', '.join(keys)})")
            ax.set_title(name, fontsize=10)
            continue
        if collapse_step is not None and np.isfinite(collapse_step):
            ax.axvline(collapse_step, color="red", ls="--", lw=1.2, label=f"collapse (step {int(collapse_step)})")
        ax.set_title(name, fontsize=10)
        ax.set_xlabel("step")
        int_steps(ax)
        ax.legend(fontsize=7, loc="best")
        ax.grid(alpha=0.3)
    fig.suptitle(title or f"collapse diagnosis — run {run_id}", fontsize=11)
    return fig


def _filter(metrics: pd.DataFrame, presets: Sequence[str] | None, models: Sequence[str] | None) -> pd.DataFrame:
    keep = np.ones(len(metrics), dtype=bool)
    if presets:
        keep &= metrics["algo"].isin(list(presets)).to_numpy()
    if models:
        keep &= metrics["model"].isin(list(models)).to_numpy()
    return metrics[keep]


def _label(row: pd.Series, multi_model: bool, multi_task: bool) -> str:
    parts = [row["algo"]] + ([row["model"]] if multi_model else []) + ([row["task"]] if multi_task else [])
    return " · ".join(parts)


def band_panel(ax, metrics: pd.DataFrame, metric: str, *, smoothing: float, log_scale: bool,
                title: str | None = None) -> None:
    """Mean and 95% band across seeds of `metric`, one line per (algo, model, task); seed counts
    written where they drop."""
    agg = aggregate(metrics, metric, smoothing=smoothing)
    ax.set_title(title or metric, fontsize=10)
    if agg.empty:
        _note(ax, f"{metric}: not logged by the selected runs")
        return
    models = sorted(agg["model"].unique())
    multi_model, multi_task = len(models) > 1, agg["task"].nunique() > 1
    for key, grp in agg.groupby(["algo", "model", "task"], sort=True):
        row = pd.Series(dict(zip(["algo", "model", "task"], key)))
        color, ls = preset_color(row["algo"]), STYLES[models.index(row["model"]) % len(STYLES)]
        ax.plot(grp["step"], grp["mean"], color=color, ls=ls, lw=1.4,
                label=f"{_label(row, multi_model, multi_task)} (n={int(grp['n'].max())})")
        ax.fill_between(grp["step"], grp["ci_low"], grp["ci_high"], color=color, alpha=0.18, lw=0)
        _seed_counts(ax, grp, color)
    if log_scale and (agg["mean"] > 0).any():
        ax.set_yscale("log")
    ax.set_xlabel("step")
    int_steps(ax)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="best")


def seed_drops(grp: pd.DataFrame) -> pd.DataFrame:
    """Rows of one curve of `aggregate` where the number of seeds changes to below its maximum."""
    n = grp["n"].to_numpy()
    changed = np.r_[False, n[1:] != n[:-1]]
    return grp[changed & (n < n.max())]


def _seed_counts(ax, grp: pd.DataFrame, color) -> None:
    fewer = grp[grp["n"] < grp["n"].max()]
    if fewer.empty:
        return
    ax.plot(fewer["step"], fewer["mean"], ls="none", marker=".", ms=3, color=color)
    for _, r in seed_drops(grp).iterrows():
        ax.annotate(f"n={int(r['n'])}", (r["step"], r["mean"]), xytext=(2, 4), textcoords="offset points",
                    fontsize=6, color=color)


def _band_figure(metrics: pd.DataFrame, keys: Sequence[str], *, presets, models, smoothing: float,
                 log_keys: Sequence[str], title: str, ncols: int = 2) -> Figure:
    sub = _filter(metrics, presets, models)
    fig, axes = panel_grid(len(keys), ncols)
    for ax, key in zip(axes, keys):
        band_panel(ax, sub, key, smoothing=smoothing, log_scale=key in log_keys)
    fig.suptitle(title, fontsize=11)
    return fig


def fig_token_vs_turn(metrics: pd.DataFrame, *, presets: Sequence[str] | None = None,
                      models: Sequence[str] | None = None, smoothing: float = 0.0, log_scale: bool = False,
                      keys: Sequence[str] = FIG3_METRICS) -> Figure:
    """Fig. 3: token- vs turn-level presets — success, grad norm, pg-loss norm, clipping-bias norm;
    mean and 95% CI across seeds; `log_scale` puts the non-success panels on a log axis."""
    log_keys = [k for k in keys if log_scale and "success" not in k]
    return _band_figure(metrics, keys, presets=presets, models=models, smoothing=smoothing, log_keys=log_keys,
                        title="token vs turn level (mean and 95% CI across seeds)")


def fig_success_by_preset(metrics: pd.DataFrame, *, presets: Sequence[str] | None = None,
                          models: Sequence[str] | None = None, smoothing: float = 0.0) -> Figure:
    """Fig. 4: success per preset (validation when logged, else training), one panel per model."""
    sub = _filter(metrics, presets, models)
    key = T.VAL_SUCCESS_RATE if (sub["metric"] == T.VAL_SUCCESS_RATE).any() else T.SUCCESS_RATE
    names = sorted(sub["model"].astype(str).unique()) or ["(no runs)"]
    fig, axes = panel_grid(len(names), 3)
    for ax, model in zip(axes, names):
        band_panel(ax, sub[sub["model"] == model], key, smoothing=smoothing, log_scale=False,
                    title=f"{key} — model {model}")
        ax.set_ylim(-0.02, 1.02)
    fig.suptitle("success by preset across seeds (mean and 95% CI)", fontsize=11)
    return fig


def fig_clip_kl(metrics: pd.DataFrame, *, presets: Sequence[str] | None = None,
                models: Sequence[str] | None = None, smoothing: float = 0.0, log_scale: bool = False) -> Figure:
    """Fig. 5: clip ratio (`actor/pg_clipfrac`) and KL (`actor/ppo_kl`, `actor/kl_ref`) per preset."""
    keys = [k for k in FIG5_METRICS if k != T.KL_REF or (metrics["metric"] == T.KL_REF).any()]
    return _band_figure(metrics, keys, presets=presets, models=models, smoothing=smoothing,
                        log_keys=keys if log_scale else (), title="clip ratio and KL by preset (mean and 95% CI)")


CORRECTION_MARKERS = ("^", "v", "P", "X", "*", "<", ">")


def frontier_series(cells: pd.DataFrame) -> list[tuple[str, str | None]]:
    """(preset label, lag mode or None) per line, presets in PRESET_ORDER; the mode only when the
    cells have several."""
    modes = "lag_mode" in cells.columns and cells["lag_mode"].nunique() > 1
    pairs = cells[["algo", "lag_mode"]].drop_duplicates() if modes else cells[["algo"]].drop_duplicates()
    rank = {a: i for i, a in enumerate(PRESET_ORDER)}
    out = [(str(r["algo"]), str(r["lag_mode"]) if modes else None) for _, r in pairs.iterrows()]
    return sorted(out, key=lambda s: (rank.get(base_preset(s[0]), len(rank)), s[0], s[1] or ""))


def cell_errorbar(ax, cells: pd.DataFrame, xs, y: str, *, color, marker: str, ls: str = "-",
                  hollow: bool = False, label: str | None = None):
    """One line of cells at positions `xs`: column `y` with bars to its interval (`y`_low,
    `y`_high, as `analysis.studies.frontier.cell_table` names them); no bar where a bound is NaN."""
    err = np.vstack([cells[y] - cells[f"{y}_low"], cells[f"{y}_high"] - cells[y]])
    err = np.nan_to_num(err, nan=0.0).clip(min=0.0)  # float noise at 0, 1
    return ax.errorbar(xs, cells[y], yerr=err, marker=marker, ms=5, lw=1.2, capsize=2, ls=ls, color=color,
                       mfc="none" if hollow else None, label=label)


def draw_frontier(ax, cells: pd.DataFrame, order: Sequence, x: str, labels: dict | None,
                   series: list[tuple[str, str | None]] | None = None, y: str = "collapse_p",
                   by_label: bool = False) -> None:
    """`y` (default P(collapse) with its Wilson bars) per series (`frontier_series`) at the
    positions of `order`, in its preset's colour (a corrected preset dashed with a marker of its
    correction, and with a colour of its own when `by_label`; a lag mode other than fixed dotted
    with hollow markers)."""
    pos = {v: i for i, v in enumerate(order)}
    series = series if series is not None else frontier_series(cells)
    for off, (algo, mode) in zip(np.linspace(-0.22, 0.22, max(1, len(series))), series):
        c = cells[(cells["algo"] == algo) & (cells[x].isin(list(order)))]
        if mode is not None:
            c = c[c["lag_mode"] == mode]
        if c.empty:
            continue
        c = c.assign(_x=c[x].map(pos) + off).sort_values("_x")
        odd_mode = mode not in (None, DEFAULT_LAG_MODE)
        ls = {(False, False): "-", (True, False): "--", (False, True): ":", (True, True): "-."}["+" in algo, odd_mode]
        color, marker = preset_color(base_preset(algo)), preset_marker(base_preset(algo))
        if "+" in algo:  # each correction of a preset its own marker (and colour, by_label)
            i = sorted({a for a, _ in series if base_preset(a) == base_preset(algo) and "+" in a}).index(algo)
            marker = CORRECTION_MARKERS[i % len(CORRECTION_MARKERS)]
            color = matplotlib.colormaps["Dark2"](i % 8) if by_label else color
        cell_errorbar(ax, c, c["_x"], y, color=color, marker=marker, ls=ls, hollow=odd_mode,
                      label=algo + (f" ({mode})" if mode is not None else ""))
    ax.set_xticks(range(len(order)), [(labels or {}).get(v, str(v)) for v in order], fontsize=8)
    ax.set_ylim(-0.03, 1.03)
    ax.grid(alpha=0.3)


FRONTIER_YLABEL = {"collapse_p": "P(collapse)  (Wilson 95%)", "final_success": "final val success  (bootstrap 95%)"}


def fig_frontier(cells: pd.DataFrame, levels: Sequence, *, labels: dict | None = None, x: str = "level",
                 xlabel: str = "off-policyness level", y: str = "collapse_p") -> Figure:
    """Collapse probability (Wilson 95% bars; or another cell column `y` with its interval, e.g.
    final_success) against the cells' column `x` (the level, or the lag) at the values `levels`
    in order, one line per preset label (and lag mode)."""
    fig = Figure(figsize=(9.5, 5.2), constrained_layout=True)
    ax = fig.subplots()
    draw_frontier(ax, cells, levels, x, labels, y=y)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(FRONTIER_YLABEL.get(y, y))
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), title="preset", title_fontsize=7)
    return fig


def fig_frontier_grid(cells: pd.DataFrame, levels: Sequence[str], lags: Sequence[int], *,
                      labels: dict | None = None) -> Figure:
    """The level × lag frontier: one panel per level (titled by `labels`), collapse probability
    against the lag in each; cells with columns level, lag (, lag_mode), algo."""
    fig = Figure(figsize=(3.2 * max(1, len(levels)) + 2.2, 4.4), constrained_layout=True)
    axes = np.atleast_1d(fig.subplots(1, max(1, len(levels)), sharey=True))
    handles: dict[str, object] = {}
    series = frontier_series(cells)  # the same lines in every panel
    for ax, lv in zip(axes, levels):
        draw_frontier(ax, cells[cells["level"] == lv], lags, "lag", None, series)
        ax.set_title((labels or {}).get(lv, lv), fontsize=8)
        ax.set_xlabel("lag k")
        handles |= dict(zip(*reversed(ax.get_legend_handles_labels())))
    axes[0].set_ylabel("P(collapse)  (Wilson 95%)")
    fig.legend(list(handles.values()), list(handles), fontsize=7, loc="outside right upper", title="preset",
               title_fontsize=7)
    return fig
