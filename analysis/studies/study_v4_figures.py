"""The figures of study v4 (docs/results/study_v4/README.md), from its per-run table
(`analysis.studies.study_v4.v4_runs`: identical runs are drawn once) and cells, in the style of
`analysis.figures` (plain Figures; Wilson 95% bars on collapse probabilities, percentile bootstrap
95% bars and bands on success):

* `fig_live_curves` — the live policy's success (`val/live_success_rate`, the quantity the
  collapse rule reads) against the step, one panel per off-policy level, one line per preset
  (tiny at the study's learning rate), mean and 95% band across its units;
* `fig_outcomes` — the two primary outcomes per level: P(collapse) and the area under the
  validation curve, one line per preset;
* `fig_kl_control` — the KL-matched control at `reuse`: ppo's learning-rate ladder and the
  stabilisers at the study's rate, each run's area under the validation curve against its mean
  per-step KL, collapsed runs hollow.
A figure without its runs is None. The study's levels, learning rate and stabilisers come from
`analysis.studies.study_v4`, which draws these figures.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from stppo import metric_names as T

from ..axes import base_preset
from ..figures import band_panel, draw_frontier, frontier_series, panel_grid, preset_color, preset_marker
from ..load import Study

LIVE = T.VAL_LIVE_SUCCESS_RATE
OUTCOME_YLABEL = {"collapse_p": "P(collapse of the live policy)  (Wilson 95%)",
                  "val_auc": "area under the validation curve  (bootstrap 95%)"}


def _at(frame: pd.DataFrame, model: str, lr: float) -> pd.DataFrame:
    return frame[(frame["model"].astype(str) == model) & np.isclose(frame["lr"].astype(float), lr)]


def live_frame(study: Study, runs: pd.DataFrame, *, model: str, lr: float) -> pd.DataFrame:
    """The live success of `runs` of `model` at `lr`, one run per identical unit, as tidy metrics
    whose `algo` is the run's v4 label (the coupled lags' runs under their base preset) and with
    the run's `level`."""
    sel = _at(runs, model, lr).drop_duplicates("unit")
    ids = sel["run_id"].astype(str)
    m = study.metrics[(study.metrics["metric"] == LIVE) & study.metrics["run_id"].astype(str).isin(set(ids))]
    m = m.astype({c: str for c in ("run_id", "algo", "model", "task", "metric")})
    return m.assign(algo=m["run_id"].map(dict(zip(ids, sel["algo"].astype(str)))),
                    level=m["run_id"].map(dict(zip(ids, sel["level"]))))


def fig_live_curves(study: Study, runs: pd.DataFrame, *, levels, lr: float, model: str = "tiny") -> Figure | None:
    m = live_frame(study, runs, model=model, lr=lr)
    levels = [lv for lv in levels if (m["level"] == lv).any()]
    if not levels:
        return None
    fig, axes = panel_grid(len(levels), 2, width=6.0, height=3.6)
    for ax, lv in zip(axes, levels):
        band_panel(ax, m[m["level"] == lv], LIVE, smoothing=0.0, log_scale=False,
                   title=f"{lv}: live success ({model}, lr {lr:g})")
        ax.set_ylim(-0.02, 1.02)
    fig.suptitle("the live policy's success across units (mean and 95% band; n = units)", fontsize=11)
    return fig


def fig_outcomes(cells: pd.DataFrame, *, levels, lr: float, model: str = "tiny") -> Figure | None:
    sel = _at(cells, model, lr)
    if sel.empty:
        return None
    levels = [lv for lv in levels if (sel["level"] == lv).any()]
    fig = Figure(figsize=(12.5, 4.6), constrained_layout=True)
    axes = fig.subplots(1, 2)
    series = frontier_series(sel)
    for ax, y in zip(axes, ("collapse_p", "val_auc")):
        draw_frontier(ax, sel, levels, "level", None, series, y=y, by_label=True)
        ax.set_ylabel(OUTCOME_YLABEL[y])
        ax.set_xlabel("off-policy level")
    axes[1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), title="preset", title_fontsize=7)
    fig.suptitle(f"the primary outcomes per level ({model}, lr {lr:g})", fontsize=11)
    return fig


def fig_kl_control(runs: pd.DataFrame, *, lr: float, stabilisers, model: str = "tiny") -> Figure | None:
    reuse = runs[(runs["level"] == "reuse") & (runs["model"].astype(str) == model)].drop_duplicates("unit")
    ladder = reuse[reuse["algo"] == "ppo"]
    if ladder["lr"].nunique() < 2:
        return None
    fig = Figure(figsize=(8.5, 4.6), constrained_layout=True)
    ax = fig.subplots()
    lrs = sorted(ladder["lr"].astype(float).unique())
    for i, rung in enumerate(lrs):
        _points(ax, ladder[np.isclose(ladder["lr"].astype(float), rung)], color="0.15",
                marker=("o", "s", "D", "^")[i % 4], label=f"ppo, lr {rung:g}")
    for algo in stabilisers:
        x = reuse[(reuse["algo"] == algo) & np.isclose(reuse["lr"].astype(float), lr)]
        if len(x):
            _points(ax, x, color=preset_color(base_preset(algo)), marker=preset_marker(base_preset(algo)),
                    label=f"{algo}, lr {lr:g}")
    ax.set_xscale("log")
    ax.set_xlabel("mean per-step KL of the run (log)")
    ax.set_ylabel("area under the validation curve")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), title="hollow: collapsed",
              title_fontsize=7)
    fig.suptitle(f"the KL-matched control at reuse ({model}): each run once", fontsize=11)
    return fig


def _points(ax, runs: pd.DataFrame, *, color, marker: str, label: str) -> None:
    """The runs as points (collapsed hollow), and their means (geometric for the KL) as a larger cross."""
    kl, auc = runs["mean_step_kl"].astype(float), runs["val_auc"].astype(float)
    collapsed = runs["collapsed"].astype(bool).to_numpy()
    ax.scatter(kl[~collapsed], auc[~collapsed], color=color, marker=marker, s=28, label=label)
    ax.scatter(kl[collapsed], auc[collapsed], facecolors="none", edgecolors=color, marker=marker, s=28)
    ax.scatter([np.exp(np.log(kl).mean())], [auc.mean()], color=color, marker="x", s=90, lw=2)


def write_figures(study: Study, runs: pd.DataFrame, cells: pd.DataFrame, out, *, levels, lr: float,
                  stabilisers) -> list[str]:
    """The figures that have their runs, as PNGs in `out`; returns their file names."""
    figs = {"live_curves.png": fig_live_curves(study, runs, levels=levels, lr=lr),
            "outcomes.png": fig_outcomes(cells, levels=levels, lr=lr),
            "kl_control.png": fig_kl_control(runs, lr=lr, stabilisers=stabilisers)}
    written = []
    for name, fig in figs.items():
        if fig is not None:
            fig.savefig(out / name, dpi=110)
            written.append(name)
    return written
