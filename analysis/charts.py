"""Interactive charts (Vega-Lite through Altair) for the dashboard: tidy DataFrame -> `alt.Chart`.

The report keeps the matplotlib figures of `analysis.figures`; these are their interactive forms:
* every step axis is an integer axis (format "d", tickMinStep 1);
* hover shows a tooltip with the values (and the number of seeds behind a mean);
* detail panels zoom and pan along steps (mouse wheel, drag);
* a brush (drag over steps) on the first panel filters the companion panels to those steps.
Bands come from `stats.aggregate` and so stay within the quantity's range; points where seeds have
dropped out are drawn and labelled with their count ("n=2").
"""

from __future__ import annotations

from typing import Sequence

import altair as alt
import numpy as np
import pandas as pd
from matplotlib.colors import to_hex

from stppo import metric_names as T

from .axes import base_preset, lag_label
from .figures import preset_color, seed_drops
from .stats import aggregate, metric_kind

WIDTH, HEIGHT = 520, 190


def step_x(title: str = "step", field: str = "step") -> alt.X:
    return alt.X(f"{field}:Q", title=title, axis=alt.Axis(format="d", tickMinStep=1))


def _brush() -> alt.Parameter:
    return alt.selection_interval(encodings=["x"], name="steps")


def _zoom(name: str = "zoom") -> alt.Parameter:
    """Zoom and pan along steps (one parameter per panel: a name shared between panels would be
    merged by Altair with a warning)."""
    return alt.selection_interval(encodings=["x"], bind="scales", name=name)


def _collapse_rule(step: float | None) -> alt.Chart | None:
    if step is None or not np.isfinite(step):
        return None
    frame = pd.DataFrame({"step": [int(step)], "label": [f"collapse (step {int(step)})"]})
    return alt.Chart(frame).mark_rule(color="red", strokeDash=[5, 3]).encode(x="step:Q", tooltip=["label:N"])


def _layer(chart: alt.Chart, rule: alt.Chart | None):
    return chart if rule is None else alt.layer(chart, rule)


def run_panels(metrics: pd.DataFrame, run_id: str, panels: Sequence[tuple[str, Sequence[str]]], *,
               collapse_step: float | None = None) -> alt.VConcatChart | None:
    """One run's metrics, one panel per (title, keys): the first panel carries the step brush, the
    others are filtered by it and zoom along steps; None when the run logged none of the keys."""
    run = metrics[metrics["run_id"] == run_id]
    brush, rule = _brush(), _collapse_rule(collapse_step)
    charts = []
    for title, keys in panels:
        data = run.loc[run["metric"].isin(list(keys)), ["step", "metric", "value"]].copy()
        data = data[np.isfinite(data["value"])]
        if data.empty:
            continue
        data["metric"] = data["metric"].astype(str)
        base = alt.Chart(data, title=title, width=WIDTH, height=HEIGHT).mark_line(point=alt.OverlayMarkDef(size=14))
        enc = base.encode(x=step_x(), y=alt.Y("value:Q", title=None, scale=alt.Scale(zero=False)),
                          color=alt.Color("metric:N", legend=alt.Legend(orient="bottom", title=None, labelLimit=400)),
                          tooltip=["step:Q", "metric:N", alt.Tooltip("value:Q", format=".4g")])
        if charts:
            enc = enc.transform_filter(brush).add_params(_zoom(f"zoom{len(charts)}"))
        else:
            enc = enc.add_params(brush)
        charts.append(_layer(enc, rule))
    return alt.vconcat(*charts).resolve_scale(color="independent") if charts else None


def _series_label(agg: pd.DataFrame) -> pd.Series:
    multi_model, multi_task = agg["model"].nunique() > 1, agg["task"].nunique() > 1
    label = agg["algo"].astype(str)
    if multi_model:
        label = label + " · " + agg["model"].astype(str)
    if multi_task:
        label = label + " · " + agg["task"].astype(str)
    return label


def band_frame(metrics: pd.DataFrame, metric: str, smoothing: float = 0.0) -> pd.DataFrame:
    """`aggregate` of one metric with a `series` label, `n_max` per series and `drop` (the count
    label where seeds drop out, else '')."""
    agg = aggregate(metrics, metric, smoothing=smoothing)
    if agg.empty:
        return agg.assign(series=[], n_max=[], drop=[])
    agg["series"] = _series_label(agg)
    agg["n_max"] = agg.groupby("series")["n"].transform("max")
    agg["drop"] = ""
    for _, grp in agg.groupby("series", sort=False):
        rows = seed_drops(grp)
        agg.loc[rows.index, "drop"] = [f"n={int(n)}" for n in rows["n"]]
    return agg


def band_chart(agg: pd.DataFrame, title: str, *, log_scale: bool = False, brush: alt.Parameter | None = None,
               filter_by: alt.Parameter | None = None, domain: Sequence[float] | None = None,
               zoom: alt.Parameter | None = None) -> alt.Chart:
    """Mean line and 95% band per series of `band_frame`; points and labels where seeds dropped out."""
    scale = alt.Scale(type="log") if log_scale and (agg["mean"] > 0).all() else alt.Scale(zero=False)
    if domain is not None:
        scale = alt.Scale(domain=list(domain))
    base = alt.Chart(agg, title=title, width=WIDTH, height=HEIGHT)
    if filter_by is not None:
        base = base.transform_filter(filter_by)
    first = agg.drop_duplicates("series")
    color = alt.Color("series:N", legend=alt.Legend(orient="bottom", title=None), scale=_series_colors(first))
    tip = ["series:N", "step:Q", alt.Tooltip("mean:Q", format=".4g"), alt.Tooltip("ci_low:Q", format=".4g"),
           alt.Tooltip("ci_high:Q", format=".4g"), alt.Tooltip("n:Q", title="seeds"), "interval:N"]
    band = base.mark_area(opacity=0.2).encode(x=step_x(), y=alt.Y("ci_low:Q", title=None, scale=scale),
                                              y2="ci_high:Q", color=color)
    line = base.mark_line().encode(x=step_x(), y=alt.Y("mean:Q", scale=scale), color=color, tooltip=tip,
                                   strokeDash=alt.StrokeDash("model:N", legend=None))  # model sizes apart
    fewer = base.transform_filter("datum.n < datum.n_max").mark_point(size=18, filled=True).encode(
        x=step_x(), y=alt.Y("mean:Q", scale=scale), color=color, tooltip=tip)
    labels = base.transform_filter("datum.drop != ''").mark_text(dx=4, dy=-8, fontSize=10, align="left").encode(
        x=step_x(), y=alt.Y("mean:Q", scale=scale), text="drop:N", color=color)
    chart = alt.layer(band, line, fewer, labels)
    return chart.add_params(brush) if brush is not None else chart.add_params(zoom or _zoom())


def band_charts(metrics: pd.DataFrame, keys: Sequence[str], *, smoothing: float = 0.0, log_keys: Sequence[str] = (),
                columns: int = 2) -> alt.ConcatChart | None:
    """Band charts of several metrics; a brush over steps on the first filters the others."""
    brush, charts = _brush(), []
    for key in keys:
        agg = band_frame(metrics, key, smoothing)
        if agg.empty:
            continue
        rate = metric_kind(key) == "rate"
        charts.append(band_chart(agg, key, log_scale=key in log_keys, domain=(0, 1) if rate else None,
                                 brush=brush if not charts else None, filter_by=brush if charts else None,
                                 zoom=_zoom(f"zoom{len(charts)}")))
    return alt.concat(*charts, columns=columns) if charts else None


def _turn_of(key: str, name: str) -> int | None:
    """k of a key `turn/k{k}/{name}`, else None. Spelled out rather than through
    `T.parse_turn_key`, which knows only the names of TURN_METRICS, so a per-turn metric a newer
    trainer logs (`rollout_kl`) is drawn from any store."""
    head, sep, tail = key.removeprefix(T.TURN_PREFIX).partition("/")
    return int(head) if key.startswith(T.TURN_PREFIX) and sep and tail == name and head.isdigit() else None


def turn_frame(metrics: pd.DataFrame, run_id: str, name: str) -> pd.DataFrame:
    """(step, turn, value) of the per-turn metric `name` of one run (keys `turn/k{k}/{name}`)."""
    run = metrics[metrics["run_id"] == run_id]
    turns = {str(k): t for k in run["metric"].unique() if (t := _turn_of(str(k), name)) is not None}
    sub = run[run["metric"].isin(list(turns))]
    turn = sub["metric"].astype(str).map(turns)
    return pd.DataFrame({"step": sub["step"].to_numpy(), "turn": turn.to_numpy(dtype=np.int64),
                         "value": sub["value"].to_numpy()}).sort_values(["turn", "step"], ignore_index=True)


def series_preset(label: str) -> str:
    """The preset of a series label (`grpo+decoupled_geo_rs · lag 2` -> `grpo`), for its colour."""
    return base_preset(str(label).split(" · ", 1)[0])


def _series_colors(first: pd.DataFrame) -> alt.Scale:
    """Colours of the series (`series`, `algo` columns, one row each): each preset's own colour, as
    in the report's figures, while every series is a different preset; a categorical scheme when a
    preset has several series (lags, corrections), so its lines stay apart."""
    presets = first["algo"].map(series_preset)
    if presets.is_unique:
        return alt.Scale(domain=list(first["series"]), range=[to_hex(preset_color(a)) for a in presets])
    return alt.Scale(domain=list(first["series"]), scheme="tableau10" if len(first) <= 10 else "tableau20")


def turn_names(metrics: pd.DataFrame, run_id: str | None = None) -> list[str]:
    """The per-turn metric names logged (by `run_id`, or by any run), in TURN_METRICS order."""
    sub = metrics if run_id is None else metrics[metrics["run_id"] == run_id]
    found = {p[1] for k in sub["metric"].unique() if (p := T.parse_turn_key(str(k)))}
    return [n for n in T.TURN_METRICS if n in found]


def turn_heatmap(frame: pd.DataFrame, name: str, *, collapse_step: float | None = None) -> alt.Chart:
    """Turn × step heatmap of one per-turn metric (`turn_frame`), collapse step marked. (The rows'
    height is a fixed step: Streamlit's theme squeezes an ordinal axis given a total height.)"""
    data = frame.assign(x0=frame["step"] - 0.5, x1=frame["step"] + 0.5)
    heat = alt.Chart(data, title=f"turn/k*/{name} per turn and step", width=2 * WIDTH,
                     height=alt.Step(28)).mark_rect().encode(
        x=alt.X("x0:Q", title="step", axis=alt.Axis(format="d", tickMinStep=1)), x2="x1:Q",
        y=alt.Y("turn:O", title="turn k"),
        color=alt.Color("value:Q", title=name, scale=alt.Scale(scheme="viridis")),
        tooltip=["step:Q", alt.Tooltip("turn:Q", title="turn k"), alt.Tooltip("value:Q", format=".4g")])
    return _layer(heat.add_params(_zoom()), _collapse_rule(collapse_step))


def alarm_chart(stats: pd.DataFrame, runs: pd.DataFrame, indicator: str, threshold: float) -> alt.Chart:
    """The alarm statistic of one indicator over steps for every run (collapsed runs in red), the
    threshold as a rule; hover names the run."""
    sub = stats[(stats["indicator"] == indicator) & np.isfinite(stats["stat"])]
    info = runs.set_index("run_id")
    data = sub.assign(run=sub["run_id"].map(lambda r: f"{info.loc[r, 'algo']} · seed {info.loc[r, 'seed']} · {r[:8]}"),
                      collapsed=sub["run_id"].map(lambda r: "collapsed" if info.loc[r, "collapsed"] else "no collapse"))
    lines = alt.Chart(data, title=f"alarm statistic a_t of {indicator}", width=2 * WIDTH,
                      height=240).mark_line(point=alt.OverlayMarkDef(size=10), opacity=0.8).encode(
        x=step_x(), y=alt.Y("stat:Q", title="a_t"), detail="run:N",
        color=alt.Color("collapsed:N", scale=alt.Scale(domain=["collapsed", "no collapse"],
                                                       range=["#d62728", "#1f77b4"])),
        tooltip=["run:N", "step:Q", alt.Tooltip("stat:Q", format=".3g")])
    rule = alt.Chart(pd.DataFrame({"h": [threshold]})).mark_rule(color="black", strokeDash=[4, 3]).encode(
        y="h:Q", tooltip=[alt.Tooltip("h:Q", title="threshold")])
    return alt.layer(lines.add_params(_zoom()), rule)


def frontier_chart(cells: pd.DataFrame, x: str, order: Sequence, *, labels: dict | None = None) -> alt.Chart:
    """The stability frontier: P(collapse) per cell with its Wilson 95% bar against `x` (level or
    lag) at the values `order`, one line per preset label (and lag mode when the cells have
    several); a corrected preset dashed; with a `level` column and x = lag, one panel per level.
    Hover gives k/n, the interval, the median onset and final success."""
    data = cells.copy()
    data["x"] = data[x].map(lambda v: (labels or {}).get(v, lag_label(v) if x == "lag" else str(v)))
    modes = "lag_mode" in data.columns and data["lag_mode"].nunique() > 1
    data["series"] = data["algo"].astype(str) + (" (" + data["lag_mode"].astype(str) + ")" if modes else "")
    data["corrected"] = data["algo"].astype(str).str.contains("+", regex=False).map({True: "corrected", False: ""})
    data["k/n"] = data["collapsed"].astype(int).astype(str) + "/" + data["runs"].astype(int).astype(str)
    first = data.drop_duplicates("series")
    sort = [(labels or {}).get(v, lag_label(v) if x == "lag" else str(v)) for v in order]
    color = alt.Color("series:N", title="preset", scale=_series_colors(first), legend=alt.Legend(labelLimit=320))
    xenc = alt.X("x:N", sort=sort, title=x if x != "lag" else "lag k", axis=alt.Axis(labelAngle=0))
    dodge = alt.XOffset("series:N", scale=alt.Scale(paddingInner=0.3))  # a cell's series side by side
    yscale = alt.Scale(domain=[0, 1])
    tip = ["series:N", "x:N", "k/n:N", alt.Tooltip("collapse_p:Q", title="P(collapse)", format=".2f"),
           alt.Tooltip("collapse_p_low:Q", title="95% low", format=".2f"),
           alt.Tooltip("collapse_p_high:Q", title="95% high", format=".2f"),
           alt.Tooltip("median_onset:Q", title="median onset"), alt.Tooltip("final_success:Q", format=".3f")]
    grid = x == "lag" and "level" in data.columns
    base = alt.Chart()  # the data and the size sit on the layer (a facet needs the data there)
    dash = alt.StrokeDash("corrected:N", legend=None, scale=alt.Scale(domain=["", "corrected"], range=[[1, 0], [5, 3]]))
    bars = base.mark_rule(opacity=0.6).encode(x=xenc, xOffset=dodge, y=alt.Y("collapse_p_low:Q", scale=yscale),
                                              y2="collapse_p_high:Q", color=color, tooltip=tip)
    line = base.mark_line(point=alt.OverlayMarkDef(size=40, filled=True)).encode(
        x=xenc, xOffset=dodge, y=alt.Y("collapse_p:Q", title="P(collapse)  (Wilson 95%)", scale=yscale),
        color=color, strokeDash=dash, tooltip=tip)
    chart = alt.layer(bars, line, data=data).properties(width=260 if grid else WIDTH, height=260)
    if grid:
        return chart.facet(column=alt.Column("level:N", title=None))
    # its own size (Streamlit fits a single view into width × height otherwise, legend included)
    return chart.properties(title="stability frontier: P(collapse) per cell",
                            autosize=alt.AutoSizeParams(type="pad", contains="padding"))
