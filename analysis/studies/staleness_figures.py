"""The figures of study v3 from its cells (`analysis.studies.staleness_runs.study_cells`), in the style of
`analysis.figures` (plain Figures; Wilson 95% bars on collapse probabilities, percentile bootstrap
95% bars on final success):

* `fig_staleness_frontier` — part 1: P(collapse) against the lag, one line per preset at the
  fixed lag (the corrected, coupled and uniform-lag cells are in the table and the success figure);
* `fig_success_vs_lag` — part 1: final success against the lag; the presets in one panel, grpo
  with each rollout correction in a second, the coupled and uniform-lag series in a third (the
  last two with their presets' fixed-lag lines);
* `fig_size` — part 3: P(collapse) and final success against the lag per model, one panel per
  preset of part 3, CPU and GPU apart (solid and dashed);
* `fig_l2_vs_l1f` — part 2 next to part 1 at part 2's lags and presets.
A figure whose cells are not there is None.
"""

from __future__ import annotations

import matplotlib
import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from ..axes import DEFAULT_LAG_MODE, lag_label, lag_order
from ..figures import FRONTIER_YLABEL, cell_errorbar, draw_frontier, fig_frontier, frontier_series
from .staleness_runs import GPU, L1F, MODELS, PART2_LAGS, PART2_PRESETS, SIZE_GPU, SIZE_PRESETS

LAG_XLABEL = "lag k: the batch of step t was sampled by the policy after step t − k"
METRICS = ("collapse_p", "final_success")


def _part(cells: pd.DataFrame, part: str) -> pd.DataFrame:
    return cells[cells["part"] == part]


def _labels(lags) -> dict:
    return {k: lag_label(k) for k in lags}


def _legend(ax, title: str = "preset") -> None:
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), title=title, title_fontsize=7)


def fig_staleness_frontier(cells: pd.DataFrame) -> Figure | None:
    one = _part(cells, "1")
    if one.empty:
        return None
    lags = lag_order(one["lag"])
    plain = one[~one["algo"].astype(str).str.contains("+", regex=False) & (one["lag_mode"] == DEFAULT_LAG_MODE)]
    plain = plain if len(plain) else one  # the presets at the fixed lag; the variants are in cells.csv
    fig = fig_frontier(plain, lags, x="lag", labels=_labels(lags), xlabel=LAG_XLABEL)
    fig.axes[0].set_title(f"part 1: staleness frontier ({L1F}, tiny; presets at the fixed lag)", fontsize=10)
    return fig


def _variants(one: pd.DataFrame) -> list[tuple[pd.DataFrame, str]]:
    """The panels of part 1's success figure: the presets at the fixed lag; grpo with each rollout
    correction; the coupled form and the uniform lag. The last two with the fixed-lag cells of
    their presets for reference; a panel without cells is left out."""
    label = one["algo"].astype(str)
    corr = label.str.contains("+", regex=False)
    coupled = corr & label.str.contains("+bypass_", regex=False)
    uniform = one["lag_mode"] != DEFAULT_LAG_MODE
    plain = one[~corr & ~uniform]

    def with_bases(odd: pd.Series) -> pd.DataFrame:
        bases = set(label[odd].str.split("+").str[0])
        return pd.concat([one[odd], plain[plain["algo"].isin(bases)]]) if odd.any() else one[odd]

    panels = [(plain, "presets (fixed lag)"), (with_bases(corr & ~coupled), "rollout corrections (decoupled)"),
              (with_bases(coupled | uniform), "coupled form (bypass_ppo_clip), uniform lag")]
    return [(p, t) for p, t in panels if len(p)]


def fig_success_vs_lag(cells: pd.DataFrame) -> Figure | None:
    one = _part(cells, "1")
    if one.empty:
        return None
    lags = lag_order(one["lag"])
    panels = _variants(one)
    fig = Figure(figsize=(7.0 * len(panels), 5.2), constrained_layout=True)
    axes = np.atleast_1d(fig.subplots(1, len(panels), sharey=True))
    for ax, (sub, title) in zip(axes, panels):
        draw_frontier(ax, sub, lags, "lag", _labels(lags), y="final_success", by_label=title.startswith("rollout"))
        ax.set_title(f"part 1: {title}", fontsize=10)
        ax.set_xlabel("lag k")
        _legend(ax)
    axes[0].set_ylabel(FRONTIER_YLABEL["final_success"])
    return fig


def _size_cells(cells: pd.DataFrame) -> pd.DataFrame:
    keep = (cells["level"].isin([L1F, SIZE_GPU]) & cells["algo"].isin(SIZE_PRESETS)
            & (cells["lag_mode"] == DEFAULT_LAG_MODE) & cells["model"].isin(MODELS))
    return cells[keep]


def fig_size(cells: pd.DataFrame) -> Figure | None:
    """Needs a model other than tiny, or a GPU run (else it is part 1 again)."""
    sz = _size_cells(cells)
    if sz.empty or not ((sz["model"] != "tiny") | (sz["machine"] == GPU)).any():
        return None
    lags = lag_order(sz["lag"])
    pos = {k: i for i, k in enumerate(lags)}
    lines = sorted(sz[["machine", "model"]].drop_duplicates().itertuples(index=False),
                   key=lambda r: (r.machine, MODELS.index(r.model)))
    fig = Figure(figsize=(3.6 * len(SIZE_PRESETS) + 1.6, 6.4), constrained_layout=True)
    axes = fig.subplots(2, len(SIZE_PRESETS), sharey=True, squeeze=False)
    for col, preset in enumerate(SIZE_PRESETS):
        for row, y in enumerate(METRICS):
            ax = axes[row, col]
            for off, line in zip(np.linspace(-0.15, 0.15, max(1, len(lines))), lines):
                c = sz[(sz["algo"] == preset) & (sz["machine"] == line.machine) & (sz["model"] == line.model)]
                if c.empty:
                    continue
                c = c.sort_values("lag")
                i = MODELS.index(line.model)
                cell_errorbar(ax, c, c["lag"].map(pos) + off, y, color=matplotlib.colormaps["tab10"](i),
                              marker="osD"[i], ls="--" if line.machine == GPU else "-",
                              label=f"{line.model} ({line.machine})")
            ax.set_xticks(range(len(lags)), [str(k) for k in lags], fontsize=8)
            ax.set_ylim(-0.03, 1.03)
            ax.grid(alpha=0.3)
            if row == 0:
                ax.set_title(preset, fontsize=10)
            if row == 1:
                ax.set_xlabel("lag k")
            if col == 0:
                ax.set_ylabel(FRONTIER_YLABEL[y])
    handles = {lab: h for ax in axes.flat for h, lab in zip(*ax.get_legend_handles_labels())}
    fig.legend(list(handles.values()), list(handles), fontsize=7, loc="outside right upper", title="model",
               title_fontsize=7)
    fig.suptitle("part 3: model size (CPU solid, GPU dashed)", fontsize=11)
    return fig


def fig_l2_vs_l1f(cells: pd.DataFrame) -> Figure | None:
    two = _part(cells, "2")
    two = two[two["lag_mode"] == DEFAULT_LAG_MODE]
    if two.empty:
        return None
    lags = lag_order([*two["lag"], *PART2_LAGS])
    one = _part(cells, "1")
    one = one[(one["lag_mode"] == DEFAULT_LAG_MODE) & one["algo"].isin(PART2_PRESETS) & one["lag"].isin(lags)]
    panels = [(sub, name) for sub, name in ((one, "part 1 (l1f)"), (two, "part 2 (l2)")) if len(sub)]
    series = frontier_series(pd.concat([one, two]))  # the same lines in every panel
    fig = Figure(figsize=(4.6 * len(panels) + 2.0, 7.0), constrained_layout=True)
    axes = fig.subplots(2, len(panels), sharey=True, squeeze=False)
    for col, (sub, name) in enumerate(panels):
        for row, y in enumerate(METRICS):
            draw_frontier(axes[row, col], sub, lags, "lag", _labels(lags), series, y=y)
            axes[row, 0].set_ylabel(FRONTIER_YLABEL[y])
        axes[0, col].set_title(name, fontsize=10)
        axes[1, col].set_xlabel("lag k")
    handles = {lab: h for ax in axes.flat for h, lab in zip(*ax.get_legend_handles_labels())}
    fig.legend(list(handles.values()), list(handles), fontsize=7, loc="outside right upper", title="preset",
               title_fontsize=7)
    return fig


FIGURES = {"fig_staleness_frontier": fig_staleness_frontier, "fig_success_vs_lag": fig_success_vs_lag,
           "fig_size": fig_size, "fig_l2_vs_l1f": fig_l2_vs_l1f}
