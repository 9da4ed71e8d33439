"""Variant comparison: Figs. 3-5 for the chosen presets and model sizes (mean ± 95% CI across
seeds), smoothing and log scale, and the statistics tables (collapse, final success with Welch's
test, clip ratio / KL, clipping-bias growth)."""

import streamlit as st

import analysis
from dashboard import common

st.header("Variant comparison")
study, runs, collapse, kept = common.page_runs("compare", columns=("algo", "model", "task"))

c1, c2, c3 = st.columns(3)
smoothing = c1.slider("EMA smoothing", 0.0, 0.95, 0.0, 0.05, key="compare:smoothing")
log_scale = c2.toggle("Log scale (norms, clip ratio, KL)", value=False, key="compare:log")
window = c3.number_input("Growth-fit window (steps)", 3, 1000, 20, key="compare:window")
if kept.groupby(["algo", "model", "task"]).size().max() < 2:
    st.info("Confidence bands need at least two seeds per preset; curves show single runs.")

metrics = study.metrics[study.metrics["run_id"].isin(list(kept["run_id"]))]
st.subheader("Token vs turn level (Fig. 3)")
st.pyplot(analysis.fig_token_vs_turn(metrics, smoothing=smoothing, log_scale=log_scale))
st.subheader("Success by preset and model size (Fig. 4)")
narrow = kept["model"].nunique() == 1  # one panel: keep it at a readable size
where = st.columns([3, 2])[0] if narrow else st.container()
where.pyplot(analysis.fig_success_by_preset(metrics, smoothing=smoothing))
st.subheader("Clip ratio and KL (Fig. 5)")
st.pyplot(analysis.fig_clip_kl(metrics, smoothing=smoothing, log_scale=log_scale))

st.subheader("Per preset")
presets = analysis.preset_table(study, runs=kept)
st.dataframe(presets, hide_index=True)

st.subheader("Final success: pairwise tests")
sig = analysis.significance_table(study, runs=kept, n_boot=2000)
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
