"""Variant comparison: Figs. 3-5 for the chosen presets and model sizes as interactive charts (mean
and a 95% band across seeds that stays in the quantity's range; seed counts where seeds drop out;
a brush over steps on the first panel filters the others), smoothing and log scale, and the
statistics tables (collapse, final success with Welch's test, clip ratio / KL, clipping-bias growth).
Presets are split by the study's axes (level = experiment, lag, lag mode) where they vary: one
curve and one table row per preset and axis value, pairwise tests within each."""

import streamlit as st

import analysis
from analysis import charts as C
from analysis.figures import FIG3_METRICS, FIG5_METRICS
from analysis.stats import GROUP
from dashboard import common
from stppo import metric_names as T

st.header("Variant comparison")
study, runs, collapse, kept = common.page_runs("compare", columns=("algo", "model", "task"))
split = common.split_by(kept, "compare")

c1, c2, c3 = st.columns(3)
smoothing = c1.slider("EMA smoothing", 0.0, 0.95, 0.0, 0.05, key="compare:smoothing")
log_scale = c2.toggle("Log scale (norms, clip ratio, KL)", value=False, key="compare:log")
window = c3.number_input("Growth-fit window (steps)", 3, 1000, 20, key="compare:window")
if kept.groupby([*split, "algo", "model", "task"]).size().max() < 2:
    st.info("Confidence bands need at least two seeds per preset; curves show single runs.")

metrics = common.series_metrics(study.metrics, kept, split)
st.caption("Bands: 95% bootstrap interval of the mean for rates and non-negative quantities (it stays in "
           "their range), t-interval otherwise; points marked n=k where fewer seeds remain. Drag over steps on "
           "the first panel to filter the others; wheel zooms, drag pans; hover for values and seed counts.")
st.subheader("Token vs turn level (Fig. 3)")
logs = [k for k in FIG3_METRICS if log_scale and "success" not in k]
common.chart(C.band_charts(metrics, FIG3_METRICS, smoothing=smoothing, log_keys=logs),
             "The selected runs logged none of the Fig. 3 metrics.")
st.subheader("Success by preset and model size (Fig. 4)")
key = T.VAL_SUCCESS_RATE if (metrics["metric"] == T.VAL_SUCCESS_RATE).any() else T.SUCCESS_RATE
for model in sorted(kept["model"].astype(str).unique()):
    common.chart(C.band_charts(metrics[metrics["model"] == model], [key], smoothing=smoothing),
                 f"Model {model}: no {key} logged.")
    st.caption(f"{key} — model {model}")
st.subheader("Clip ratio and KL (Fig. 5)")
keys = [k for k in FIG5_METRICS if k != T.KL_REF or (metrics["metric"] == T.KL_REF).any()]
common.chart(C.band_charts(metrics, keys, smoothing=smoothing, log_keys=keys if log_scale else ()),
             "The selected runs logged no clip ratio or KL.")

st.subheader("Per preset")
presets = analysis.preset_table(study, by=(*split, *GROUP), runs=kept)
st.dataframe(presets, hide_index=True)

st.subheader("Final success: pairwise tests")
sig = analysis.significance_table(study, within=(*split, "model", "task"), runs=kept, n_boot=2000)
if sig.empty:
    st.info("Choose at least two presets with the same model and task to compare them.")
else:
    st.caption(f"Test: {sig['test'].iloc[0]}")
    st.dataframe(sig.drop(columns="test"), hide_index=True)

st.subheader("Clipping-bias growth before collapse")
sub_collapse = collapse[collapse["run_id"].isin(list(kept["run_id"]))]
growth = analysis.growth_table(study, window=int(window), collapse=sub_collapse)
st.caption(f"Fit log(clip_bias/norm) = a + b·step over the {int(window)} steps before each collapse "
           "(runs without collapse: their last steps); b = growth rate per step.")
st.dataframe(analysis.growth_summary(growth), hide_index=True)
with st.expander("Per run"):
    st.dataframe(growth, hide_index=True)
